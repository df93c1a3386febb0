"""The collectives of one node's tensor-parallel ranks: the all-reduce after each row-parallel
projection, the gather of vocabulary-parallel logits onto rank 0, and the start-up agreements.

Each group is a process group of its own (gloo on CPU, NCCL on GPU) over a TCP store that rank 0
hosts, never torch.distributed's global default group: a process may hold several groups in
turn (tests do), and nothing else in it is disturbed.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from pdserve.engine.tp.shard import TPShard

# A collective waits this long for a peer: long enough for the slowest step on a CPU, short
# enough that a frozen rank does not hold its node forever.
COLLECTIVE_TIMEOUT_S = 300.0
STORE_HOST = "127.0.0.1"  # the ranks of a node share its host


def host_store(size: int) -> dist.TCPStore:
    """Rank 0's store, on a free port (`store.port`), for the other ranks to join."""
    return dist.TCPStore(
        STORE_HOST, 0, size, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
    )


class TPGroup:
    def __init__(self, shard: TPShard, pg: dist.ProcessGroup, device: torch.device) -> None:
        self.shard = shard
        self.pg = pg
        self.device = device

    @classmethod
    def join(
        cls,
        shard: TPShard,
        device: str,
        store: dist.TCPStore | None = None,
        port: int | None = None,
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
        check_ranks: Callable[[], None] | None = None,
    ) -> TPGroup:
        """Join the group: rank 0 with the store it hosts, the others with its port. Returns
        once every rank has joined. Rank 0 calls check_ranks while it waits for the others: it
        raises if one of them is gone (a rank that dies on its way never joins); one alive that
        has not joined within timeout_s makes it raise RuntimeError naming the missing ranks."""
        if store is None:
            store = dist.TCPStore(
                STORE_HOST, port, shard.size, False, timeout=datetime.timedelta(seconds=60)
            )
        if shard.rank == 0:
            others = [f"joining/{r}" for r in range(1, shard.size)]
            deadline = time.monotonic() + timeout_s
            while not store.check(others):
                if check_ranks is not None:
                    check_ranks()
                if time.monotonic() > deadline:
                    missing = [r for r in range(1, shard.size) if not store.check([others[r - 1]])]
                    raise RuntimeError(
                        f"tensor-parallel ranks {missing} did not join their group within "
                        f"{timeout_s:g}s (alive but stuck before the group formed)"
                    )
                time.sleep(0.05)
        else:
            store.set(f"joining/{shard.rank}", "1")
        timeout = datetime.timedelta(seconds=timeout_s)
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, shard.rank, shard.size, options)
        else:
            pg = dist.ProcessGroupGloo(store, shard.rank, shard.size, timeout)
        group = cls(shard, pg, dev)
        group.barrier()
        return group

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        self.pg.allreduce([x]).wait()
        return x

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x (all of one shape) on rank 0, in rank order; None on the others."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        x = x.contiguous()
        if self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self.pg.gather([parts], [x], opts).wait()
            return parts
        self.pg.gather([], [x], opts).wait()
        return None

    def min(self, value: int) -> int:
        """The smallest of every rank's value (e.g. the KV blocks each rank's memory holds)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([t], opts).wait()
        return int(t.item())

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))
