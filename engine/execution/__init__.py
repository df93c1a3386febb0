"""Running one scheduled step on a model: the runner that turns a step plan into tensors and runs
the forward over the paged pool (`runner`, `forward_batch`), the executor that samples and
verifies (`executor`), the compiled step (`compiled_step`) and CUDA graphs of decode batches
(`decode_graphs`). It imports models, the KV cache, the sampler, the step plan and the kernels;
the decisions it executes are made by the scheduler, which does not import it."""
