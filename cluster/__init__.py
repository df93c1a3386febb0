"""What the coordinator and the nodes share, importing no torch: the wire messages and their
codec, sampling parameters, a node's link to the coordinator, and the settings schema."""
