"""Model definitions and how they are loaded: a checkpoint's config (`config`), its tensors
(`weights`), building a model from them (`loader`), and the families (`llama` with its MoE, MLA
and gpt-oss variants, `moe`, `moe_router`, `mla`, `gpt_oss`, `norm`; `gemma3`). Models import the
kernels' op table, the KV layout, the CPU linear layers and tensor parallelism's layer pieces
(`tp.group`, `tp.shard`, `tp.parallel_layers`); never the scheduler, the executor or a node."""
