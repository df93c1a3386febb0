"""The KV cache of one engine: its layout and preallocated pool (`cache`), the block manager that
maps sequences' logical blocks to physical ones with reference counts and prefix caching
(`block_manager`), what each layer reads and how layers of a kind group (`layer_kinds`,
`groups`), a sequence's blocks in every group (`kv_manager`), the host and disk tiers under the
pool (`tiers`, `host_tier`, `disk_tier`) and the log of what the cache stored and evicted
(`events`). It imports the model's config (to size a layout), the sequence (whose tables the KV
manager keeps), `cluster.block_hash` and the kernels; nothing else of the engine. `kv_transfer`
may import `kv.cache` and nothing else of the engine."""
