"""The simulator's stand-ins for what connects pdserve's parts: a node's link to the coordinator
(`NodeLink`'s interface, messages delivered on the simulated clock) and a KV transport (the
`KVSender` / `KVReceiver` interface of `pdserve.kv_transfer.base`, pages "moved" in the time the transfer
model gives). Nodes use them exactly as they use the real ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from pdserve.cluster.node_link import NodeLink
from pdserve.cluster.node_messages import Heartbeat, Message, Register
from pdserve.kv_transfer.base import KVReceiver, KVSend, KVSender, TransferResult
from pdserve.tune.transfer_model import TransferModel


class Simulation(Protocol):
    """What the stand-ins ask of the simulation that runs them (`tune.simulator.Simulation`)."""

    now: float

    def at(self, when: float, fn: Callable[..., Any], *args: Any) -> None: ...

    def to_coordinator(self, identity: bytes, msg: Message) -> None: ...


TRANSPORT = "sim"


class SimLink:
    """A node's connection to the coordinator: what it sends reaches the coordinator one hop
    later; its heartbeats carry the last load snapshot, as `NodeLink`'s thread does."""

    carry_out = NodeLink.carry_out  # the real handling of an order that fails

    def __init__(self, sim: Simulation, node_id: str, heartbeat_interval_s: float) -> None:
        self.sim = sim
        self.node_id = node_id
        self.identity = node_id.encode()
        self.heartbeat_identity = f"{node_id}/heartbeat".encode()
        self.heartbeat_interval_s = heartbeat_interval_s
        self._load: Heartbeat | None = None
        self._last_load = 0.0

    def register(self, msg: Register) -> None:
        self.send(msg)

    def send(self, msg: Message) -> None:
        self.sim.to_coordinator(self.identity, msg)

    def load_due(self, now: float | None = None) -> bool:
        now = self.sim.now if now is None else now
        return self._load is None or now - self._last_load >= self.heartbeat_interval_s

    def set_load(self, load: Heartbeat) -> None:
        self._last_load = self.sim.now
        seq = (self._load.seq + 1) if self._load is not None else 1
        self._load = msgspec.structs.replace(load, node_id=self.node_id, seq=seq)

    def heartbeat(self) -> None:
        if self._load is not None:
            self.sim.to_coordinator(self.heartbeat_identity, self._load)

    def close(self) -> None:
        pass


class SimKV:
    """The KV transport of one simulated deployment: its receivers by node id, and the model of
    how long a transfer takes."""

    def __init__(self, sim: Simulation, model: TransferModel, bytes_per_block: int) -> None:
        self.sim = sim
        self.model = model
        self.bytes_per_block = bytes_per_block
        self.receivers: dict[str, SimReceiver] = {}

    def receiver(self, node_id: str, wake: Callable[[], None]) -> SimReceiver:
        receiver = SimReceiver(node_id, wake)
        self.receivers[node_id] = receiver
        return receiver

    def sender(self, wake: Callable[[], None]) -> SimSender:
        return SimSender(self, wake)


class SimReceiver(KVReceiver):
    """Lands what senders deliver into expected transfers; a cancelled one is reported failed at
    once (nothing writes into simulated blocks)."""

    name = TRANSPORT
    pool = None

    def __init__(self, node_id: str, wake: Callable[[], None]) -> None:
        self.node_id = node_id
        self.wake = wake  # the node's loop, which polls
        self.expected: set[str] = set()
        self.results: list[TransferResult] = []

    def info(self) -> dict:
        return {"transport": TRANSPORT, "node_id": self.node_id}

    def expect(
        self,
        transfer_id: str,
        dst_blocks: list[int],
        layers: tuple[int, int] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self.expected.add(transfer_id)

    def cancel(self, transfer_id: str, reason: str = "cancelled") -> None:
        if transfer_id in self.expected:
            self.expected.discard(transfer_id)
            self.results.append(TransferResult(transfer_id, False, reason))

    def land(self, transfer_id: str) -> bool:
        """A sender's pages arrived: False if nobody expects them any more."""
        if transfer_id not in self.expected:
            return False
        self.expected.discard(transfer_id)
        self.results.append(TransferResult(transfer_id, True))
        self.wake()
        return True

    def poll(self) -> list[TransferResult]:
        results, self.results = self.results, []
        return results

    def stats(self) -> dict[str, int]:
        return {"expected": len(self.expected)}

    def close(self) -> None:
        pass


class SimSender(KVSender):
    """A prefill node's sender: its transfers take the link one after another, each for its
    bytes over the bandwidth, and land one latency after leaving it."""

    name = TRANSPORT
    pool = None

    def __init__(self, kv: SimKV, wake: Callable[[], None]) -> None:
        self.kv = kv
        self.wake = wake
        self.link_free_at = 0.0
        self.results: list[TransferResult] = []
        self.in_flight = 0

    def connect(self, peer_id: str, receiver_info: dict) -> None:
        if peer_id not in self.kv.receivers:
            raise ValueError(f"no simulated receiver {peer_id!r}")

    def send(self, send: KVSend) -> None:
        sim, model = self.kv.sim, self.kv.model
        start = max(sim.now, self.link_free_at)
        self.link_free_at = start + model.wire_time(len(send.src_blocks) * self.kv.bytes_per_block)
        self.in_flight += 1
        sim.at(self.link_free_at + model.latency_s, self._land, send.transfer_id, send.peer_id)

    def _land(self, transfer_id: str, peer_id: str) -> None:
        ok = self.kv.receivers[peer_id].land(transfer_id)
        self.in_flight -= 1
        self.results.append(TransferResult(transfer_id, ok, None if ok else "cancelled"))
        self.wake()

    def poll(self) -> list[TransferResult]:
        results, self.results = self.results, []
        return results

    def stats(self) -> dict[str, int]:
        return {"outstanding": self.in_flight}

    def close(self) -> None:
        pass
