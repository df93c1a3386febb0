"""The Triton op table for CUDA tensors: the same calls and return conventions as the torch
references in `pdserve.kernels.ops.REFERENCE`, which stay the ground truth in tests. Paged
attention picks its prefill kernel by the GPU's capability (`triton_prefill_hopper`)."""

from __future__ import annotations

from pdserve.kernels.op_table import Ops
from pdserve.kernels.triton_gated_delta import gated_delta_step
from pdserve.kernels.triton_kv import store_kv
from pdserve.kernels.triton_mla import latent_attention, store_latent
from pdserve.kernels.triton_moe import fused_moe
from pdserve.kernels.triton_norm import fused_add_rms_norm, rms_norm
from pdserve.kernels.triton_prefill_hopper import paged_attention
from pdserve.kernels.triton_rotary import apply_rotary

TRITON = Ops(
    name="triton",
    store_kv=store_kv,
    paged_attention=paged_attention,
    rms_norm=rms_norm,
    fused_add_rms_norm=fused_add_rms_norm,
    apply_rotary=apply_rotary,
    fused_moe=fused_moe,
    store_latent=store_latent,
    latent_attention=latent_attention,
    gated_delta_step=gated_delta_step,
)
