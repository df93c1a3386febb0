"""Speculative decoding: the speculative config, the n-gram proposer and verification
(`speculation`), the draft-model proposer with a KV pool of its own (`draft_model`) and how many
drafts a sequence is allowed each step (`pacing`). It imports the engine's sequences, scheduler
plan, models, KV cache and execution; the scheduler and the engine import it, nothing below them."""
