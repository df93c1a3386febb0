"""Speculative decoding's `draft_model` method: a small model of the target's vocabulary, on rank
0's device with a paged KV pool of its own, proposes each speculating sequence's drafts greedily.
Each draft is its argmax, a point mass, so verification (keep a draft while it equals the target's
own sample there) leaves the output token-identical to plain decoding for greedy and seeded
requests and exact in distribution for the others.

Per step, for every speculating sequence at once: one forward catches the draft's KV up with the
tokens it has not seen (after a KV handoff, the whole prompt: the draft's KV is never transferred,
so the handoff protocol is unchanged and a failover just prefills the draft again) and gives the
first draft, then one single-token forward per further draft. After verification the draft's KV
past the accepted tokens is dropped (`rollback`); a sequence leaving the batch frees its blocks.
The draft's pool caches prefixes as the target's does: full blocks of a sequence's own tokens are
registered once computed, and a sequence arriving with a cached prefix catches up after it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu import linear as cpu_linear
from pdserve.engine.embedded.catalog import resolve_model_dir
from pdserve.engine.execution.runner import ModelRunner
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.engine.models.config import ModelConfig
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.models.loader import load_model
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.speculation import SpeculativeConfig, speculation_limit
from pdserve.engine.step_plan import StepPlan
from pdserve.engine.tokenizer import Tokenizer
from pdserve.kernels.ops import select_ops

logger = logging.getLogger(__name__)


def check_vocabulary(draft_dir: Path, target_dir: Path) -> None:
    """Raise ValueError naming the first difference between the two models' vocabularies (the
    tokenizers' tokens and ids, and the models' logits width)."""
    draft, target = Tokenizer(draft_dir).vocab(), Tokenizer(target_dir).vocab()
    if draft != target:
        drafts, targets = {i: t for t, i in draft.items()}, {i: t for t, i in target.items()}
        differ = sorted(i for i in set(drafts) | set(targets) if drafts.get(i) != targets.get(i))
        first = differ[0]
        raise ValueError(
            f"speculative_config model: the draft's tokenizer vocabulary differs from the "
            f"target's ({len(draft)} tokens against {len(target)}; {len(differ)} ids differ, the "
            f"first {first}: {drafts.get(first)!r} in the draft, {targets.get(first)!r} in the "
            "target)"
        )
    draft_width = ModelConfig.from_pretrained(draft_dir).vocab_size
    target_width = ModelConfig.from_pretrained(target_dir).vocab_size
    if draft_width != target_width:
        raise ValueError(
            f"speculative_config model: the draft's vocab_size {draft_width} differs from the "
            f"target's {target_width}"
        )


def load_draft_model(
    spec: SpeculativeConfig, config: EngineConfig, target_dir: Path
) -> LlamaForCausalLM:
    """The draft model on rank 0's device, in the engine's dtype, its vocabulary checked first."""
    draft_dir = resolve_model_dir(spec.model)
    check_vocabulary(draft_dir, target_dir)
    device, dtype = config.rank_device(0), config.resolved_dtype()
    model = load_model(draft_dir, dtype, device)
    if cpu_linear.choose(config.cpu_linear, device, dtype, False):
        cpu_linear.pack(model)
    return model


def draft_layout(model: LlamaForCausalLM, config: EngineConfig) -> KVLayout:
    return KVLayout.for_model(model.config, config.block_size, config.resolved_dtype())


def draft_pool_share(
    model: LlamaForCausalLM, config: EngineConfig, spec: SpeculativeConfig
) -> tuple[int, int]:
    """What the draft's pool takes of the target's KV budget (`ModelShard`): bytes per target
    block (a pool of as many blocks as the target's), or bytes reserved first (a pool of
    draft_num_kv_blocks); the target's explicit num_kv_blocks leaves the budget alone."""
    bytes_per_block = draft_layout(model, config).bytes_per_block
    if spec.draft_num_kv_blocks is None:
        return bytes_per_block, 0
    return 0, bytes_per_block * spec.draft_num_kv_blocks


class DraftModelProposer:
    """The `Proposer` of the draft_model method: the draft model, its KV pool and block manager,
    and per sequence a draft block table and the count of its tokens whose draft KV is computed
    (`Sequence.draft_block_table`, `Sequence.num_draft_computed_tokens`)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        config: EngineConfig,
        spec: SpeculativeConfig,
    ) -> None:
        """num_blocks: the draft pool's size (draft_num_kv_blocks, or as many blocks as the
        target's pool holds)."""
        device = config.rank_device(0)
        self.layout = draft_layout(model, config)
        self.pool = KVPool(self.layout, num_blocks, device)
        # Prefix caching as the target's (and with it): a sequence whose prompt begins with full
        # blocks some earlier sequence's draft computed (a shared system prompt, a chat's next
        # turn, a failover's retry here) takes them and catches up after them. No KV events:
        # the coordinator places requests by the target's cache.
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.runner = ModelRunner(
            model, self.pool, select_ops(device, config.kernel_backend), device
        )
        self.adaptive = spec.adaptive
        self.max_positions = model.config.max_position_embeddings
        # Catch-up tokens per step, at most (long prompts arriving at once prefill over steps).
        self.max_catch_up = config.max_num_batched_tokens
        # Since start: tokens of sequences the draft computed to catch up with them, and those
        # its prefix cache spared it.
        self.num_catch_up_tokens = 0
        self.num_cached_tokens = 0
        logger.info(
            "speculative decoding: draft model %s, %d KV blocks of %d bytes (%s), prefix "
            "caching %s",
            spec.model,
            num_blocks,
            self.layout.bytes_per_block,
            "draft_num_kv_blocks" if spec.draft_num_kv_blocks else "as many as the target's",
            "on" if config.enable_prefix_caching else "off",
        )

    def capture_graphs(self, max_batch_size: int, max_model_len: int, max_drafts: int) -> None:
        """Replay the draft's steps from CUDA graphs, as the target's: a single-token forward
        per further draft is a decode step, and a catch-up after verification (the accepted
        drafts and the target's token, at most max_drafts + 1 tokens, then the first draft) runs
        as decode rows (`pdserve.engine.execution.decode_rows`); longer catch-ups (a prompt)
        stay eager. Called only where the target captures its own."""
        if self.runner.model.eager_only is not None:
            return
        self.runner.capture_decode_graphs(
            max_batch_size, max_model_len, max_drafts + 1, self.max_catch_up
        )

    # --- the scheduler's interface (`pdserve.engine.spec_decode.speculation.Proposer`) -------------------

    def limit(self, seq: Sequence, k: int) -> int:
        k = speculation_limit(seq, k, self.adaptive)
        # The draft feeds positions up to num_tokens + k - 2: within its own context.
        return max(0, min(k, self.max_positions - seq.num_tokens))

    def draft(self, batch: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Catch every sequence's draft KV up and take its first draft in one forward, then
        one forward per further draft; a sequence whose catch-up does not fit the step's
        catch-up budget, or whose draft blocks do not fit the draft pool, gets none this step.
        A sequence holding no draft KV first takes its prompt's cached prefix."""
        bm = self.block_manager
        budget = self.max_catch_up
        chunks: list[tuple[list[int], int, list[int], bool]] = []
        proposing: list[tuple[int, Sequence, int]] = []  # (index in batch, seq, k)
        caught_up: list[Sequence] = []
        for index, (seq, k) in enumerate(batch):
            if budget <= 0:
                break
            cached = self._take_cached_prefix(seq)
            start = seq.num_draft_computed_tokens
            need = seq.num_tokens - start
            take = min(need, budget)
            proposes = take == need
            # Blocks for the catch-up, and for the k - 1 drafts fed back if it proposes.
            end = start + take + (k - 1 if proposes else 0)
            if take <= 0 or not bm.allocate_slots(seq.draft_block_table, end, start):
                if cached:  # computing nothing, it pins no cached block
                    self.release(seq)
                continue
            budget -= take
            self.num_cached_tokens += cached
            self.num_catch_up_tokens += take
            chunks.append(
                (seq.token_ids[start : start + take], start, seq.draft_block_table, proposes)
            )
            seq.num_draft_computed_tokens = start + take
            caught_up.append(seq)
            if proposes:
                proposing.append((index, seq, k))
        drafts: list[list[int]] = [[] for _ in batch]
        if not chunks:
            return drafts
        tokens = self._forward(chunks)
        # Only once computed, and before any draft is fed back, may blocks enter the cache: each
        # block registered holds KV of the sequence's own tokens at every position.
        for seq in caught_up:
            bm.cache_full_blocks(
                seq.draft_block_table, seq.token_ids, seq.num_draft_computed_tokens
            )
        for (index, _, _), token in zip(proposing, tokens):
            drafts[index].append(token)
        for j in range(1, max((k for _, _, k in proposing), default=0)):
            active = [(index, seq) for index, seq, k in proposing if k > j]
            chunks = []
            for index, seq in active:
                position = seq.num_draft_computed_tokens
                chunks.append(([drafts[index][-1]], position, seq.draft_block_table, True))
                seq.num_draft_computed_tokens = position + 1
            for (index, _), token in zip(active, self._forward(chunks)):
                drafts[index].append(token)
        return drafts

    def _take_cached_prefix(self, seq: Sequence) -> int:
        """For a sequence holding no draft KV (new here, or back after a preemption), the draft
        blocks of its tokens' longest cached prefix: how many tokens they hold."""
        if seq.draft_block_table or seq.num_draft_computed_tokens:
            return 0
        seq.draft_block_table = self.block_manager.allocate_prefix(seq.token_ids)
        seq.num_draft_computed_tokens = len(seq.draft_block_table) * self.block_manager.block_size
        return seq.num_draft_computed_tokens

    def rollback(self, seq: Sequence, num_valid: int) -> None:
        """Drop the draft's KV past seq's first num_valid tokens (rejected drafts' KV)."""
        if seq.num_draft_computed_tokens <= num_valid:
            return
        seq.num_draft_computed_tokens = num_valid
        keep = -(-num_valid // self.block_manager.block_size)
        # The tail holds positions past the sequence's tokens only: never a cached block (those
        # hold its own tokens), so never one another sequence shares.
        if len(seq.draft_block_table) > keep:
            tail = seq.draft_block_table[keep:]
            del seq.draft_block_table[keep:]
            self.block_manager.free(tail)

    def release(self, seq: Sequence) -> None:
        # Blocks shared with other sequences lose this one's reference only; cached ones stay
        # cached, evictable once nobody holds them.
        self.block_manager.free(seq.draft_block_table)
        seq.num_draft_computed_tokens = 0

    def _forward(self, chunks: list[tuple[list[int], int, list[int], bool]]) -> list[int]:
        """The draft model over the chunks; the argmax after each sampling chunk."""
        plan = StepPlan.from_chunks(chunks, self.layout.block_size)
        logits, rows = self.runner.run_plan(plan)
        if not rows:
            return []
        return torch.argmax(logits, dim=-1).tolist()
