"""Triton one-token gated delta rule for decoding sequences, matching `gated_delta_ref.
gated_delta_step`: for each sequence and value head, its key and query L2-normalised (the query
scaled by 1/sqrt(key dim)), then S <- S * exp(g); S <- S + k (beta (v - S^T k))^T; out = S^T q,
in float32.

One program per (sequence, value head, tile of value dims): a column of S depends only on itself
(S^T k, the delta and S^T q are per column), so tiles of value dims run apart and each program
holds a [key dim, tile] block of the state. A value head reads key head h // (value heads / key
heads), as the reference repeats them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

EPS = 1e-6  # the L2 norm's, as the reference's (and FLA's)


@triton.jit
def _gated_delta_step_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    out_ptr,
    new_state_ptr,
    num_k_heads,
    num_v_heads,
    key_dim,
    value_dim,
    scale,
    eps,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2)
    key_head = head // (num_v_heads // num_k_heads)
    dk = tl.arange(0, BLOCK_K)
    dv = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = dk < key_dim
    mask_v = dv < value_dim
    key_row = (seq * num_k_heads + key_head) * key_dim
    q = tl.load(q_ptr + key_row + dk, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + key_row + dk, mask=mask_k, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
    value_row = seq * num_v_heads + head
    v = tl.load(v_ptr + value_row * value_dim + dv, mask=mask_v, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + value_row).to(tl.float32)
    beta = tl.load(beta_ptr + value_row).to(tl.float32)
    offsets = value_row * key_dim * value_dim + dk[:, None] * value_dim + dv[None, :]
    mask = mask_k[:, None] & mask_v[None, :]
    state = tl.load(state_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * tl.exp(g)
    remembered = tl.sum(state * k[:, None], axis=0)  # S^T k, this tile's columns
    delta = (v - remembered) * beta
    state = state + k[:, None] * delta[None, :]
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(new_state_ptr + offsets, state, mask=mask)
    tl.store(out_ptr + value_row * value_dim + dv, out, mask=mask_v)


def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `gated_delta_ref.gated_delta_step`: q, k [n, key heads, key dim], v [n, value heads,
    value dim], g and beta [n, value heads], states [n, value heads, key dim, value dim]; returns
    (out [n, value heads, value dim], the states after the token), float32."""
    n, num_k_heads, key_dim = q.shape
    _, num_v_heads, value_dim = v.shape
    if num_v_heads % num_k_heads:
        raise ValueError(f"{num_v_heads} value heads do not divide over {num_k_heads} key heads")
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    state = state.float().contiguous()
    out = torch.empty(n, num_v_heads, value_dim, dtype=torch.float32, device=v.device)
    new_state = torch.empty_like(state)
    if n == 0:
        return out, new_state
    block_k = triton.next_power_of_2(key_dim)
    block_v = min(triton.next_power_of_2(value_dim), 32)
    grid = (n, num_v_heads, triton.cdiv(value_dim, block_v))
    _gated_delta_step_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        state,
        out,
        new_state,
        num_k_heads,
        num_v_heads,
        key_dim,
        value_dim,
        key_dim**-0.5,
        EPS,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
    )
    return out, new_state
