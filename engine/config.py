"""Engine configuration: one dataclass whose fields declare every engine setting (default, meaning,
limits) once; flags, config files and node command lines follow from them (`pdserve.cluster.schema`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.cluster.schema import setting, validate

SCHEDULING_POLICIES = ("continuous", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8")
KERNEL_BACKENDS = ("auto", "torch", "triton", "cpu")
CPU_LINEAR_BACKENDS = ("auto", "torch", "onednn")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = setting(
        None,
        "checkpoint directory in Hugging Face format, or pdserve-stories / pdserve-tiny (unset: $PDSERVE_MODEL, else pdserve-stories)",
    )
    dtype: str = setting(
        "auto", "weights and KV cache dtype; auto: float32 on CPU, bfloat16 on GPU", choices=DTYPES
    )
    device: str = setting(
        "auto",
        "cpu, cuda or cuda:N; auto: cuda when available, else cpu (tensor-parallel rank r: the "
        "r-th device from there)",
    )
    tensor_parallel_size: int = setting(
        1,
        "devices (processes) one node's model is split over; rank 0 schedules and samples",
        minimum=1,
    )
    block_size: int = setting(16, "tokens per KV block", minimum=1)
    kv_cache_dtype: str = setting(
        "auto",
        "KV cache dtype: auto (the model's dtype) or fp8 (float8_e4m3fn with a float32 scale per "
        "token and KV head inside each page: about half the bytes of bfloat16; not for "
        "linear-attention hybrids or models whose layers' pages differ in shape)",
        choices=KV_CACHE_DTYPES,
    )
    kv_cache_bytes: int | None = setting(
        None, "CPU KV pool budget per node in bytes (unset: 1 GiB)", minimum=1
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "fraction of free GPU memory a node's KV pool takes",
        above=0,
        maximum=1,
        old_names=("kv_memory_fraction",),
    )
    num_kv_blocks: int | None = setting(
        None,
        "KV blocks per node, overriding both budgets (unset: from kv_cache_bytes or gpu_memory_utilization)",
        minimum=1,
    )
    max_num_seqs: int = setting(256, "sequences per step on a node", minimum=1)
    max_num_batched_tokens: int = setting(
        2048,
        "tokens per step on a node (the chunked-prefill chunk)",
        minimum=1,
        old_names=("chunk_size",),
    )
    max_model_len: int | None = setting(None, "context limit (unset: the model's)", minimum=1)
    enable_chunked_prefill: bool = setting(
        True,
        "prefill a prompt longer than max_num_batched_tokens over several steps (off: refuse it)",
    )
    enable_prefix_caching: bool = setting(True, "reuse KV of shared prompt prefixes")
    linear_snapshot_interval: int = setting(
        1,
        "linear-attention hybrids (Qwen3.5, Qwen3-Next): keep a layer's state in the prefix "
        "cache at every Nth block boundary (1: every block; a prefix hit ends on a kept one)",
        minimum=1,
    )
    kv_host_bytes: int | None = setting(
        None,
        "host-memory KV tier under the prefix cache, in bytes: every full cached block is "
        "copied there off the step loop and loaded back when a prompt's prefix left the pool "
        "(unset: twice the KV pool on a GPU node, at most half the host's memory over its GPUs; "
        "on a CPU node none, or the pool's size with a disk tier; 0: off; nodes of one process "
        "only)",
        minimum=0,
    )
    kv_disk_path: str | None = setting(
        None,
        "directory of a local-disk KV tier under the host tier (each node writes a "
        "subdirectory of its own and removes it on exit; unset: no disk tier)",
    )
    kv_disk_bytes: int | None = setting(
        None,
        "the disk tier's size in bytes (unset: 90% of the disk's free space, at most 64 GiB)",
        minimum=1,
    )
    forced_tokens: bool = setting(
        False,
        "structured outputs: where a request's grammar allows exactly one next token, append it "
        "without a step of its own (its KV is computed with the next step's token); the output "
        "is the same token for token; not for requests that ask for logprobs",
    )
    grammar_compile_timeout_s: float = setting(
        10.0,
        "structured outputs: seconds a request waits for its grammar to compile (from when it "
        "reaches the node) before it ends with an error naming this limit; the compile itself "
        "cannot be stopped: it runs on, holding the node's compile thread, and its grammar is "
        "cached, so the same spec compiles at once next time",
        above=0,
    )
    scheduling_policy: str = setting(
        "continuous",
        "node step loops: continuous (admit whenever there is room) or static (a batch runs until all of it finished; the baseline)",
        choices=SCHEDULING_POLICIES,
    )
    kernel_backend: str = setting(
        "auto",
        "attention/norm/rotary kernels: auto (triton on CUDA, cpu on CPU), torch (the reference), "
        "triton, or cpu (the reference with a C paged-attention kernel reading KV pages in place)",
        choices=KERNEL_BACKENDS,
    )
    enforce_eager: bool = setting(False, "run decode steps eagerly, never from CUDA graphs")
    compile: bool = setting(
        False,
        "run the model step compiled (torch.compile, token counts padded to power-of-two buckets; "
        "CPU nodes without tensor parallelism; needs g++); on failure it says so and runs eagerly",
    )
    cpu_linear: str = setting(
        "auto",
        "linear layers of CPU nodes: onednn (weights packed once for oneDNN; float32, not with "
        "--compile), torch (F.linear), or auto (onednn where it can run, else torch)",
        choices=CPU_LINEAR_BACKENDS,
    )
    cuda_graph_max_batch_size: int = setting(
        256, "largest decode batch captured as a CUDA graph (capped at max_num_seqs)", minimum=1
    )
    cpu_threads: int | None = setting(
        None,
        "intra-op math threads of each rank of a CPU node (unset: one per core of its share)",
        minimum=1,
    )
    cpu_adaptive_threads: bool = setting(
        True,
        "a CPU node without tensor parallelism drops to one intra-op thread while other "
        "processes hold its cores (its threads measured descheduled in its steps) and returns "
        "to all of them once the cores sit idle",
    )
    cpu_bind: str | None = setting(
        None,
        "cores a CPU node runs on, split among its tensor-parallel ranks: a list like 0-1 or 0,2, "
        "or auto (the cores it may use); unset: not bound (nodes that `pdserve serve` or "
        "`pdserve launch` start together on a host get disjoint shares of its cores)",
    )
    seed: int = setting(0, "seed of the engine's own random state (requests carry their own seeds)")
    speculative_config: str | None = setting(
        None,
        'speculative decoding, as vLLM\'s JSON: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
        "verifies up to 4 tokens a step that follow an earlier occurrence of a sequence's last "
        '2-4 tokens in its context; \'{"method": "draft_model", "model": "DIR", '
        '"num_speculative_tokens": 4}\' verifies up to 4 tokens a step proposed greedily by a '
        "draft model of the same vocabulary (a checkpoint directory or an embedded model's name) on "
        "rank 0, whose KV pool has as many blocks as the node's, out of the same budget, or "
        '"draft_num_kv_blocks" blocks where given (the node\'s pool takes the rest), and caches '
        'prefixes as the node\'s does; "disable_by_batch_size": N verifies no drafts in a step '
        "whose batch runs more than N sequences (unset: off)",
    )

    def __post_init__(self) -> None:
        validate(self)
        self.speculation()  # a malformed speculative_config fails here, naming what is wrong
        if self.kv_disk_path is not None and self.kv_host_bytes == 0:
            raise ValueError("kv_disk_path: the disk KV tier sits under the host tier, which "
                             "kv_host_bytes=0 turns off")  # fmt: skip
        if self.tensor_parallel_size > 1 and (self.kv_host_bytes or self.kv_disk_path is not None):
            raise ValueError(
                "kv_host_bytes, kv_disk_path: KV tiers run on nodes of one process, not with "
                f"tensor_parallel_size {self.tensor_parallel_size}"
            )
        if self.cpu_bind is not None and self.cpu_bind != "auto":
            from pdserve.engine.cpu.threads import parse_cores

            parse_cores(self.cpu_bind)

    def speculation(self):  # noqa: ANN201 - SpeculativeConfig | None
        """The parsed speculative_config, or None when speculation is off."""
        if self.speculative_config is None:
            return None
        from pdserve.engine.spec_decode.speculation import SpeculativeConfig

        return SpeculativeConfig.parse(self.speculative_config)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def rank_device(self, rank: int) -> str:
        """The device of tensor-parallel rank `rank`: cuda:N + rank on a GPU host, else cpu."""
        device = self.resolved_device()
        if not device.startswith("cuda"):
            return device
        first = int(device.partition(":")[2] or 0)
        return f"cuda:{first + rank}"

    def context_limit(self, max_position_embeddings: int, num_blocks: int) -> int:
        """The longest sequence a node runs: max_model_len (or the model's), at most what the
        KV pool holds."""
        return min(self.max_model_len or max_position_embeddings, num_blocks * self.block_size)

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device().startswith("cuda") else "float32"

    def kv_dtype(self) -> str:
        """The KV layout's dtype: the model's, or FP8 pages with their scales."""
        from pdserve.kernels.kv_fp8_ref import FP8_KV_DTYPE

        return FP8_KV_DTYPE if self.kv_cache_dtype == "fp8" else self.resolved_dtype()


NODE_ROLES = ("prefill", "decode", "colocated")


@dataclass(slots=True)
class RoleTensorParallel:
    """Tensor-parallel sizes by node role, for the nodes `pdserve serve` starts: prefill wants
    compute per request, decode wants replicas, so they may differ (the KV handoff reshards)."""

    prefill_tensor_parallel_size: int | None = setting(
        None, "devices per prefill node (unset: tensor_parallel_size)", minimum=1
    )
    decode_tensor_parallel_size: int | None = setting(
        None, "devices per decode or colocated node (unset: tensor_parallel_size)", minimum=1
    )

    def __post_init__(self) -> None:
        validate(self)

    def engine_for(self, role: str, engine: EngineConfig) -> EngineConfig:
        """The engine settings of a node of this role."""
        if role not in NODE_ROLES:
            raise ValueError(f"unknown node role {role!r}")
        size = (
            self.prefill_tensor_parallel_size
            if role == "prefill"
            else self.decode_tensor_parallel_size
        )
        return engine if size is None else replace(engine, tensor_parallel_size=size)
