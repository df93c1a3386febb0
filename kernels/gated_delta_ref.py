"""The gated delta rule of a Gated DeltaNet layer (Qwen3-Next, Qwen3.5) and its short causal
convolution, in torch: a chunked form for a run of a sequence's tokens and a one-token form for a
batch of decoding sequences, each from a given state and returning the state after it.

The recurrence per value head, with the key and query L2-normalised and the query scaled by
1/sqrt(key dim): S <- S * exp(g); S <- S + k (beta (v - S^T k))^T; out = S^T q. It runs in
float32 whatever the model's dtype, as transformers' torch_chunk_gated_delta_rule and
torch_recurrent_gated_delta_rule do; the chunked form is their UT-transform algorithm. The one-token
form is the op table's `gated_delta_step` reference (`triton_gated_delta` is its CUDA kernel)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

CHUNK = 64  # tokens per chunk of the chunked form, as transformers' (and FLA's) default


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x over its last dimension's L2 norm (eps inside the root), as FLA and transformers do."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of one sequence's tokens x [L, C] after the inputs in
    `window` [C, K - 1] (the previous K - 1 tokens', zeros before the first), by weight [C, K]:
    (its SiLU [L, C], the window after x: the last K - 1 inputs)."""
    inputs = torch.cat([window.to(x.dtype), x.t()], dim=-1)  # [C, K - 1 + L]
    out = F.conv1d(inputs[None], weight[:, None, :], groups=weight.shape[0])[0]
    return F.silu(out).t(), inputs[:, -window.shape[-1] :]


def causal_conv_step(
    x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token each of n sequences, x [n, C], after their windows [n, C, K - 1]: (the SiLU
    of its convolution [n, C], the windows after it)."""
    inputs = torch.cat([windows.to(x.dtype), x[:, :, None]], dim=-1)  # [n, C, K]
    out = F.conv1d(inputs, weight[:, None, :], groups=weight.shape[0])[..., 0]
    return F.silu(out), inputs[..., 1:]


def _value_heads(x: torch.Tensor, num_v_heads: int, dim: int) -> torch.Tensor:
    """Key or query heads repeated for their value heads (each key head serves
    num_v_heads / num_k_heads consecutive ones)."""
    repeat = num_v_heads // x.shape[dim]
    return x if repeat == 1 else x.repeat_interleave(repeat, dim=dim)


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's L tokens: q, k [L, key heads, key dim], v [L, value heads, value dim], g
    (log decay, <= 0) and beta [L, value heads], from state [value heads, key dim, value dim].
    Returns (out [L, value heads, value dim], the state after the last token), float32."""
    length, num_v_heads, _ = v.shape
    q = l2norm(_value_heads(q, num_v_heads, 1).float()).transpose(0, 1)  # [H, L, Dk]
    k = l2norm(_value_heads(k, num_v_heads, 1).float()).transpose(0, 1)
    v = v.float().transpose(0, 1)  # [H, L, Dv]
    beta = beta.float().t()  # [H, L]
    g = g.float().t()
    q = q * q.shape[-1] ** -0.5
    pad = (chunk - length % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    heads, n = v.shape[0], (length + pad) // chunk
    v_beta = v * beta[..., None]
    k_beta = k * beta[..., None]
    q, k, v_beta, k_beta = (x.reshape(heads, n, chunk, x.shape[-1]) for x in (q, k, v_beta, k_beta))
    decay = g.reshape(heads, n, chunk).cumsum(-1)  # log of the decay from the chunk's start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # exp(decay_i - decay_j) for j <= i: what token j's contribution has decayed by at token i.
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    # The UT transform: the chunk's delta-rule updates solved as one lower-triangular system.
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    inner = (q @ k.transpose(-1, -2)) * pairwise
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True
    )
    state = state.float().clone()
    out = torch.zeros_like(u)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ state
        out[:, i] = q[:, i] @ state + inner[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(heads, n * chunk, -1)[:, :length]
    return out.transpose(0, 1), state


def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token each of n sequences: q, k [n, key heads, key dim], v [n, value heads, value
    dim], g and beta [n, value heads], from states [n, value heads, key dim, value dim].
    Returns (out [n, value heads, value dim], the states after the token), float32."""
    num_v_heads = v.shape[1]
    q = l2norm(_value_heads(q, num_v_heads, 1).float())
    k = l2norm(_value_heads(k, num_v_heads, 1).float())
    q = q / (q.shape[-1] ** 0.5)
    state = state.float() * g.float().exp()[..., None, None]
    remembered = (state * k[..., None]).sum(dim=-2)  # what the state gives for k: S^T k
    delta = (v.float() - remembered) * beta.float()[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state
