"""The life of a tensor-parallel rank other than 0, in a process of its own (`main`, its
RankSpec pickled on stdin): join the node's group, build its share of the
node (model part, KV pool of its heads), then run every plan rank 0 publishes until told to stop.
It never decides anything; when its group breaks (a rank died) or rank 0's process goes away, it
exits.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.engine.config import EngineConfig
from pdserve.engine.step_plan import StepPlan
from pdserve.engine.tp.plan_channel import PlanInbox, PublisherGone
from pdserve.engine.tp.shard import TPShard

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 0.2


class Stop:
    """Published by rank 0 when the node closes."""


class RankKVEndpoint(Protocol):
    """A rank's KV endpoint, made by its spec in the rank's process (`RankSpec.kv_endpoint`:
    what the node's KV transport handed it, e.g. `pdserve.kv_transfer.rank_endpoint`'s)."""

    @property
    def pool_factory(self) -> Any:
        """How the rank's KV pool is made (None: the default pool)."""

    def start(self, pool: Any) -> None: ...

    def layer_done(self, step: int, layer: int) -> None:
        """From the rank's forward: layer `layer` of step `step` is in the rank's pool."""

    def close(self) -> None: ...


@dataclass
class RankSpec:
    """What a worker rank needs (picklable: it is its process's argument)."""

    rank: int
    size: int
    model_dir: str
    config: EngineConfig
    store_port: int
    plans: PlanInbox
    parent_pid: int
    log_level: int
    # For a node that moves KV: a spec whose serve(device) makes the rank's `RankKVEndpoint`.
    kv_endpoint: Any = None


def _exit_with_parent(parent_pid: int) -> None:
    """Exit as soon as rank 0's process is gone, whatever this rank is doing."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_rank(spec: RankSpec) -> None:
    _exit_with_parent(spec.parent_pid)
    logging.basicConfig(
        level=spec.log_level,
        format=f"%(asctime)s %(levelname)s tp-rank{spec.rank} %(name)s: %(message)s",
    )
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # as the CLI's processes do

    from pdserve.engine.tp.group import TPGroup
    from pdserve.engine.tp.model_shard import ModelShard

    config = spec.config
    if not config.rank_device(spec.rank).startswith("cuda"):
        # The ranks of a CPU node share its cores: each takes its share.
        from pdserve.engine.cpu import threads as cpu_threads

        place, _ = cpu_threads.place_rank(config.cpu_bind, config.cpu_threads, spec.rank, spec.size)
        logger.info("cpu: %s", place.describe())
    shard = TPShard(spec.rank, spec.size)
    reader = spec.plans.open()
    group = TPGroup.join(shard, config.rank_device(spec.rank), port=spec.store_port)
    endpoint: RankKVEndpoint | None = None
    pool_factory = None
    if spec.kv_endpoint is not None:
        endpoint = spec.kv_endpoint.serve(config.rank_device(spec.rank))
        pool_factory = endpoint.pool_factory
    part = ModelShard(spec.model_dir, config, shard, group, pool_factory)
    if endpoint is not None:
        endpoint.start(part.pool)
        # Pages streamed layer by layer leave once this rank's own layer is in its pool.
        part.add_layer_hook(lambda layer: endpoint.layer_done(part.runner.step_index, layer))
    part.capture_decode_graphs()
    try:
        while True:
            msg = reader.receive()
            if isinstance(msg, Stop):
                break
            assert isinstance(msg, StepPlan), type(msg)
            part.runner.run_plan(msg)
    except PublisherGone:
        os._exit(1)
    except RuntimeError as exc:  # a collective failed: another rank died
        logger.error("tensor-parallel group broke: %s", exc)
        os._exit(1)
    finally:
        if endpoint is not None:
            endpoint.close()


def main() -> None:
    spec = pickle.load(sys.stdin.buffer)
    try:
        from setproctitle import setproctitle

        setproctitle(f"pdserve-tp-rank{spec.rank}")
    except ImportError:
        pass
    run_rank(spec)
