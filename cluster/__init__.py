"""What the coordinator and the nodes share, importing no torch: the wire messages and their
codec, sampling parameters, a node's link to the coordinator, a KV handoff's states, and the
settings schema."""
