"""Node kills for `pdserve.bench.recovery`: the coordinator in this process on its defaults, the
nodes real processes as `pdserve serve` starts them; the coordinator's own records say which
requests a SIGKILL of a decode node, a prefill node or one tensor-parallel rank moved."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.process_tree import Sessions, rank_pid
from pdserve.bench.recovery_record import (
    MIN_OUTPUTS,
    POLL_S,
    Kill,
    RequestOutcome,
    Workload,
    check_tokens,
    describe_kill,
)
from pdserve.cluster.keys import ClusterKeys, default_key_dir
from pdserve.cluster.sampling_params import SamplingParams
from pdserve.coordinator.client import CoordinatorClient
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.coordinator import Coordinator, SubmitError
from pdserve.coordinator.request_state import Phase, RequestState
from pdserve.engine.config import EngineConfig, RoleTensorParallel
from pdserve.launch import NodeGroup, NodeSpec, local_nodes

# Each node kill's cluster: (prefill nodes, decode nodes, decode tensor-parallel size); one node
# of the killed kind survives to take the requests over.
SHAPES = {"decode": (1, 2, 1), "prefill": (2, 1, 1), "tp-rank": (1, 2, 2)}


class NodeCluster:
    """The coordinator (its defaults unless told) in a thread's event loop of this process, and
    the nodes `pdserve serve` would start as processes, whose requests it shows this bench."""

    def __init__(
        self,
        engine: EngineConfig,
        prefill: int,
        decode: int,
        decode_tp: int,
        sessions: Sessions,
        log_dir: Path | None,
        transport: str = "tcp",
        config: CoordinatorConfig | None = None,
    ) -> None:
        self.keys = ClusterKeys.load_or_create(default_key_dir())
        self.engine = engine
        self.prefill, self.decode = prefill, decode
        self.roles = RoleTensorParallel(decode_tensor_parallel_size=decode_tp)
        self.transport = transport
        self.sessions = sessions
        self.group = NodeGroup(log_dir)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.coordinator = Coordinator(
            config or CoordinatorConfig(),
            node_addr="tcp://127.0.0.1:0",
            client_addr="tcp://127.0.0.1:0",
            keys=self.keys,
        )
        self.specs: dict[str, NodeSpec] = {}

    def __enter__(self) -> NodeCluster:
        self.thread.start()
        try:
            self.call(self.coordinator.start())
            specs = local_nodes(
                self.coordinator.node_endpoint,
                self.engine,
                prefill=self.prefill,
                decode=self.decode,
                roles=self.roles,
                transport=self.transport,
                cluster_keys=str(self.keys.directory),
            )
            self.specs = {s.node_id: s for s in specs}
            for spec in specs:
                self.start_node(spec.node_id)
            self.call(self.coordinator.wait_for_nodes(self.prefill, self.decode, 300))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.coordinator.node_endpoint:
                self.call(self.coordinator.stop(), timeout=30)
        finally:
            self.group.stop()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    def call(self, coro, timeout: float = 300):  # noqa: ANN001, ANN201
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start_node(self, node_id: str) -> int:
        # From this (the main) thread: a node dies with the thread that started it.
        proc = self.group.start(self.specs[node_id])
        self.sessions.add(proc.pid)
        return proc.pid

    def node_pid(self, node_id: str) -> int:
        return self.group.procs[node_id].pid

    @property
    def client_addr(self) -> str:
        return self.coordinator.client_endpoint

    def alive(self, node_id: str, pid: int | None = None) -> bool:
        """Whether the coordinator holds node_id alive (its incarnation of pid, if given)."""
        node = self.coordinator.nodes.nodes.get(node_id)
        return node is not None and node.alive and (pid is None or node.pid == pid)

    def requests(self) -> list[RequestState]:
        while True:
            try:
                return list(self.coordinator.requests.values())
            except RuntimeError:  # changed size under us (the coordinator's thread)
                continue

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Until every node is registered alive and reports nothing running and every block
        free."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            nodes = [self.coordinator.nodes.nodes.get(n) for n in self.specs]
            if (
                not self.requests()
                and all(n is not None and n.alive for n in nodes)
                and all(
                    n.free_blocks == n.num_blocks and n.running == 0 and n.waiting == 0
                    for n in nodes
                )
            ):
                return
            time.sleep(0.05)
        raise TimeoutError(f"the cluster was not idle within {timeout_s:.0f} s")

    def restart(self, node_id: str, timeout_s: float = 300.0) -> None:
        """Start a killed node again and wait until the coordinator has its new incarnation."""
        old = self.group.procs[node_id]
        try:
            old.wait(30)  # a TP node's rank 0 exits by itself once a rank died
        except subprocess.TimeoutExpired:
            old.kill()
            old.wait()
        deadline = time.monotonic() + timeout_s
        pid = self.start_node(node_id)
        while not self.alive(node_id, pid):
            if self.group.procs[node_id].poll() is not None:
                raise RuntimeError(f"{node_id} exited while starting again")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{node_id} did not register again in {timeout_s:.0f} s")
            time.sleep(0.05)


@dataclass(slots=True)
class ClientStream:
    """One request as the client sees it: each token's arrival time."""

    request_id: str
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens so far)
    error: str | None = None

    async def run(self, client: CoordinatorClient, params: SamplingParams) -> None:
        try:
            async for event in client.generate(self.prompt, params, self.request_id):
                if event.token_ids:
                    self.tokens += event.token_ids
                    self.arrivals.append((time.monotonic(), len(self.tokens)))
        except SubmitError as exc:
            self.error = f"failed ({exc.code}): {exc}"

    def received_at(self, index: int) -> float | None:
        """When token `index` (0-based) reached the client."""
        return next((t for t, count in self.arrivals if count > index), None)


class AttemptLog:
    """A coordinator listener: for each request, the index of the first token of each of its
    attempts, and its last attempt (so a failover's first token is told from a late one of the
    dead node)."""

    def __init__(self) -> None:
        self.submitted: set[str] = set()
        self.counts: dict[str, int] = {}
        self.first_index: dict[tuple[str, int], int] = {}
        self.last_attempt: dict[str, int] = {}

    def __call__(self, name: str, state: RequestState) -> None:
        rid = state.request_id
        self.last_attempt[rid] = state.attempt
        if name == "submitted":
            self.submitted.add(rid)
        elif name == "tokens":
            self.first_index.setdefault((rid, state.attempt), self.counts.get(rid, 0))
            self.counts[rid] = len(state.output_token_ids)

    def resumed_at(self, rid: str, after_attempt: int) -> int | None:
        """Index of the first token of an attempt later than after_attempt."""
        found = [i for (r, a), i in self.first_index.items() if r == rid and a > after_attempt]
        return min(found) if found else None


def kill_point(
    kind: str, states: list[RequestState], ids: set[str], submitted: set[str]
) -> str | None:
    """The node to kill once every request has reached the coordinator and those not yet
    finished are where the kill should find them, else None. decode, tp-rank: each decoding
    with MIN_OUTPUTS tokens out; the decode node holding most of them. prefill: the prefill node
    holding most still prefilling. "" when none is left on a node of the kind."""
    if not ids <= submitted:
        return None
    mine = [s for s in states if s.request_id in ids]
    if kind == "prefill":
        held = [s.prefill_node for s in mine if s.phase is Phase.PREFILLING and s.prefill_node]
    else:
        if not all(
            s.phase is Phase.DECODING and len(s.output_token_ids) >= MIN_OUTPUTS for s in mine
        ):
            return None
        held = [s.decode_node for s in mine if s.decode_node]
    if not held:
        return ""  # too late: nothing is on a node of that kind any more
    return max(sorted(set(held)), key=held.count)


async def node_kill(
    cluster: NodeCluster, kind: str, repeat: int, workload: Workload, timeout_s: float
) -> Kill:
    """One kill: send the repeat's requests, SIGKILL the node (or rank 1 of it) holding most of
    them once they are where the kind wants them, and wait for every request to end."""
    prompts = workload.prompts(kind, repeat)
    streams = [ClientStream(f"{kind}-{repeat}-{i}", p) for i, p in enumerate(prompts)]
    ids = {s.request_id for s in streams}
    log = AttemptLog()
    cluster.coordinator.listeners.append(log)
    kill = Kill(kind, repeat, "", [])
    attempts: dict[str, int] = {}
    before: dict[str, int] = {}
    killed_at = 0.0
    watcher: asyncio.Task | None = None
    try:
        async with CoordinatorClient(cluster.client_addr, keys=cluster.keys) as client:
            tasks = [asyncio.create_task(s.run(client, workload.params)) for s in streams]
            deadline = time.monotonic() + timeout_s
            victim = None
            while victim is None and time.monotonic() < deadline:
                victim = kill_point(kind, cluster.requests(), ids, log.submitted)
                if victim is None:
                    await asyncio.sleep(POLL_S)
            # Where each request stood at the kill, as the coordinator saw it.
            at_kill = [s for s in cluster.requests() if s.request_id in ids]
            attempts = {s.request_id: s.attempt for s in at_kill}
            before = {s.request_id: len(s.output_token_ids) for s in at_kill}
            if not victim:
                kill.error = (
                    "no request was on a node to kill when the kill was due"
                    if victim == ""
                    else f"the requests never reached the kill point in {timeout_s:.0f} s"
                )
            else:
                node_pid = cluster.node_pid(victim)
                pid = node_pid if kind != "tp-rank" else rank_pid(node_pid)
                kill.victim = victim if kind != "tp-rank" else f"rank 1 of {victim}"
                if pid is None:
                    kill.error = f"no rank 1 found under {victim} (pid {node_pid})"
                else:
                    killed_at = time.monotonic()
                    os.kill(pid, signal.SIGKILL)
                    watcher = asyncio.create_task(
                        watch_node_death(cluster, victim, node_pid, killed_at, kill.stages)
                    )
            try:
                await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
            except TimeoutError:
                for s in streams:
                    if s.error is None and len(s.tokens) < workload.max_tokens:
                        s.error = f"not finished {timeout_s:.0f} s after the kill"
            if watcher is not None:
                await asyncio.wait_for(watcher, 130)
    finally:
        cluster.coordinator.listeners.remove(log)
    for s in streams:
        outcome = RequestOutcome(s.request_id, s.prompt, tokens=s.tokens, error=s.error)
        if watcher is not None and s.request_id in attempts:
            outcome.tokens_before_kill = before[s.request_id]
            outcome.affected = log.last_attempt.get(s.request_id, 0) > attempts[s.request_id]
            if outcome.affected:
                index = log.resumed_at(s.request_id, attempts[s.request_id])
                at = None if index is None else s.received_at(index)
                if at is not None:
                    outcome.recovery_s = round(at - killed_at, 4)
                elif outcome.error is None:
                    outcome.error = "moved by the kill, but no token came after it"
        check_tokens(outcome, workload.of(s.prompt))
        kill.requests.append(outcome)
    return kill


async def watch_node_death(
    cluster: NodeCluster, node_id: str, node_pid: int, killed_at: float, stages: dict
) -> None:
    """Seconds from the kill to the node process's exit (a TP node's rank 0 follows its rank)
    and to the coordinator marking the node dead."""
    proc = cluster.group.procs[node_id]
    stages["node_exited_s"] = stages["marked_dead_s"] = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = time.monotonic()
        if stages["node_exited_s"] is None and proc.poll() is not None:
            stages["node_exited_s"] = round(now - killed_at, 4)
        if stages["marked_dead_s"] is None and not cluster.alive(node_id, node_pid):
            stages["marked_dead_s"] = round(now - killed_at, 4)
        if None not in (stages["node_exited_s"], stages["marked_dead_s"]):
            return
        await asyncio.sleep(POLL_S)


async def warm_up(cluster: NodeCluster, workload: Workload) -> None:
    """A few requests through every node, so that no kill meets a node's first steps."""
    rng = random.Random(workload.seed)
    prompts = [[rng.randrange(4, 500) for _ in range(rng.randrange(8, 200))] for _ in range(8)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    async with CoordinatorClient(cluster.client_addr, keys=cluster.keys) as client:
        await asyncio.gather(*(client.complete(p, params) for p in prompts))


def node_kills(
    kind: str,
    repeats: int,
    workload: Workload,
    engine: EngineConfig,
    sessions: Sessions,
    log_dir: Path | None,
    timeout_s: float,
    transport: str = "tcp",
) -> list[Kill]:
    """`repeats` kills of one kind on one cluster, the killed node started again between them."""
    prefill, decode, decode_tp = SHAPES[kind]
    for repeat in range(repeats):
        workload.compute(workload.prompts(kind, repeat), engine)
    kills: list[Kill] = []
    node_logs = None if log_dir is None else log_dir / kind
    with NodeCluster(engine, prefill, decode, decode_tp, sessions, node_logs, transport) as cluster:
        asyncio.run(warm_up(cluster, workload))
        for repeat in range(repeats):
            cluster.wait_idle()
            kill = asyncio.run(node_kill(cluster, kind, repeat, workload, timeout_s))
            kills.append(kill)
            print(describe_kill(kill), flush=True)
            node = kill.victim.rsplit(" ", 1)[-1]
            if node and repeat + 1 < repeats:
                cluster.restart(node)
                asyncio.run(warm_up(cluster, workload))
    return kills
