"""A real cluster for tests: the coordinator in a background thread's event loop, each node a
real process started by `pdserve`'s own launcher, clients over the coordinator's client socket;
keyed, as `pdserve serve` is, with the session's default key set (which clients read too)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

from pdserve.cluster.keys import ClusterKeys, default_key_dir
from pdserve.cluster.sampling_params import SamplingParams
from pdserve.coordinator.client import CoordinatorClient
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.coordinator import Coordinator
from pdserve.engine.config import EngineConfig, RoleTensorParallel
from pdserve.engine.embedded.tiny import ensure_tiny_model
from pdserve.launch import NodeGroup, NodeSpec, local_nodes


class Cluster:
    def __init__(
        self,
        prefill: int = 1,
        decode: int = 1,
        transport: str = "tcp",
        colocated: bool = False,
        config: CoordinatorConfig | None = None,
        log_dir: Path | None = None,
        kv_handoff: str = "immediate",
        heartbeat_interval_s: float = 0.2,
        keyed: bool = True,
        roles: RoleTensorParallel | None = None,
        node_engines: dict[str, dict] | None = None,
        node_options: dict | None = None,
        **engine_options: object,
    ) -> None:
        """roles: tensor-parallel sizes of prefill and decode nodes; node_engines: engine
        settings of single nodes, by node id (e.g. {"decode-1": {"tensor_parallel_size": 2}})."""
        ensure_tiny_model()  # once here, not raced by every node
        self.keys = ClusterKeys.load_or_create(default_key_dir()) if keyed else None
        self.num_prefill = 0 if colocated else prefill
        self.num_decode = decode
        self.colocated = colocated
        self.transport = transport
        self.kv_handoff = kv_handoff
        self.node_options = node_options or {}  # more NodeOptions of every node
        self.heartbeat_interval_s = heartbeat_interval_s
        self.roles = roles
        self.node_engines = node_engines or {}
        self.config = config or CoordinatorConfig(heartbeat_timeout_s=3.0, transfer_timeout_s=10.0)
        options = dict(num_kv_blocks=128, block_size=8, max_num_batched_tokens=256)
        options.update(engine_options)
        self.engine = EngineConfig(device="cpu", **options)
        self.group = NodeGroup(log_dir)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.coordinator = Coordinator(
            self.config,
            node_addr="tcp://127.0.0.1:0",
            client_addr="tcp://127.0.0.1:0",
            keys=self.keys,
        )

    # --- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        self.thread.start()
        self.call(self.coordinator.start())
        for spec in self.specs():
            self.group.start(spec)
        self.call(self.coordinator.wait_for_nodes(self.num_prefill, self.num_decode, 180))
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.call(self.coordinator.stop(), timeout=30)
        finally:
            self.group.stop()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    def specs(self) -> list[NodeSpec]:
        specs = local_nodes(
            self.coordinator.node_endpoint,
            self.engine,
            prefill=self.num_prefill,
            decode=self.num_decode,
            colocated=self.colocated,
            roles=self.roles,
            transport=self.transport,
            kv_handoff=self.kv_handoff,
            heartbeat_interval_s=self.heartbeat_interval_s,
            **self.node_options,
            **(
                {"cluster_keys": str(self.keys.directory)}
                if self.keys is not None
                else {"insecure": True}
            ),
        )
        for spec in specs:
            spec.engine = replace(spec.engine, **self.node_engines.get(spec.node_id, {}))
        return specs

    def call(self, coro, timeout: float = 300):  # noqa: ANN001, ANN201
        """Run a coroutine in the coordinator's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def loop_call(self, fn) -> None:  # noqa: ANN001
        """Run a plain function in the coordinator's loop, as its own code would."""
        self.loop.call_soon_threadsafe(fn)

    @property
    def client_addr(self) -> str:
        return self.coordinator.client_endpoint

    # --- observation ----------------------------------------------------------------------------

    def node(self, node_id: str):  # noqa: ANN201
        return self.coordinator.nodes.nodes[node_id]

    def wait_until_idle(self, timeout_s: float = 30.0) -> None:
        """Until every live node reports all its KV blocks free and nothing running, in a load
        snapshot the node took after sending every message the coordinator had received from it
        when this was called (so after the work it reported), and after this call."""
        deadline = time.monotonic() + timeout_s

        async def fences() -> dict[str, tuple[int, int, int]]:
            return {
                n.node_id: (n.load_seq, *self.coordinator.received_from(n.identity))
                for n in self.coordinator.nodes.alive()
            }

        seen = self.call(fences())

        def after(n) -> bool:  # noqa: ANN001
            seq, session, received = seen.get(n.node_id, (-1, 0, 0))
            if session and n.load_link_session == session:
                return n.load_seq > seq and n.load_link_sent >= received
            if session and n.load_link_session:
                return True  # a new incarnation of the node since the call
            return n.load_seq > seq  # none of its messages had arrived at the call

        while time.monotonic() < deadline:
            nodes = self.coordinator.nodes.alive()
            if nodes and all(
                after(n)
                and n.free_blocks == n.num_blocks
                and n.running == 0
                and n.waiting == 0
                and time.monotonic() - n.last_seen < 1.0
                for n in nodes
            ):
                return
            time.sleep(0.1)
        state = {n.node_id: (n.free_blocks, n.num_blocks, n.running, n.waiting) for n in nodes}
        raise AssertionError(f"nodes not idle after {timeout_s}s: {state}")

    def wait_for_report(self, node_id: str, condition, what: str, timeout_s: float = 30.0):  # noqa: ANN001, ANN201
        """The node's state once its load reports make condition(state) true (the counters a
        test reads reach the coordinator with those reports)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            node = self.coordinator.nodes.nodes.get(node_id)
            if node is not None and condition(node):
                return node
            time.sleep(0.05)
        raise AssertionError(f"waited {timeout_s:.0f} s for {what} from {node_id}")

    def kill(self, node_id: str) -> None:
        proc = self.group.procs[node_id]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    async def kill_mid_output(
        self, node_id: str, min_outputs: int = 3, timeout_s: float = 60.0
    ) -> None:
        """SIGKILL a decode node once it holds a decoding request with at least `min_outputs`
        tokens streamed (run it beside the requests' own tasks)."""
        from pdserve.coordinator.request_state import Phase

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(
                s.decode_node == node_id
                and s.phase is Phase.DECODING
                and len(s.output_token_ids) >= min_outputs
                for s in list(self.coordinator.requests.values())
            ):
                self.kill(node_id)
                return
            await asyncio.sleep(0.002)
        raise AssertionError(f"{node_id} never held a running request")


def random_tokens(n: int, seed: int) -> list[int]:
    """n token ids of the test model's vocabulary, seeded."""
    rng = random.Random(seed)
    return [rng.randrange(4, 500) for _ in range(n)]


def complete(cluster: Cluster, prompt: list[int], params: SamplingParams) -> list[int]:
    """The cluster's whole output for one prompt, through its client socket; it must run to
    max_tokens (the tests' prompts ignore end-of-sequence)."""

    async def run() -> list[int]:
        async with CoordinatorClient(cluster.client_addr) as client:
            out, reason = await client.complete(prompt, params)
            assert reason == "length"
            return out

    return asyncio.run(run())
