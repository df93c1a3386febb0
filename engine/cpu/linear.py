"""Linear layers on CPU through oneDNN, each weight packed once after loading into oneDNN's
blocked layout (what vLLM's CPU backend does for its dense projections). `F.linear` on the plain
row-major weight re-lays the weight out for the matmul on every call; on a 2-core CPU the packed
path took the vocabulary projection of a 52M-parameter Llama at 1.7x the rate for 40 tokens.

Float32 only (oneDNN's bfloat16 path needs AVX-512 BF16 to pay), CPU only, and not with the
compiled step (inductor packs weights its own way). A packed layer drops its plain weight, unless
another layer shares it (a tied embedding keeps it for the lookup).

oneDNN builds a kernel for every number of rows it is called with and keeps it (its primitive
cache and ideep's hold about 0.6 MiB per row count and weight shape, up to 1,024 of each): a
prefill node, which sees every row count up to its token budget, grew by hundreds of MiB. So
rows go to oneDNN in pieces of at most MAX_ROWS, each padded to one of `row_counts()`."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn import functional as F

logger = logging.getLogger(__name__)

# The batch size oneDNN lays the packed weight out for; any batch runs on it.
BATCH_HINT = 32
# Rows per oneDNN call at most (past about 32 rows the time per row no longer falls), and the
# row counts run as they are (a decode batch of a few sequences is not padded).
MAX_ROWS = 256
EXACT_ROWS = 16


def padded_rows(m: int) -> int:
    """The row count a piece of m rows (m <= MAX_ROWS) runs at: m up to EXACT_ROWS, else m
    rounded up to one of eight counts per doubling (at most an eighth more rows)."""
    if m <= EXACT_ROWS:
        return max(m, 1)
    step = 1 << (m.bit_length() - 4)  # 2 ** (floor(log2(m)) - 3)
    return -(-m // step) * step


def row_counts() -> list[int]:
    """Every row count oneDNN is called with: what bounds its caches."""
    return sorted({padded_rows(m) for m in range(1, MAX_ROWS + 1)})


def packing_unavailable(device: str, dtype: str, compiled: bool) -> str | None:
    """Why the onednn backend cannot serve this node (one line), or None when it can."""
    if not device.startswith("cpu"):
        return "packed linear layers are for CPU nodes"
    if dtype != "float32":
        return f"packed linear layers are float32 only (this node runs {dtype})"
    if compiled:
        return "the compiled step packs its own weights"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    return None


def choose(setting: str, device: str, dtype: str, compiled: bool) -> bool:
    """Whether to pack: `onednn` where it can (else a log line says why not); `auto` as onednn,
    without the log line; `torch` never."""
    if setting == "torch":
        return False
    why = packing_unavailable(device, dtype, compiled)
    if why is not None and setting == "onednn":
        logger.warning("cpu_linear onednn: %s; linear layers run through F.linear", why)
    return why is None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    if packed is None:
        return F.linear(x, weight, bias)
    if x.dim() != 2:
        y = linear(x.reshape(-1, x.shape[-1]), weight, bias, packed)
        return y.view(*x.shape[:-1], y.shape[-1])
    m = x.shape[0]
    if m > MAX_ROWS:
        pieces = [x[i : i + MAX_ROWS] for i in range(0, m, MAX_ROWS)]
        return torch.cat([_packed_linear(piece, packed, bias) for piece in pieces])
    return _packed_linear(x, packed, bias)


def _packed_linear(
    rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    m = rows.shape[0]
    padded = padded_rows(m)
    if padded == m:
        return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    rows = F.pad(rows, (0, 0, 0, padded - m))
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")[:m]


class Linear(nn.Linear):
    """nn.Linear that runs on its packed weight once `pack` has made one."""

    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


def pack(model: nn.Module) -> int:
    """Pack the weight of every layer of `model` that runs through `linear` (those with a
    `packed` attribute) and drop its plain weight, unless another layer shares it (a tied
    embedding), and every expert's two matrices of a mixture of experts (modules with a
    `packed_experts` attribute: `w13[e]`, `w2[e]`); the number of matrices packed."""
    ours = [m for m in model.modules() if hasattr(m, "packed")]
    shared = {
        id(p)
        for m in model.modules()
        if not hasattr(m, "packed")
        for p in m.parameters(recurse=False)
    }
    for module in ours:
        weight = module.weight.detach()
        module.packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
        if id(module.weight) not in shared:
            empty = torch.empty(0, dtype=weight.dtype, device=weight.device)
            module.weight = nn.Parameter(empty, requires_grad=False)
    # Mixtures of experts: each expert's gate+up and down matrices, from the stacked weights.
    experts = [m for m in model.modules() if hasattr(m, "packed_experts")]
    for module in experts:
        w13, w2 = module.w13.detach(), module.w2.detach()
        module.packed_experts = [
            (
                torch.ops.mkldnn._reorder_linear_weight(w13[e], BATCH_HINT),
                torch.ops.mkldnn._reorder_linear_weight(w2[e], BATCH_HINT),
            )
            for e in range(w13.shape[0])
        ]
        empty = torch.empty(0, dtype=w13.dtype, device=w13.device)
        module.w13 = nn.Parameter(empty, requires_grad=False)
        module.w2 = nn.Parameter(empty.clone(), requires_grad=False)
    return len(ours) + 2 * sum(len(m.packed_experts) for m in experts)
