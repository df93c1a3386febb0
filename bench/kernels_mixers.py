"""The token mixers beside full attention, timed as bench/kernels.py times it and in the same run:
sliding-window decode attention (a window of 128 keys over a 4k context, as gpt-oss and Gemma
layers use) as a fraction of copy bandwidth, and the Gated DeltaNet rule of a small
Qwen3-Next-like layer: the recurrent decode step (`triton_gated_delta`, its state read and
written) as a fraction of copy bandwidth, the chunked prefill (the torch chunked form the engine
runs; there is no Triton prefill kernel) as a fraction of the matmul rate. Each is checked
against its torch reference on the same inputs before it is timed.

The byte and FLOP counts are plain functions, tested on CPU (tests/test_bench_kernels_mixers.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.bench.device_limits import DeviceLimits

# gpt-oss / Gemma sliding-window layers: a window of 128 keys over a 4k context.
WINDOW, WINDOW_CONTEXT, WINDOW_BATCH = 128, 4096, 64
# A small Qwen3-Next-like Gated DeltaNet layer: 16 key heads, 32 value heads, both of 128.
KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 16, 32, 128, 128
DELTA_BATCH = 64  # sequences in a decode step
DELTA_PROMPT = 4096  # tokens of one prefill
DELTA_CHECKED = 128  # prefill tokens checked against the step-by-step reference
CHUNK = 64


@dataclass(slots=True)
class MixerRow:
    """One timed mixer case: what it is, its time, its work and that work's share of a limit."""

    mixer: str
    case: str
    ms: float
    reference_ms: float | None
    gb: float  # bytes moved (decode) or 0
    tflop: float  # FLOPs (prefill) or 0
    fraction: float  # of copy (decode) or of the matmul (prefill)
    max_abs_error: float  # against the torch reference on the same inputs


def window_kv_bytes(batch: int, window: int, kv_heads: int, head_dim: int, elem: int) -> int:
    """K and V a window decode must read: each sequence's last `window` keys and values."""
    return batch * window * 2 * kv_heads * head_dim * elem


def delta_step_bytes(batch: int, v_heads: int, k_dim: int, v_dim: int) -> int:
    """The float32 states a recurrent step reads and writes, one [key dim, value dim] per value
    head per sequence (the token's q, k, v and gates are negligible beside them)."""
    return 2 * batch * v_heads * k_dim * v_dim * 4


def delta_chunked_flop(length: int, v_heads: int, k_dim: int, v_dim: int, chunk: int) -> int:
    """Matmul FLOPs of the chunked form over `length` tokens (padded to whole chunks): per chunk
    and value head the two C x C score products, the two triangular solves, and the state's
    three C x Dk x Dv products and its update."""
    chunks = -(-length // chunk)
    c = chunk
    per_chunk = 2 * (2 * c * c * k_dim)  # k_beta k^T and q k^T
    per_chunk += c * c * v_dim + c * c * k_dim  # the solves for u and w
    per_chunk += 2 * c * k_dim * v_dim * 2  # w @ state and q @ state
    per_chunk += 2 * c * c * v_dim  # inner @ v_new
    per_chunk += 2 * c * k_dim * v_dim  # k^T @ v_new into the state
    return chunks * v_heads * per_chunk


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def bench_window_decode(
    limits: DeviceLimits, time_ms: Callable[[Callable[[], object]], float], device: str = "cuda"
) -> MixerRow:
    from pdserve.bench.kernel_inputs import HEAD_DIM, NUM_KV_HEADS, paged_inputs
    from pdserve.kernels import attention_ref
    from pdserve.kernels.triton_ops import TRITON

    inputs = paged_inputs([WINDOW_CONTEXT] * WINDOW_BATCH, [1] * WINDOW_BATCH, device=device)
    got = TRITON.paged_attention(**inputs, window=WINDOW)
    want = attention_ref.paged_attention(**inputs, window=WINDOW)
    ms = time_ms(lambda: TRITON.paged_attention(**inputs, window=WINDOW))
    ref_ms = time_ms(lambda: attention_ref.paged_attention(**inputs, window=WINDOW))
    elem = inputs["k_cache"].element_size()
    num_bytes = window_kv_bytes(WINDOW_BATCH, WINDOW, NUM_KV_HEADS, HEAD_DIM, elem)
    gbps = num_bytes / (ms * 1e-3) / 1e9
    case = f"batch {WINDOW_BATCH}, window {WINDOW} of {WINDOW_CONTEXT}"
    return MixerRow(
        "window decode", case, ms, ref_ms, num_bytes / 1e9, 0.0, limits.of_copy(gbps),
        _max_error(got, want),
    )  # fmt: skip


def _delta_inputs(tokens: int, gen: torch.Generator) -> dict:
    device = gen.device

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen)

    return dict(
        q=rand(tokens, KEY_HEADS, KEY_DIM).bfloat16(),
        k=rand(tokens, KEY_HEADS, KEY_DIM).bfloat16(),
        v=rand(tokens, VALUE_HEADS, VALUE_DIM).bfloat16(),
        g=-torch.rand(tokens, VALUE_HEADS, device=device, generator=gen),  # log decay <= 0
        beta=torch.rand(tokens, VALUE_HEADS, device=device, generator=gen),
    )


def bench_delta_step(
    limits: DeviceLimits, time_ms: Callable[[Callable[[], object]], float], device: str = "cuda"
) -> MixerRow:
    from pdserve.kernels import gated_delta_ref, triton_gated_delta

    gen = torch.Generator(device=device).manual_seed(0)
    inputs = _delta_inputs(DELTA_BATCH, gen)
    state = torch.randn(DELTA_BATCH, VALUE_HEADS, KEY_DIM, VALUE_DIM, device=device, generator=gen)
    got = triton_gated_delta.gated_delta_step(**inputs, state=state)
    want = gated_delta_ref.gated_delta_step(**inputs, state=state)
    error = max(_max_error(got[0], want[0]), _max_error(got[1], want[1]))
    ms = time_ms(lambda: triton_gated_delta.gated_delta_step(**inputs, state=state))
    ref_ms = time_ms(lambda: gated_delta_ref.gated_delta_step(**inputs, state=state))
    num_bytes = delta_step_bytes(DELTA_BATCH, VALUE_HEADS, KEY_DIM, VALUE_DIM)
    gbps = num_bytes / (ms * 1e-3) / 1e9
    return MixerRow(
        "gated delta step", f"batch {DELTA_BATCH}", ms, ref_ms, num_bytes / 1e9, 0.0,
        limits.of_copy(gbps), error,
    )  # fmt: skip


def bench_delta_prefill(
    limits: DeviceLimits, time_ms: Callable[[Callable[[], object]], float], device: str = "cuda"
) -> MixerRow:
    from pdserve.kernels import gated_delta_ref

    gen = torch.Generator(device=device).manual_seed(1)
    inputs = _delta_inputs(DELTA_PROMPT, gen)
    state = torch.zeros(VALUE_HEADS, KEY_DIM, VALUE_DIM, device=device)
    # The chunked form against the recurrence it solves, token by token, on a prefix.
    prefix = {name: t[:DELTA_CHECKED] for name, t in inputs.items()}
    got, _ = gated_delta_ref.chunked_gated_delta_rule(**prefix, state=state, chunk=CHUNK)
    step_state, rows = state[None], []
    for i in range(DELTA_CHECKED):
        token = {name: t[i : i + 1] for name, t in prefix.items()}
        out, step_state = gated_delta_ref.gated_delta_step(**token, state=step_state)
        rows.append(out)
    error = _max_error(got, torch.cat(rows))
    ms = time_ms(
        lambda: gated_delta_ref.chunked_gated_delta_rule(**inputs, state=state, chunk=CHUNK)
    )
    flop = delta_chunked_flop(DELTA_PROMPT, VALUE_HEADS, KEY_DIM, VALUE_DIM, CHUNK)
    tflops = flop / (ms * 1e-3) / 1e12
    return MixerRow(
        "gated delta prefill (torch chunked)", f"1 x {DELTA_PROMPT} tokens", ms, None, 0.0,
        flop / 1e12, limits.of_matmul(tflops), error,
    )  # fmt: skip
