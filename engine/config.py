"""Engine configuration: one dataclass, validated when made."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULING_POLICIES = ("continuous", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KERNEL_BACKENDS = ("auto", "torch", "triton")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # checkpoint directory; None = the embedded pdserve-tiny
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    device: str = "auto"  # auto: cuda when available, else cpu
    block_size: int = 16
    kv_cache_bytes: int | None = None  # CPU pool budget; default 1 GiB
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # overrides both budgets (tests, benchmarks)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: str = "continuous"
    kernel_backend: str = "auto"  # auto | torch | triton
    enforce_eager: bool = False  # never replay decode steps from CUDA graphs
    cuda_graph_max_batch_size: int = 256  # largest decode batch captured (capped at max_num_seqs)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(
                f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}"
            )
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "cuda_graph_max_batch_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device().startswith("cuda") else "float32"
