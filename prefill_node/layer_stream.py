"""Layer-wise KV streaming on a prefill node: which sequences of a step send their pages layer by
layer, and the sequence point in the forward where each layer's pages are handed to the sender.

Before a step executes, `begin` picks the scheduled sequences that stream (their prefill was
sent with stream_kv) and whose chunk reaches the end of their tokens: only the last chunk's
forward streams, and each layer's send carries that layer of every chunk (the earlier chunks'
pages are in the pool already). The model runner calls `layer_done(i)` once layer i's K/V is in
the pool; on a GPU that is when its kernels are queued, and the sender's stream waits on an event
recorded there before it reads the pages.
"""

from __future__ import annotations

from pdserve.engine.kv.kv_manager import KVCacheManager
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.prefill_node.handoff import PrefillHandoff


class LayerStream:
    def __init__(self, handoff: PrefillHandoff, kv: KVCacheManager) -> None:
        self.handoff = handoff
        self.kv = kv
        # (request id, the block tables its handoff moves) of this step's streaming sequences
        self.active: list[tuple[str, list[list[int]]]] = []

    def begin(self, out: SchedulerOutput) -> None:
        """The step about to run: the sequences whose last chunk it computes, if they stream,
        with the blocks the decode side will read once that chunk is in."""
        self.active = [
            (item.seq.request_id, self.kv.readable_tables(item.seq, item.seq.num_tokens))
            for item in out.scheduled
            if self.handoff.streams(item.seq.request_id)
            and item.seq.num_computed_tokens + item.num_new_tokens >= item.seq.num_tokens
        ]

    def layer_done(self, layer: int) -> None:
        for request_id, tables in self.active:
            self.handoff.layer_done(request_id, tables, layer)
