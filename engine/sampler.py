"""Batched sampling where the logits are (the model's device): penalties, temperature, top-k,
top-p, min-p, greedy rows by argmax, seeded rows from counter-based noise, optional logprobs.
Only the chosen token ids and the requested logprobs come back to the host."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from pdserve.engine.grammar import apply_constraints
from pdserve.engine.sequence import Sequence

MASK32 = 0xFFFFFFFF
HASH_MULTIPLIER = 0x45D9F3B
KEY_START = 0x9E3779B9  # 2**32 / the golden ratio: any nonzero 32-bit start would do


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict | None]  # per sequence: {"token": (id, lp), "top": [(id, lp), ...]}


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x's rows at the ascending indices `rows`: x itself when that is all of them (no copy)."""
    return x if len(rows) == x.shape[0] else x[_index(rows, x.device)]


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """In place, on the rows whose sequences have them: OpenAI presence/frequency penalties over
    the request's output tokens (those sampled on other nodes or attempts too, so a moved request
    samples as if it had not moved); repetition penalty (as in HF's processor) over prompt and
    output tokens."""
    rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[1]
    penalized = [seqs[i] for i in rows]
    params = [s.params for s in penalized]
    width = max(s.num_tokens for s in penalized)
    # Token ids padded with `vocab`: pads count in an extra column that is dropped.
    padding = array("q", [vocab]) * width
    flat = array("q")
    for seq in penalized:
        flat.extend(seq.token_ids)
        flat.extend(padding[: width - seq.num_tokens])
    ids = torch.frombuffer(flat, dtype=torch.long).view(len(rows), width).to(device)
    index = _index(rows, device)
    values = logits[index]
    if any(p.repetition_penalty != 1 for p in params):
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype)
        rep = rep.to(device)[:, None]
        seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device)
        seen = seen.scatter_(1, ids, True)[:, :vocab]
        penalized_values = torch.where(values > 0, values / rep, values * rep)
        values = torch.where(seen, penalized_values, values)
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        num_prompt = _index([s.num_request_prompt_tokens for s in penalized], device)
        is_output = torch.arange(width, device=device) >= num_prompt[:, None]
        counts = torch.zeros(len(rows), vocab + 1, dtype=logits.dtype, device=device)
        counts = counts.scatter_add_(1, ids, is_output.to(logits.dtype))[:, :vocab]
        frequency = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype)
        presence = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype)
        values -= frequency.to(device)[:, None] * counts
        values -= presence.to(device)[:, None] * (counts > 0)
    logits[index] = values
    return logits


def filter_probs(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Zero out tokens outside each row's top-k, nucleus top-p and min-p sets; renormalize.

    top_k: [B] int (<= 0 means off); top_p, min_p: [B] float; all on probs' device.
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[-1]
    ranks = torch.arange(vocab, device=probs.device).expand_as(sorted_probs)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    keep = ranks < k[:, None]
    # Nucleus: keep a token while the mass before it is below top_p (the top token always stays).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep &= mass_before < top_p[:, None]
    keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    keep[:, 0] = True
    sorted_probs = sorted_probs * keep
    filtered = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return filtered / filtered.sum(dim=-1, keepdim=True)


ARGMAX_CHUNK = 256


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for a [B, N] tensor, the first maximum on ties, as argmax gives.

    On CPU, torch's argmax over wide rows runs several times slower than amax, so this finds the
    chunk that holds each row's maximum with amax, then the place within it with a narrow argmax.
    """
    batch, width = x.shape
    chunk = ARGMAX_CHUNK
    if x.device.type != "cpu" or width < 2 * chunk:
        return x.argmax(dim=-1)
    full = width // chunk
    maxima = x[:, : full * chunk].reshape(batch, full, chunk).amax(dim=-1)
    if width % chunk:
        maxima = torch.cat([maxima, x[:, full * chunk :].amax(dim=-1, keepdim=True)], dim=1)
    start = maxima.argmax(dim=-1) * chunk
    # The last chunk may be short: its columns past the end repeat the last one, after it.
    cols = (start[:, None] + torch.arange(chunk, device=x.device)).clamp_(max=width - 1)
    return start + x.gather(1, cols).argmax(dim=-1)


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in [0, 2**32), in place: two multiply-xorshift
    rounds. int64 keeps every product below 2**59, so nothing overflows on any device."""
    for _ in range(2):
        x.bitwise_xor_(x >> 16).mul_(HASH_MULTIPLIER).bitwise_and_(MASK32)
    return x.bitwise_xor_(x >> 16)


def seeded_noise(
    seeds: list[int], sample_indexes: list[int], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Exp(1) noise [len(seeds), vocab_size] float32 for the exponential race: entry (r, v) is a
    pure function of (seeds[r] mod 2**64, sample_indexes[r], v), so a seeded request's n-th output
    draws the same noise whatever batch, row or node samples it."""
    keys = torch.tensor(
        [[s & MASK32, (s >> 32) & MASK32, i & MASK32] for s, i in zip(seeds, sample_indexes)],
        dtype=torch.long,
    ).to(device)
    # Chained from a nonzero start: hash32 fixes 0, and seed 0 at sample 0 must not key to 0.
    key = torch.full_like(keys[:, 0], KEY_START)
    for word in keys.unbind(1):
        key = hash32(key ^ word)
    bits = hash32(key[:, None] ^ torch.arange(vocab_size, device=device))
    # The top 23 bits to the midpoints of 2**23 equal cells of (0, 1): exact in float32, so u is
    # never 0 or 1 and the noise is finite and positive.
    u = ((bits >> 9) * 2 + 1).float().mul_(2.0**-24)
    return u.log_().neg_()


def _sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Token ids [B] drawn from the B rows' tempered, filtered distributions."""
    device = logits.device
    params = [s.params for s in seqs]
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype).to(device)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
        probs = filter_probs(
            probs,
            _index([p.top_k for p in params], device),
            torch.tensor([p.top_p for p in params], dtype=probs.dtype).to(device),
            torch.tensor([p.min_p for p in params], dtype=probs.dtype).to(device),
        )
    # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p. Unseeded rows draw E from
    # the device's generator; seeded rows take noise keyed by (seed, sample index, token).
    seeded = [j for j, p in enumerate(params) if p.seed is not None]
    noise = torch.empty_like(probs)
    if len(seeded) < len(seqs):
        noise.exponential_()
    if seeded:
        noise[_index(seeded, device)] = seeded_noise(
            [params[j].seed for j in seeded],
            [seqs[j].sample_index for j in seeded],
            probs.shape[1],
            device,
        )
    return argmax_rows(probs.div_(noise))


def _logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, token_ids: list[int], seqs: list[Sequence]
) -> list[dict]:
    """Each row's chosen-token logprob and top n, found on the device and copied in two pieces.

    raw: [B, vocab] log-softmax; tokens: the B chosen ids on raw's device, token_ids on the host.
    """
    num_top = max(s.params.logprobs or 0 for s in seqs)
    top = raw.topk(num_top, dim=-1)
    chosen = raw.gather(1, tokens[:, None])
    values = torch.cat([chosen, top.values], dim=1).tolist()
    top_ids = top.indices.tolist()
    result = []
    for seq, token, row_values, row_ids in zip(seqs, token_ids, values, top_ids):
        n = seq.params.logprobs or 0
        result.append(
            {"token": (token, row_values[0]), "top": list(zip(row_ids[:n], row_values[1 : n + 1]))}
        )
    return result


@torch.inference_mode()
def sample(logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
    """logits: [B, vocab] float32 for the B sequences that sample this step, on any device. They
    are used up: penalties are applied to them in place."""
    device = logits.device
    logprob_rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    # Logprobs are of the model's distribution, before penalties and temperature.
    raw_logprobs = None
    if logprob_rows:
        raw_logprobs = torch.log_softmax(_rows(logits, logprob_rows), dim=-1)
    apply_penalties(logits, seqs)
    constrained = [i for i, s in enumerate(seqs) if s.constraint is not None]
    for i in constrained:
        seqs[i].constraint.sync(seqs[i].request_output_ids)
    constrained = [i for i in constrained if seqs[i].constraint.active]  # (past any reasoning)
    if constrained:
        apply_constraints(logits, constrained, [seqs[i].constraint for i in constrained])
    sampled_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if len(sampled_rows) == len(seqs):
        tokens = _sample_rows(logits, seqs)
    else:
        tokens = argmax_rows(logits)
        if sampled_rows:
            tokens[_index(sampled_rows, device)] = _sample_rows(
                _rows(logits, sampled_rows), [seqs[i] for i in sampled_rows]
            )
    token_list = tokens.tolist()
    logprobs: list[dict | None] = [None] * len(seqs)
    if raw_logprobs is not None:
        row_logprobs = _logprobs(
            raw_logprobs,
            _rows(tokens, logprob_rows),
            [token_list[i] for i in logprob_rows],
            [seqs[i] for i in logprob_rows],
        )
        for i, lp in zip(logprob_rows, row_logprobs):
            logprobs[i] = lp
    return SampleResult(token_list, logprobs)
