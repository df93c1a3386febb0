"""The receiver's bookkeeping, apart from sockets and bytes: which transfers are expected, which
sends ("units") are in flight for them, which layers have arrived, and what has expired.

A transfer is announced by expect(id, dst_blocks, layers) and completes once every KV head of
every layer of its range has arrived. A sender delivers it as one or more units (one per send()
call, each a layer range over all the dst blocks, for all the pool's KV heads or a slice of them:
a tensor-parallel sender of fewer heads per rank fills a page from several ranks). A unit that comes before its expect() waits (its data is held,
never written) until the expect() or its own timeout. Finished ids are remembered for a while
so late data for a failed transfer is refused instead of landing in reused blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Expected:
    transfer_id: str
    dst_blocks: list[int]
    layers: tuple[int, int]
    deadline: float
    arrived: list[int]  # per layer of the range, a bit per KV head that has arrived
    all_heads: int  # the bits of every head
    peers: set[bytes] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return all(a == self.all_heads for a in self.arrived)

    @property
    def missing_layers(self) -> list[int]:
        return [self.layers[0] + i for i, a in enumerate(self.arrived) if a != self.all_heads]


class UnitState(enum.Enum):
    WAITING = "waiting"  # came before its expect(): data held, nothing written
    OPEN = "open"  # expected: pushed pages land
    GRANTED = "granted"  # expected: the sender writes into the pool itself


@dataclass(slots=True)
class Unit:
    """One send() as the receiver sees it."""

    peer: bytes
    send_id: int
    transfer_id: str
    dst_blocks: list[int]
    layers: tuple[int, int]
    deadline: float  # only enforced while waiting for the expect()
    direct: bool = False  # the sender writes into the pool itself (shm, cuda_ipc)
    heads: tuple[int, int] | None = None  # the KV heads it fills (None: all)
    state: UnitState = UnitState.WAITING
    held: list[Any] = field(default_factory=list)  # chunks that came while waiting
    held_bytes: int = 0
    pages: int = 0  # (layer, block) pages landed so far
    verified: int = 0  # (layer, block) pages of a direct write whose digest was checked

    @property
    def key(self) -> tuple[bytes, int]:
        return (self.peer, self.send_id)

    @property
    def total_pages(self) -> int:
        return (self.layers[1] - self.layers[0]) * len(self.dst_blocks)

    def head_bits(self, num_heads: int) -> int:
        h0, h1 = self.heads if self.heads is not None else (0, num_heads)
        return ((1 << h1) - 1) ^ ((1 << h0) - 1)


class Arrivals:
    def __init__(
        self, num_layers: int, num_blocks: int, num_heads: int = 1, remember_s: float = 600.0
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.num_heads = num_heads
        self.remember_s = remember_s
        self.expected: dict[str, Expected] = {}
        self.units: dict[tuple[bytes, int], Unit] = {}
        self.finished: dict[str, float] = {}  # recently completed, failed or cancelled ids

    # -- announcing -------------------------------------------------------------------------
    def check_request(
        self, dst_blocks: list[int], layers: tuple[int, int] | None
    ) -> tuple[int, int]:
        """Validate an expect() or send() request; return its layer range."""
        l0, l1 = (0, self.num_layers) if layers is None else (int(layers[0]), int(layers[1]))
        if not 0 <= l0 < l1 <= self.num_layers:
            raise ValueError(f"layer range {(l0, l1)} outside [0, {self.num_layers}]")
        if not dst_blocks:
            raise ValueError("no destination blocks")
        if len(set(dst_blocks)) != len(dst_blocks):
            raise ValueError("destination blocks repeat")
        bad = [b for b in dst_blocks if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"destination blocks {bad[:4]} outside [0, {self.num_blocks})")
        return l0, l1

    def expect(
        self,
        transfer_id: str,
        dst_blocks: list[int],
        layers: tuple[int, int] | None,
        timeout_s: float,
        now: float,
    ) -> Expected:
        rng = self.check_request(dst_blocks, layers)
        if transfer_id in self.expected:
            raise ValueError(f"transfer {transfer_id!r} is already expected")
        self.finished.pop(transfer_id, None)
        exp = Expected(
            transfer_id,
            list(dst_blocks),
            rng,
            now + timeout_s,
            [0] * (rng[1] - rng[0]),
            (1 << self.num_heads) - 1,
        )
        self.expected[transfer_id] = exp
        return exp

    # -- units ------------------------------------------------------------------------------
    def open_unit(
        self,
        peer: bytes,
        send_id: int,
        transfer_id: str,
        dst_blocks: list[int],
        layers: tuple[int, int],
        timeout_s: float,
        now: float,
        direct: bool = False,
        heads: tuple[int, int] | None = None,
    ) -> Unit | str:
        """A send begins; returns its unit, or why it is refused."""
        if (peer, send_id) in self.units:
            return f"send {send_id} of transfer {transfer_id!r} is already open"
        if transfer_id in self.finished and transfer_id not in self.expected:
            return f"transfer {transfer_id!r} already finished or failed on the receiver"
        try:
            self.check_request(dst_blocks, layers)
        except ValueError as e:
            return str(e)
        if heads is not None and not 0 <= heads[0] < heads[1] <= self.num_heads:
            return f"heads {list(heads)} outside [0, {self.num_heads})"
        unit = Unit(
            peer,
            send_id,
            transfer_id,
            list(dst_blocks),
            tuple(layers),
            now + timeout_s,
            direct,
            heads=None if heads is None else tuple(heads),
        )
        exp = self.expected.get(transfer_id)
        if exp is not None:
            error = self.admit(unit, exp)
            if error:
                return error
        self.units[unit.key] = unit
        return unit

    def admit(self, unit: Unit, exp: Expected) -> str | None:
        """Check a unit against its expectation and open it; None if it fits."""
        if len(unit.dst_blocks) != len(exp.dst_blocks) or set(unit.dst_blocks) != set(
            exp.dst_blocks
        ):
            return f"destination blocks of transfer {exp.transfer_id!r} differ from the expected"
        l0, l1 = unit.layers
        if l0 < exp.layers[0] or l1 > exp.layers[1]:
            return f"layers {unit.layers} outside the expected range {exp.layers}"
        bits = unit.head_bits(self.num_heads)
        if any(exp.arrived[i - exp.layers[0]] & bits for i in range(l0, l1)):
            return f"layers {unit.layers} of transfer {exp.transfer_id!r} already arrived"
        unit.state = UnitState.OPEN
        exp.peers.add(unit.peer)
        return None

    def waiting_for(self, transfer_id: str) -> list[Unit]:
        return [
            u
            for u in self.units.values()
            if u.transfer_id == transfer_id and u.state is UnitState.WAITING
        ]

    def close_unit(self, unit: Unit) -> str | None:
        """The unit's data is all in place: mark its layers arrived. Returns an error if short."""
        self.units.pop(unit.key, None)
        if unit.pages != unit.total_pages:
            return f"send {unit.send_id} delivered {unit.pages} of {unit.total_pages} pages"
        exp = self.expected[unit.transfer_id]
        bits = unit.head_bits(self.num_heads)
        if any(exp.arrived[i - exp.layers[0]] & bits for i in range(*unit.layers)):
            return f"layers {unit.layers} of transfer {exp.transfer_id!r} already arrived"
        for i in range(unit.layers[0], unit.layers[1]):
            exp.arrived[i - exp.layers[0]] |= bits
        return None

    def drop_unit(self, unit: Unit) -> None:
        self.units.pop(unit.key, None)

    # -- endings ----------------------------------------------------------------------------
    def finish(self, transfer_id: str, now: float) -> list[Unit]:
        """End a transfer (done, failed or cancelled); returns its units still in flight."""
        self.expected.pop(transfer_id, None)
        self.finished[transfer_id] = now
        units = [u for u in self.units.values() if u.transfer_id == transfer_id]
        for u in units:
            self.units.pop(u.key)
        return units

    def expired(self, now: float) -> tuple[list[Expected], list[Unit]]:
        """Expectations past their deadline, and waiting units past theirs."""
        exps = [e for e in self.expected.values() if now >= e.deadline]
        units = [
            u for u in self.units.values() if u.state is UnitState.WAITING and now >= u.deadline
        ]
        for tid in [t for t, at in self.finished.items() if now - at > self.remember_s]:
            del self.finished[tid]
        return exps, units

    def peer_transfers(self, peer: bytes) -> set[str]:
        """Transfers a peer takes part in (has sent at least one unit for)."""
        ids = {u.transfer_id for u in self.units.values() if u.peer == peer}
        ids |= {e.transfer_id for e in self.expected.values() if peer in e.peers}
        return ids

    def peer_units(self, peer: bytes) -> list[Unit]:
        return [u for u in self.units.values() if u.peer == peer]

    @property
    def active_peers(self) -> set[bytes]:
        peers = {u.peer for u in self.units.values()}
        for e in self.expected.values():
            peers |= e.peers
        return peers

    @property
    def held_bytes(self) -> int:
        return sum(u.held_bytes for u in self.units.values())
