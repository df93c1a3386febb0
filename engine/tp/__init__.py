"""Tensor parallelism: a node of several devices as ranks. `group` (the ranks' collectives),
`shard` (which heads and rows a rank owns) and `parallel_layers` (the sharded embedding, LM head
and row-parallel linear) are what model definitions build on; `model_shard` (one rank's model, KV
pool and runner), `plan_channel` (rank 0's step plans to the others), `worker` (a rank's process),
`ranks` (rank 0 starting and watching them, and forming its own shard with them) and `executor`
(rank 0 running a step on all ranks) sit above `models`, `kv` and `execution`, which they import.
Nothing here imports a node role or a transport: a rank's KV endpoint is handed in by the node
(`RankSpec.kv_endpoint`)."""
