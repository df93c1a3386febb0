"""The op table the engine calls: one callable per op, whichever backend provides them
(`pdserve.kernels.ops` chooses one at start-up)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Ops:
    name: str
    store_kv: Callable
    paged_attention: Callable
    rms_norm: Callable
    fused_add_rms_norm: Callable
    apply_rotary: Callable
    fused_moe: Callable  # a mixture-of-experts MLP over stacked expert weights
    store_latent: Callable  # MLA: write tokens' latents into one layer's latent pages
    latent_attention: Callable  # MLA: absorbed attention, MQA over the latent pages
