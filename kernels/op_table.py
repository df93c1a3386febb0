"""The op table the engine calls: one callable per op, whichever backend provides them
(`pdserve.kernels.ops` chooses one at start-up)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class PagedAttention(Protocol):
    """Causal attention of a varlen batch of queries over paged KV, as
    `attention_ref.paged_attention` defines it. window (a sliding window), chunk (chunked local
    attention) and sinks (a logit per head) are a layer's constants, fixed for every call of that
    layer (so a CUDA graph captures them); their defaults (0, 0, None) are full causal attention."""

    def __call__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        max_query_len: int | None = None,
        *,
        window: int = 0,
        chunk: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class Ops:
    name: str
    store_kv: Callable
    paged_attention: PagedAttention
    rms_norm: Callable
    fused_add_rms_norm: Callable
    apply_rotary: Callable
    fused_moe: Callable  # a mixture-of-experts MLP over stacked expert weights
    store_latent: Callable  # MLA: write tokens' latents into one layer's latent pages
    latent_attention: Callable  # MLA: absorbed attention, MQA over the latent pages
    # Linear attention: one token of the gated delta rule for each decoding sequence
    gated_delta_step: Callable
