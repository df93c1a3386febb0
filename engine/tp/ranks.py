"""The other ranks of a tensor-parallel node, as rank 0 sees them: their processes (spawned, one
per device), the channel that hands them each step's plan, and what happens when one dies: the
whole group is stopped and rank 0 raises `TPGroupFailed`, naming the rank; a watcher may be told
at once, without waiting for rank 0's next step. Rank 0 forms its own shard with them
(`form_shard`)."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from pdserve import SOURCE_ROOT
from pdserve.engine.config import EngineConfig
from pdserve.engine.step_plan import StepPlan
from pdserve.engine.tp.group import TPGroup, host_store
from pdserve.engine.tp.model_shard import ModelShard, PoolFactory
from pdserve.engine.tp.plan_channel import PlanChannel, plan_capacity
from pdserve.engine.tp.shard import TPShard
from pdserve.engine.tp.worker import RankSpec, Stop

REPO_ROOT = SOURCE_ROOT  # what rank processes need on their path
WATCH_POLL_S = 0.05  # how often the watcher looks where a process's exit cannot be waited on

logger = logging.getLogger(__name__)


class TPGroupFailed(RuntimeError):
    """A rank of this node's tensor-parallel group died; the group is down."""


class RankProcesses:
    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig,
        max_position_embeddings: int,
        kv_endpoints: list[Any] | None = None,
    ) -> None:
        """Start ranks 1..N-1; kv_endpoints[r - 1]: rank r's KV endpoint spec, if any."""
        size = config.tensor_parallel_size
        self.store = host_store(size)
        max_len = config.max_model_len or max_position_embeddings
        max_blocks = -(-max_len // config.block_size) + 1
        self.channel = PlanChannel(
            size - 1, plan_capacity(config.max_num_batched_tokens, max_blocks)
        )
        self.procs: list[subprocess.Popen] = []
        self._stopped = False
        # A process of its own, not a multiprocessing child: nothing of the caller's main module
        # runs again in it (a script without `if __name__ == "__main__"` works).
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])]
        )
        level = logging.getLogger().getEffectiveLevel()
        for rank in range(1, size):
            inbox = self.channel.inbox(rank - 1)
            kv = kv_endpoints[rank - 1] if kv_endpoints else None
            spec = RankSpec(
                rank, size, str(model_dir), config, self.store.port, inbox, os.getpid(), level, kv
            )
            # Descriptors the rank inherits: its plan pipe, and the line to its KV endpoint.
            fds = (inbox.fd,) + ((kv.fd,) if kv is not None else ())
            proc = subprocess.Popen(
                [sys.executable, "-c", "from pdserve.engine.tp.worker import main; main()"],
                stdin=subprocess.PIPE,
                env=env,
                pass_fds=fds,
            )
            self.channel.handed_over(rank - 1)
            if kv is not None:
                os.close(kv.fd)
            proc.stdin.write(pickle.dumps(spec))
            proc.stdin.close()
            self.procs.append(proc)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def formed(self) -> None:
        """The group formed (every rank mapped the channel): its file can go."""
        self.channel.unlink()

    def dead(self) -> list[tuple[int, int]]:
        """(rank, exit code) of the ranks that have exited."""
        return [(r + 1, code) for r, p in enumerate(self.procs) if (code := p.poll()) is not None]

    def check(self) -> None:
        """Raise TPGroupFailed (stopping the group) if a rank has exited."""
        if self.dead():
            raise self.failure(None)

    def watch(self, on_death: Callable[[str], None]) -> None:
        """From now on, a thread of its own waits on the ranks' processes and calls
        on_death(why) the moment one exits while the group is not being stopped; rank 0 itself
        learns of it only at its next collective or `check`."""
        thread = threading.Thread(
            target=self._watch, args=(on_death,), name="tp-rank-watch", daemon=True
        )
        thread.start()

    def _watch(self, on_death: Callable[[str], None]) -> None:
        exits = []  # a descriptor per rank that turns readable when its process exits (Linux)
        with contextlib.suppress(AttributeError, OSError):
            exits = [os.pidfd_open(p.pid) for p in self.procs]
        try:
            while not self._stopped:
                if exits:
                    wait(exits)  # until one exits (its descriptor stays readable then)
                else:
                    time.sleep(WATCH_POLL_S)
                dead = self.dead()
                if dead and not self._stopped:
                    on_death(describe_dead(dead))
                    return
                if exits and not dead:
                    time.sleep(0.001)  # exited, but the main thread is reading its status
        finally:
            for fd in exits:
                os.close(fd)

    def publish(self, plan: StepPlan) -> None:
        self.check()
        try:
            self.channel.publish(plan)
        except OSError as exc:  # a rank's pipe broke: it is gone
            raise self.failure(exc) from exc

    def failure(self, cause: BaseException | None, wait_s: float = 5.0) -> TPGroupFailed:
        """Stop the group after a failure; the error to raise names the rank that died (a
        collective can fail before its process is reaped: waited for up to wait_s)."""
        deadline = time.monotonic() + wait_s
        while not self.dead() and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = self.dead()
        self.stop()
        if dead:
            why = describe_dead(dead)
        else:
            why = f"the tensor-parallel group failed: {cause}"
        logger.error(why)
        return TPGroupFailed(why)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.dead():
            timeout_s = 0.0  # the others may wait on a collective that never ends: no goodbye
        else:
            self.channel.publish(Stop())
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.channel.close()


def describe_dead(dead: list[tuple[int, int]]) -> str:
    """What to say of ranks that died: (rank, exit code) each."""
    ranks = ", ".join(f"rank {r} (exit code {code})" for r, code in dead)
    return f"tensor-parallel {ranks} died; the node's group is down"


def form_shard(
    model_dir: str | Path,
    config: EngineConfig,
    shard: TPShard,
    ranks: RankProcesses | None,
    pool_factory: PoolFactory | None = None,
    draft_share: tuple[int, int] = (0, 0),
) -> ModelShard:
    """Rank 0's model shard: with other ranks, it first joins the group they form with it (a
    rank's death seen while joining) and the group's channel file goes. A failure stops the
    other ranks: a rank's death (a collective failed) is raised as TPGroupFailed naming it,
    rank 0's own error (a bad checkpoint...) as it is. draft_share: (shared bytes per block,
    reserved bytes) that a draft model's pool takes of the KV budget."""
    try:
        group = None
        if ranks is not None:
            group = TPGroup.join(
                shard, config.rank_device(0), store=ranks.store, check_ranks=ranks.check
            )
            ranks.formed()
        return ModelShard(
            model_dir,
            config,
            shard,
            group,
            pool_factory,
            shared_bytes_per_block=draft_share[0],
            reserved_bytes=draft_share[1],
        )
    except BaseException as exc:
        if ranks is None or isinstance(exc, TPGroupFailed):
            raise
        if isinstance(exc, RuntimeError):  # a collective failed: a rank died
            raise ranks.failure(exc) from exc
        ranks.stop()  # rank 0's own error, as it is
        raise
