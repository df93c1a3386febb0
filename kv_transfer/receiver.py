"""The receiver every transport shares: a ROUTER control socket served by one background thread
that lands pages, answers senders, enforces timeouts and notices dead peers.

Two ways pages arrive. Push (tcp, nccl): each chunk of a send comes with a Pages header, its
bytes in the same ZMQ message (tcp) or over NCCL; the thread scatters it into the pool. Direct
(shm, cuda_ipc): the sender asks with Begin, the thread answers Go once the transfer is expected,
the sender writes into the mapped pool and says Done. Either way the thread acks each send, and
a transfer completes when all its layers are in. The step loop only calls expect() and poll().
Whatever else arrives (junk of any shape, from anyone) is dropped and logged once per peer.
Here: the thread, the transfers' expectations and ends, the peers; the senders' messages are
handled in `receiver_handlers.py`, and pages land and are verified in `landing.py`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch
import zmq

from pdserve.cluster.codec import MalformedLog, ProtocolError
from pdserve.cluster.faults import FAULTS_POLL_MS, message_faults
from pdserve.cluster.keys import ClusterKeys, close_server
from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.kv_transfer.arrivals import Arrivals, Expected, Unit, UnitState
from pdserve.kv_transfer.base import KVReceiver, TransferResult
from pdserve.kv_transfer.channel import CommandThread, Security, bind_router
from pdserve.kv_transfer.faults import KVFaults
from pdserve.kv_transfer.integrity import IntegrityError
from pdserve.kv_transfer.landing import PageLanding, Payload
from pdserve.kv_transfer.protocol import (
    KV_PROTOCOL_VERSION,
    MAX_CONTROL_BYTES,
    Ack,
    ControlMessage,
    Hello,
    Nack,
    Pages,
    Ping,
    control,
)
from pdserve.kv_transfer.receiver_handlers import ReceiverHandlers

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Draining:
    """A transfer that ended (failed or cancelled) while senders granted a direct write may be
    copying into its blocks: its end is reported once they are done, or at `deadline`."""

    error: str
    writers: set[tuple[bytes, int]]  # unit keys (peer, send id)
    deadline: float
    integrity: str = ""  # "failed" when a digest check ended it (`TransferResult.integrity`)


class ZmqReceiver(ReceiverHandlers, CommandThread, KVReceiver):
    """Receiver base: subclasses say how the pool is made and how pushed payloads arrive."""

    name = "base"
    _role = "receiver"

    def __init__(
        self,
        pool: KVPool,
        address: str = "tcp://127.0.0.1:0",
        advertise_host: str | None = None,
        probe_interval_s: float = 0.2,
        max_held_bytes: int = 1 << 30,
        keys: ClusterKeys | None = None,
        encrypt: bool = True,
    ) -> None:
        """keys: the cluster key set senders must hold (None: anyone may connect); encrypt: with
        keys, CurveZMQ on the socket, or else a password only keyed senders learn, pages in
        clear."""
        self.pool = pool
        self.layout: KVLayout = pool.layout
        self._probe_interval_s = probe_interval_s
        self._max_held_bytes = max_held_bytes
        self._arrivals = Arrivals(self.layout.num_slots, pool.num_blocks, self.layout.num_kv_heads)
        self._ctx = zmq.Context(io_threads=1)
        self._security = Security(keys, encrypt)
        self._router, self.address = bind_router(
            self._ctx, address, self._max_frame_bytes(), advertise_host, self._security
        )
        self._malformed = MalformedLog(log, f"{self.name} KV receiver")
        self._stream = torch.cuda.Stream(pool.kv.device) if pool.kv.is_cuda else None
        # PDSERVE_KV_FAULTS may ask for faults in landed pages.
        self._landing = PageLanding(pool, self._stream, KVFaults.from_env(), self._to_device)
        self._inflight: deque[tuple[bytes, Pages, Payload]] = deque()  # pushed chunks in order
        self._peers: set[bytes] = set()
        self._integrity: dict[bytes, str | None] = {}  # each peer's digest algorithm
        self._integrity_failures = 0  # sends whose pages landed other than they left
        self._message_faults = message_faults(f"{self.name} KV receiver")  # (PDSERVE_FAULTS)
        self._draining: dict[str, Draining] = {}  # by transfer id
        self._start_thread(
            {"expected": 0, "units": 0, "held_bytes": 0, "peers": 0, "integrity_failures": 0}
        )

    # -- interface ---------------------------------------------------------------------------
    def info(self) -> dict:
        return {
            "transport": self.name,
            "protocol": KV_PROTOCOL_VERSION,
            "layout": self.layout.to_dict(),
            "num_blocks": self.pool.num_blocks,
            "address": self.address,
            "max_frame_bytes": self._max_frame_bytes(),
            **self._security.info(),
            **self._info_extra(),
        }

    def expect(
        self,
        transfer_id: str,
        dst_blocks: list[int],
        layers: tuple[int, int] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self._check_open()
        rng = self._arrivals.check_request(list(dst_blocks), layers)
        self._command("expect", transfer_id, [int(b) for b in dst_blocks], rng, timeout_s)

    def cancel(self, transfer_id: str, reason: str = "cancelled by the receiver") -> None:
        """Forget an expected transfer and tell its senders to stop. Unless it has already ended,
        poll() reports it failed with `reason` once nothing writes into its blocks any more:
        at once for pushed pages, after the sender's copy for a direct write in progress."""
        self._check_open()
        self._command("cancel", transfer_id, reason)

    def close(self) -> None:
        if self._closed:
            return
        if self._stop_thread():
            self._ctx.destroy(linger=0)  # (the router a dead thread could not close, too)
        self._release()

    # -- transport hooks ---------------------------------------------------------------------
    def _info_extra(self) -> dict:
        return {}

    def _max_frame_bytes(self) -> int:
        """The largest frame the router takes (ZeroMQ drops a peer that sends more): control
        messages only, unless pages travel over the socket."""
        return MAX_CONTROL_BYTES

    def _welcome(self, peer: bytes, hello: Hello) -> dict:
        """Extra handshake data for a sender that passed the layout check."""
        return {}

    def _after_welcome(self, peer: bytes, extra: dict) -> None:
        pass

    def _receive(self, peer: bytes, msg: Pages, frames: list[zmq.Frame]) -> Payload:
        """Push transports: the bytes of a chunk whose header was checked against the layout;
        raise ProtocolError if the frames do not fit it."""
        raise ProtocolError(f"the {self.name} transport does not push pages")

    def _to_device(self, data: torch.Tensor) -> torch.Tensor:
        """Pushed bytes on the pool's device (`PageLanding.to_device`)."""
        return data if data.device == self.pool.kv.device else data.to(self.pool.kv.device)

    def _peer_gone(self, peer: bytes) -> None:
        pass

    def _release(self) -> None:
        """Free transport resources after the thread stopped."""

    # -- thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        self._waker.register(poller)
        next_probe = time.monotonic() + self._probe_interval_s
        try:
            if self.pool.kv.is_cuda:
                torch.cuda.set_device(self.pool.kv.device)  # Triton and CuPy use the current one
            while True:
                events = dict(poller.poll(self._poll_timeout_ms()))
                if self._waker.fd in events:
                    self._waker.drain()
                if self._apply_commands():
                    break
                if self._router in events:
                    self._drain_router()
                if self._message_faults is not None:  # what an injected fault held back
                    for frames in self._message_faults.due():
                        self._on_frames(frames)
                self._land_ready()
                now = time.monotonic()
                self._expire(now)
                if now >= next_probe:
                    self._probe_peers()
                    next_probe = now + self._probe_interval_s
                self._publish_stats()
        except Exception as e:  # the thread must not die silently
            self._die(e)
        finally:
            close_server(self._router)

    def _poll_timeout_ms(self) -> int:
        if self._inflight:
            return 1  # device transfers to watch
        if self._message_faults is not None:
            return FAULTS_POLL_MS
        deadlines = [e.deadline for e in self._arrivals.expected.values()]
        deadlines += [
            u.deadline for u in self._arrivals.units.values() if u.state is UnitState.WAITING
        ]
        wait = self._probe_interval_s
        if deadlines:
            wait = min(wait, max(0.0, min(deadlines) - time.monotonic()))
        return max(1, int(wait * 1000))

    def _apply_commands(self) -> bool:
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "stop":
                self._fail_everything("receiver closed")
                self._publish_stats()
                return True
            if cmd[0] == "expect":
                try:
                    self._on_expect(*cmd[1:])
                except Exception as e:  # this expect fails, not the receiver
                    log.exception("%s receiver: expect of %s failed", self.name, cmd[1])
                    self._fail_expect(cmd[1], f"expect failed: {e!r}")
            elif cmd[0] == "cancel":
                self._end(cmd[1], cmd[2], quiet=True)
        return False

    def _fail_pending(self, why: str) -> None:
        self._fail_everything(why)

    def _never_applied(self, cmd: tuple, why: str) -> TransferResult | None:
        return TransferResult(cmd[1], False, why) if cmd[0] == "expect" else None

    def _drain_router(self) -> None:
        for _ in range(256):  # then look at timers and commands again
            try:
                frames = self._router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if self._message_faults is None:
                self._on_frames(frames)
            else:
                for arrived in self._message_faults.arrive(frames, skip=1):
                    self._on_frames(arrived)

    def _send(self, peer: bytes, msg: ControlMessage) -> bool:
        try:
            self._router.send_multipart([peer, control.encode(msg)], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                self._on_peer_lost(peer, "sender disconnected")
            return False

    # -- landing -----------------------------------------------------------------------------
    def _land(self, unit: Unit, msg: Pages, payload: Payload) -> None:
        try:
            self._landing.land(unit, msg, payload, self._integrity.get(unit.peer))
            if msg.last:
                self._close_unit(unit)
        except IntegrityError as e:
            self._integrity_failed(unit, str(e))
        except Exception as e:  # e.g. a chunk that does not fit: this transfer fails, not all
            log.exception("%s receiver: landing pages of %s failed", self.name, unit.transfer_id)
            self._end(unit.transfer_id, f"landing pages failed: {e}")

    def _integrity_failed(self, unit: Unit, why: str) -> None:
        self._integrity_failures += 1
        log.warning("%s receiver: %s", self.name, why)
        self._end(unit.transfer_id, why, integrity="failed")

    def _fail_unit(self, unit: Unit, why: str) -> None:
        """A send that went wrong: refuse it, and fail its transfer if it is expected."""
        if unit.transfer_id in self._arrivals.expected:
            self._end(unit.transfer_id, why)  # Nacks every send of it, this one too
            return
        self._arrivals.drop_unit(unit)
        self._send(unit.peer, Nack(unit.transfer_id, unit.send_id, why))

    def _close_unit(self, unit: Unit) -> None:
        error = self._arrivals.close_unit(unit)
        if error:
            self._send(unit.peer, Nack(unit.transfer_id, unit.send_id, error))
            self._end(unit.transfer_id, error)
            return
        self._send(unit.peer, Ack(unit.transfer_id, unit.send_id))
        exp = self._arrivals.expected.get(unit.transfer_id)
        if exp is not None and exp.complete:
            self._arrivals.finish(unit.transfer_id, time.monotonic())
            integrity = "ok" if self._integrity.get(unit.peer) else "off"
            self._finished.append(TransferResult(unit.transfer_id, True, integrity=integrity))

    # -- expectations ------------------------------------------------------------------------
    def _on_expect(
        self, tid: str, dst: list[int], layers: tuple[int, int], timeout_s: float
    ) -> None:
        try:
            exp = self._arrivals.expect(tid, dst, layers, timeout_s, time.monotonic())
        except ValueError as e:
            self._finished.append(TransferResult(tid, False, str(e)))
            return
        for unit in self._arrivals.waiting_for(tid):
            self._admit(unit, exp)

    def _admit(self, unit: Unit, exp: Expected) -> None:
        error = self._arrivals.admit(unit, exp)
        if error:
            self._arrivals.drop_unit(unit)
            self._send(unit.peer, Nack(unit.transfer_id, unit.send_id, error))
            return
        if unit.direct:
            self._grant(unit)
            return
        held, unit.held, unit.held_bytes = unit.held, [], 0
        for msg, payload in held:
            if unit.key not in self._arrivals.units:
                break  # failed while landing
            self._land(unit, msg, payload)

    def _expire(self, now: float) -> None:
        for tid, draining in list(self._draining.items()):
            if now > draining.deadline:  # a sender that never says it is done: waited enough
                log.warning("%s receiver: no end of the writes into %s's blocks", self.name, tid)
                del self._draining[tid]
                self._report_failed(tid, draining.error, draining.integrity)
        exps, units = self._arrivals.expired(now)
        for exp in exps:
            self._end(exp.transfer_id, f"timed out waiting for layers {exp.missing_layers}")
        for unit in units:
            self._arrivals.drop_unit(unit)
            self._send(
                unit.peer,
                Nack(unit.transfer_id, unit.send_id, "receiver never expected this transfer"),
            )

    def _end(
        self,
        tid: str,
        error: str,
        report: bool = True,
        nack: bool = True,
        quiet: bool = False,
        integrity: str = "",
    ) -> None:
        """Fail (or cancel) a transfer: forget it, tell its senders, report it (quiet: without a
        warning, as for a cancel; integrity: "failed" when a digest check failed it)."""
        was_expected = tid in self._arrivals.expected
        units = self._arrivals.finish(tid, time.monotonic())
        if nack:
            for unit in units:
                self._send(unit.peer, Nack(tid, unit.send_id, error))
        if not (was_expected and report):
            return
        if not quiet:
            log.warning("%s receiver: transfer %s failed: %s", self.name, tid, error)
        writers = [u for u in units if u.direct and u.state is UnitState.GRANTED]
        if writers:
            # Their senders may be copying into the blocks right now: whoever reuses the blocks
            # must hear of the end only after that.
            deadline = max(u.deadline for u in writers)
            self._draining[tid] = Draining(error, {u.key for u in writers}, deadline, integrity)
        else:
            self._report_failed(tid, error, integrity)

    def _report_failed(self, tid: str, error: str, integrity: str = "") -> None:
        self._landing.synchronize()  # no landing of its pages is still queued on the device
        self._finished.append(TransferResult(tid, False, error, integrity=integrity))

    def _write_ended(self, key: tuple[bytes, int]) -> None:
        """A direct write (Begin, Go, then the sender's copy) is over: Done, Abort, or its
        sender is gone."""
        for tid, draining in list(self._draining.items()):
            draining.writers.discard(key)
            if not draining.writers:
                del self._draining[tid]
                self._report_failed(tid, draining.error, draining.integrity)

    # -- peers -------------------------------------------------------------------------------
    def _probe_peers(self) -> None:
        """Ping every sender: one that is gone is unroutable (EHOSTUNREACH), which fails its
        transfers at once instead of at their timeouts."""
        for peer in self._peers | self._arrivals.active_peers:
            self._send(peer, Ping())

    def _on_peer_lost(self, peer: bytes, why: str) -> None:
        for draining in list(self._draining.values()):
            for key in [k for k in draining.writers if k[0] == peer]:
                self._write_ended(key)
        self._peers.discard(peer)
        self._integrity.pop(peer, None)
        self._inflight = deque(e for e in self._inflight if e[0] != peer)
        for unit in self._arrivals.peer_units(peer):
            self._arrivals.drop_unit(unit)
        for tid in self._arrivals.peer_transfers(peer):
            self._end(tid, f"{why} ({peer.decode(errors='replace')})", nack=False)
        self._peer_gone(peer)

    def _fail_expect(self, tid: str, why: str) -> None:
        if tid in self._arrivals.expected:
            self._end(tid, why)
        else:
            self._finished.append(TransferResult(tid, False, why))

    def _fail_everything(self, why: str) -> None:
        """The thread ends: fail every transfer and send (results first, then senders told)."""
        now = time.monotonic()
        units: list[Unit] = []
        for tid, draining in self._draining.items():
            self._finished.append(
                TransferResult(tid, False, draining.error, integrity=draining.integrity)
            )
        self._draining.clear()
        for tid in list(self._arrivals.expected):
            units += self._arrivals.finish(tid, now)
            self._finished.append(TransferResult(tid, False, why))
        units += list(self._arrivals.units.values())
        self._arrivals.units.clear()
        self._inflight.clear()
        for unit in units:
            self._send(unit.peer, Nack(unit.transfer_id, unit.send_id, why))
        self._peers.clear()  # the router closes next

    def _publish_stats(self) -> None:
        stats = {
            "expected": len(self._arrivals.expected),
            "units": len(self._arrivals.units),
            "held_bytes": self._arrivals.held_bytes,
            "peers": len(self._peers),
            "integrity_failures": self._integrity_failures,
        }
        with self._stats_lock:
            self._stats = stats
        # Results go out only after the stats that follow them, so a caller that sees a result
        # also sees the state it left (e.g. no outstanding sends).
        self._hand_out()
