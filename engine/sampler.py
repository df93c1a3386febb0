"""Batched sampling from last-position logits: penalties, temperature, top-k, top-p, min-p, greedy
rows by argmax, seeded rows from their own generator, and optional logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sequence import Sequence


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict | None]  # per sequence: {"token": (id, lp), "top": [(id, lp), ...]}


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """OpenAI presence/frequency penalties over output tokens; repetition penalty (as in HF's
    processor) over prompt and output tokens."""
    for row, seq in enumerate(seqs):
        p = seq.params
        if not p.has_penalties:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
            vals = logits[row, seen]
            logits[row, seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if seq.num_output_tokens and (p.presence_penalty or p.frequency_penalty):
            out = torch.tensor(seq.output_token_ids, dtype=torch.long)
            counts = torch.bincount(out, minlength=logits.shape[1]).to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return logits


def filter_probs(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Zero out tokens outside each row's top-k, nucleus top-p and min-p sets; renormalize.

    top_k: [B] int (<= 0 means off); top_p, min_p: [B] float.
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


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
    """logits: [B, vocab] float32 for the B sequences that sample this step."""
    wants_logprobs = any(s.params.logprobs is not None for s in seqs)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None
    if any(s.params.has_penalties for s in seqs):
        logits = apply_penalties(logits.clone(), seqs)
    greedy = [s.params.greedy for s in seqs]
    tokens = torch.empty(len(seqs), dtype=torch.long)
    if any(greedy):
        tokens[:] = argmax_rows(logits)
    if not all(greedy):
        rows = torch.tensor([i for i, g in enumerate(greedy) if not g], dtype=torch.long)
        params = [seqs[i].params for i in rows.tolist()]
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
        probs = torch.softmax(logits[rows] / temps[:, None], dim=-1)
        if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
            probs = filter_probs(
                probs,
                torch.tensor([p.top_k for p in params]),
                torch.tensor([p.top_p for p in params], dtype=probs.dtype),
                torch.tensor([p.min_p for p in params], dtype=probs.dtype),
            )
        # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p; each seeded sequence
        # draws its noise from its own generator so its output does not depend on the batch.
        noise = torch.empty_like(probs)
        for j, row in enumerate(rows.tolist()):
            noise[j].exponential_(generator=seqs[row].generator)
        tokens[rows] = argmax_rows(probs / noise)
    token_list = tokens.tolist()
    logprobs: list[dict | None] = [None] * len(seqs)
    if raw_logprobs is not None:
        for i, seq in enumerate(seqs):
            n = seq.params.logprobs
            if n is None:
                continue
            top = raw_logprobs[i].topk(n) if n else None
            logprobs[i] = {
                "token": (token_list[i], float(raw_logprobs[i, token_list[i]])),
                "top": [] if top is None else list(zip(top.indices.tolist(), top.values.tolist())),
            }
    return SampleResult(token_list, logprobs)
