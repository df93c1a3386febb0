"""A discrete-event simulation of one pdserve deployment, running pdserve's own decisions.

Real, unchanged: the coordinator (`CoordinatorCore`: routing, prefix affinity, conditional
disaggregation, admission, handoff bookkeeping), every node's message handling and handoff state
(`PrefillNode`, `DecodeNode`, `PrefillHandoff`, `DecodeHandoff`) and its engine's decisions
(`Engine`: the `Scheduler` with chunked prefill and preemption, the `BlockManager` with prefix
caching, sequences and their stop checks). Modeled: each engine step's duration (a
`StepTimeModel` of the step's shape; sampled tokens never end a request early, every request
runs to its `max_tokens` with `ignore_eos`) and each KV transfer (a `TransferModel`), plus fixed
delays for a message between the coordinator and a node and for the HTTP front end.

Time: a node with work starts a step at t (the engine schedules, the modeled executor returns,
the scheduler postprocesses, all at t) and is busy until t + the step's modeled time, when its
reports leave; orders that arrive meanwhile wait for the step's end, as in the node's loop,
except SendKV, which the prefill node's handoff socket starts at once. Heartbeats carry each
node's last load snapshot every `heartbeat_interval_s`; the coordinator ticks every 0.1 s. Once
the deployment has been idle for a few heartbeats, nothing changes until the next arrival: the
clock skips the rest of the gap (metrics keep the workload's own arrival times).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pdserve.cluster.node_messages import HandoffReady, Message, NodeRole, SendKV
from pdserve.cluster.sampling_params import SamplingParams
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.coordinator import TICK_S
from pdserve.coordinator.core import CoordinatorCore, Outbox, SubmitError
from pdserve.coordinator.request_state import RequestState
from pdserve.decode_node.worker import DecodeNode
from pdserve.engine.config import EngineConfig
from pdserve.engine.execution.executor import SampledTokens
from pdserve.engine.llm_engine import Engine
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.prefill_node.worker import PrefillNode
from pdserve.tune.deployment import Deployment
from pdserve.tune.metrics import Outcome
from pdserve.tune.profile import Profile
from pdserve.tune.sim_links import SimKV, SimLink
from pdserve.tune.slo import SLO
from pdserve.tune.step_model import StepShape, StepTimeModel
from pdserve.tune.workload import SimRequest

START_S = 1.0  # nodes register and report before the first request arrives
HORIZON_S = 3600.0  # after the last arrival, a run that has not ended is stopped (a safety net)
IDLE_HEARTBEATS = 3  # idle this long (every node reported its empty pool): skip to the arrival
SAMPLED_TOKEN = 11  # what every modeled step samples: an id valid in any vocabulary


class ModeledExecutor:
    """The executor of a simulated engine: the step's duration from the step-time model, and a
    token for every sequence whose chunk reached its end."""

    def __init__(self, model: StepTimeModel, overhead_s: float = 0.0) -> None:
        self.model = model
        self.overhead_s = overhead_s  # a served step's time beyond the model's
        self.duration = 0.0  # of the last step

    def execute(self, out: SchedulerOutput) -> SampledTokens:
        rows: list[int] = []
        self.duration = self.model.time(StepShape.of(out, rows)) + self.overhead_s
        return SampledTokens(rows, [SAMPLED_TOKEN] * len(rows), [None] * len(rows))


class SimNode:
    """One node's loop on the simulated clock: `before_step` (orders, arrived KV), the engine's
    step, and `after_step` (reports, load) one modeled step time later."""

    def __init__(self, sim: Simulation, node: PrefillNode | DecodeNode, link: SimLink) -> None:
        self.sim = sim
        self.node = node
        self.link = link
        self.engine = node.engine
        self.executor: ModeledExecutor = node.engine.executor
        self.inbox: list[Message] = []
        self.busy = False  # a step in progress, or a loop iteration due now
        self.decodes = isinstance(node, DecodeNode)

    def deliver(self, msg: Message) -> None:
        self.inbox.append(msg)
        self.wake()

    def wake(self) -> None:
        if not self.busy:
            self.busy = True
            self.sim.at(self.sim.now, self._begin)

    def _begin(self) -> None:
        orders, self.inbox = self.inbox, []
        self.node.before_step(orders)
        self.executor.duration = 0.0
        preemptions = self.engine.scheduler.num_preemptions
        outputs = self.engine.step() if self.engine.has_unfinished() else []
        if self.executor.duration > 0:
            self.sim.at(self.sim.now + self.executor.duration, self._end, outputs, True)
        else:
            # Nothing ran: the scheduler waits for blocks that handoffs hold. It runs again
            # when an order, a transfer or its ack wakes it (or when it just preempted).
            self._end(outputs, self.engine.scheduler.num_preemptions != preemptions)

    def _end(self, outputs: list, progressed: bool) -> None:
        self.node.after_step(outputs)
        self.busy = False
        if self.inbox or (progressed and self.engine.has_unfinished()):
            self.wake()

    def heartbeat(self) -> None:
        """The heartbeat thread's send; an idle loop refreshes its snapshot first, as the real
        one does between its short waits for orders."""
        if not self.busy:
            self.node.after_step([])
            if self.engine.has_unfinished():
                self.wake()
        self.link.heartbeat()


@dataclass(slots=True)
class RunResult:
    outcomes: list[Outcome]
    stopped_early: bool
    sim_seconds: float  # simulated time the run took
    num_steps: int
    num_preemptions: int
    peak_kv_usage: float  # the fullest any decoding node's KV pool was at a heartbeat


class Simulation:
    def __init__(self, deployment: Deployment, profile: Profile) -> None:
        self.deployment = deployment
        self.profile = profile
        self.now = 0.0
        self._events: list[tuple[float, int, Callable, tuple]] = []
        self._order = itertools.count()
        config = CoordinatorConfig(**deployment.coordinator_settings())
        self.core = CoordinatorCore(config)
        self.core.listeners.append(self._on_request)
        # Each role's nodes are groups of its tensor-parallel size: their own step times, KV
        # pools and (prefill) sends.
        self.prefill_profile = profile.at_tp(deployment.prefill_tp)
        self.decode_profile = profile.at_tp(deployment.decode_tp)
        self.kv = SimKV(self, self.prefill_profile.transfer, profile.kv_bytes_per_block)
        self.nodes: dict[bytes, SimNode] = {}  # by every identity a node's sockets have
        self.handoff_sockets: dict[bytes, SimNode] = {}
        self._build_nodes()

    # --- the clock ------------------------------------------------------------------------------

    def at(self, time: float, fn: Callable, *args: object) -> None:
        heapq.heappush(self._events, (time, next(self._order), fn, args))

    # --- the deployment -------------------------------------------------------------------------

    def _engine(self, role: str) -> Engine:
        p, d = self.prefill_profile if role == "prefill" else self.decode_profile, self.deployment
        config = EngineConfig(block_size=p.block_size, **d.engine_settings())
        return Engine(
            config,
            p.model.kv_layout(p.block_size, p.dtype),
            p.kv_blocks,
            p.model.vocab_size,
            p.model.max_position_embeddings,
            eos_token_ids=(),
            executor=ModeledExecutor(p.step, p.step_overhead_s),
        )

    def _build_nodes(self) -> None:
        d, interval = self.deployment, self.profile.heartbeat_interval_s
        specs = [("prefill", i) for i in range(d.prefill)]
        specs += [("colocated" if d.colocated else "decode", i) for i in range(d.decode)]
        for index, (role, i) in enumerate(specs):
            node_id = f"{role}-{i}"
            link = SimLink(self, node_id, interval)
            holder: list[SimNode] = []

            def wake(holder: list[SimNode] = holder) -> None:
                holder[0].wake()

            if role == "prefill":
                node = PrefillNode(
                    self._engine(role),
                    link,
                    self.kv.model.transport,
                    make_sender=lambda _t, _p, w=wake: self.kv.sender(w),
                )
            elif role == "decode":
                node = DecodeNode(self._engine(role), link, self.kv.receiver(node_id, wake))
            else:
                node = DecodeNode(self._engine(role), link, None, NodeRole.COLOCATED)
            sim_node = SimNode(self, node, link)
            holder.append(sim_node)
            self.nodes[link.identity] = sim_node
            node.register()
            if role == "prefill":  # its handoff socket says where SendKV goes
                handoff = f"{node_id}/handoff".encode()
                self.handoff_sockets[handoff] = sim_node
                self.to_coordinator(handoff, HandoffReady(node_id))
            # Heartbeats spread over the interval, as independent threads' would be.
            self.at(interval * (1 + index / len(specs)), self._heartbeat, sim_node)

    def _heartbeat(self, node: SimNode) -> None:
        node.heartbeat()
        if node.decodes:
            bm = node.engine.block_manager
            self._peak_kv_usage = max(self._peak_kv_usage, bm.num_used_blocks / bm.num_blocks)
        if not self._done:
            self.at(self.now + self.profile.heartbeat_interval_s, self._heartbeat, node)

    # --- messages -------------------------------------------------------------------------------

    def to_coordinator(self, identity: bytes, msg: Message) -> None:
        self.at(self.now + self.profile.hop_s, self._coordinator_receives, identity, msg)

    def _coordinator_receives(self, identity: bytes, msg: Message) -> None:
        self._deliver(self.core.on_node_message(identity, msg, self.now))

    def _deliver(self, out: Outbox) -> None:
        for identity, order in out.orders:
            self.at(self.now + self.profile.hop_s, self._node_receives, identity, order)

    def _node_receives(self, identity: bytes, order: Message) -> None:
        handoff = self.handoff_sockets.get(identity)
        if handoff is not None and isinstance(order, SendKV):
            handoff.node.send_kv(order)  # the handoff socket's thread, beside the step
        elif identity in self.nodes:
            self.nodes[identity].deliver(order)

    def _tick(self) -> None:
        self._deliver(self.core.on_tick(self.now))
        self._check_deadlines()
        if self.now > self._horizon - self._skipped:
            self._stopped = self._done = True
        if not self._done:
            self._skip_idle_time()
            self.at(self.now + TICK_S, self._tick)

    def _idle(self) -> bool:
        """No request in the deployment: every one that arrived has ended, every node is idle."""
        if self.core.requests or self._next_arrival > len(self._requests) - self._remaining:
            return False
        return all(not n.busy and not n.engine.has_unfinished() for n in self.nodes.values())

    def _skip_idle_time(self) -> None:
        """Idle since `_idle_since` and still for a while: the heartbeats and ticks of the rest of
        the gap change nothing, so the next arrival comes at once (a long gap at a low rate would
        otherwise cost its every heartbeat)."""
        if not self._idle():
            self._idle_since = None
            return
        if self._idle_since is None:
            self._idle_since = self.now
        if self._next_arrival >= len(self._requests):
            return
        settle = IDLE_HEARTBEATS * self.profile.heartbeat_interval_s
        due = self._arrival_time(self._next_arrival)
        if self.now - self._idle_since >= settle and due > self.now + TICK_S:
            self._skipped += due - (self.now + TICK_S)
            self._arrival_generation += 1
            self.at(
                self._arrival_time(self._next_arrival),
                self._arrive,
                self._next_arrival,
                self._arrival_generation,
            )

    # --- requests -------------------------------------------------------------------------------

    def run(self, requests: list[SimRequest], slo: SLO | None = None, seed: int = 0) -> RunResult:
        """Serve `requests` (their arrival_s from the first request's arrival). With an SLO, the
        run stops as soon as more requests have missed it than its attainment allows."""
        self._requests = requests
        self._outcomes: list[Outcome | None] = [None] * len(requests)
        self._remaining = len(requests)
        self._done = not requests
        self._slo = slo
        self._allowed_misses = (
            math.floor((1 - slo.attainment) * len(requests) + 1e-9) if slo else len(requests)
        )
        self._misses: set[int] = set()
        self._deadlines: list[tuple[float, int, str]] = []
        self._rng = np.random.default_rng(seed)
        self._prefixes: dict[int, list[int]] = {}
        vocab = self.profile.model.vocab_size
        self._token_range = (min(10, vocab - 1), min(250, vocab))  # small ints: cheap lists
        self._stopped = False
        self._peak_kv_usage = 0.0
        self._horizon = START_S + (requests[-1].arrival_s if requests else 0.0) + HORIZON_S
        self._skipped = 0.0  # idle time the clock skipped: arrivals come this much earlier
        self._idle_since: float | None = None
        self._next_arrival = 0  # the index of the request to arrive next
        self._arrival_generation = 0  # a skip reschedules the next arrival; the old one lapses
        self.at(START_S, self._tick)
        if requests:
            self.at(self._arrival_time(0), self._arrive, 0, 0)
        while self._events and not self._done:
            self.now, _, fn, args = heapq.heappop(self._events)
            fn(*args)
        self._events.clear()
        outcomes = [
            o if o is not None else Outcome(False, r.arrival_s, 0)
            for o, r in zip(self._outcomes, requests)
        ]
        engines = [n.engine for n in self.nodes.values()]
        return RunResult(
            outcomes,
            self._stopped,
            self.now - START_S + self._skipped,
            sum(e.stats.num_steps for e in engines),
            sum(e.scheduler.num_preemptions for e in engines),
            self._peak_kv_usage,
        )

    def _prompt(self, request: SimRequest) -> list[int]:
        if request.prompt is not None:
            return list(request.prompt)
        lo, hi = self._token_range
        prefix: list[int] = []
        if request.prefix_group is not None and request.prefix_len:
            prefix = self._prefixes.get(request.prefix_group, [])
            if len(prefix) < request.prefix_len:
                prefix += self._rng.integers(lo, hi, request.prefix_len - len(prefix)).tolist()
                self._prefixes[request.prefix_group] = prefix
            prefix = prefix[: request.prefix_len]
        rest = self._rng.integers(lo, hi, max(0, request.prompt_len - len(prefix))).tolist()
        return prefix + rest

    def _arrival_time(self, index: int) -> float:
        return START_S + self._requests[index].arrival_s - self._skipped

    def _arrive(self, index: int, generation: int) -> None:
        if generation != self._arrival_generation:
            return  # rescheduled earlier by a skip of idle time
        request = self._requests[index]
        self._next_arrival = index + 1
        if index + 1 < len(self._requests):
            self.at(self._arrival_time(index + 1), self._arrive, index + 1, generation)
        params = SamplingParams(max_tokens=request.output_len, temperature=0, ignore_eos=True)
        try:
            _, out = self.core.submit(self._prompt(request), params, self.now, f"r{index}")
        except SubmitError:  # refused (overloaded, or a prompt over the context): a failure
            self._record(index, Outcome(False, request.arrival_s, 0))
            return
        self._deliver(out)
        if self._slo is not None:
            deadline = self.now + self._slo.ttft_s - self.profile.frontend_s
            heapq.heappush(self._deadlines, (deadline, index, "ttft"))

    def _on_request(self, event: str, state: RequestState) -> None:
        if event not in ("first_token", "finished"):
            return  # every token's event: nothing to record
        index = int(state.request_id[1:])
        if event == "first_token" and self._slo is not None:
            outputs = self._requests[index].output_len
            deadline = self.now + self._slo.tpot_s * max(0, outputs - 1)
            heapq.heappush(self._deadlines, (deadline, index, "tpot"))
        elif event == "finished":
            request = self._requests[index]
            frontend = self.profile.frontend_s
            success = state.finish_reason in ("length", "stop")
            first = state.first_token_at if state.first_token_at is not None else self.now
            self._record(
                index,
                Outcome(
                    success,
                    request.arrival_s,
                    len(state.output_token_ids),
                    first - state.arrival + frontend,
                    self.now - state.arrival + frontend,
                ),
            )

    def _record(self, index: int, outcome: Outcome) -> None:
        if self._outcomes[index] is None:
            self._outcomes[index] = outcome
            self._remaining -= 1
            if self._slo is not None and not outcome.meets(self._slo):
                self._miss(index)
            if self._remaining == 0:
                self._done = True

    def _miss(self, index: int) -> None:
        self._misses.add(index)
        if len(self._misses) > self._allowed_misses:
            self._stopped = self._done = True

    def _check_deadlines(self) -> None:
        """Requests past a deadline of theirs without its token are misses already."""
        while self._deadlines and self._deadlines[0][0] < self.now:
            _, index, kind = heapq.heappop(self._deadlines)
            if self._outcomes[index] is not None or index in self._misses:
                continue
            state = self.core.requests.get(f"r{index}")
            if kind == "ttft" and state is not None and state.first_token_at is not None:
                continue
            self._miss(index)
