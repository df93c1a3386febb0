"""The sender's send pipeline: each send started (queued for the wire, or a direct write asked for),
its pages gathered, digested and pushed chunk by chunk or written, and a failed one aborted.
"""

from __future__ import annotations

import logging
from collections import deque

import torch
import zmq

from pdserve.engine.kv.cache import KVLayout, KVPool
from pdserve.kv_transfer import pages
from pdserve.kv_transfer.integrity import digest_buffer, digest_pages
from pdserve.kv_transfer.outgoing import Outgoing, SendFailed, SendState
from pdserve.kv_transfer.protocol import Abort, Begin, Done, Pages
from pdserve.kv_transfer.sender_peers import Peer

log = logging.getLogger(__name__)


class SendPipeline:
    """The send pipeline of `ZmqSender` (mixed into it): how chunks travel (_emit) or pages are
    written (_write) is its transports'."""

    name: str
    direct: bool
    pool: KVPool
    layout: KVLayout
    integrity: str | None
    chunk_bytes: int
    _stream: torch.cuda.Stream | None
    _peers: dict[str, Peer]
    _outgoing: dict[int, Outgoing]
    _queue: deque[Outgoing]

    def _start_or_fail(self, out: Outgoing, info: dict) -> None:
        try:
            self._start_send(out, info)
        except Exception as e:  # e.g. the Begin could not be queued: this send fails
            log.exception("%s sender: starting a send of %s failed", self.name, out.transfer_id)
            self._finish(out, f"send failed: {e}")

    def _start_send(self, out: Outgoing, info: dict) -> None:
        self._outgoing[out.send_id] = out
        peer = self._peers.get(out.peer_id)
        if peer is None:  # dropped since connect() (died, restarted?): handshake again
            self._start_connect(out.peer_id, info)
            peer = self._peers.get(out.peer_id)
            if peer is None:
                return  # the handshake failed at once and failed this send with it
        if not peer.welcomed:
            peer.waiting.append(out)  # started on the Welcome, failed if the handshake fails
        elif self.direct:
            out.state = SendState.AWAITING_GO
            begin = Begin(
                out.transfer_id,
                out.send_id,
                out.layers,
                out.dst_blocks,
                out.timeout_s,
                out.dst_heads,
            )
            self._send_to(peer, begin)
        else:
            self._queue.append(out)

    def _start_queued(self) -> None:
        """Push the queued sends, one at a time, checking the sockets between two sends."""
        if not self._queue:
            return
        out = self._queue.popleft()
        peer = self._peers.get(out.peer_id)
        if peer is None or out.send_id not in self._outgoing:
            return
        try:
            self._push(peer, out)
        except SendFailed as e:
            self._fail_send(peer, out, str(e))
        except Exception as e:  # a failed gather fails this send, not the sender
            log.exception("%s sender: push of %s failed", self.name, out.transfer_id)
            self._fail_send(peer, out, f"send failed: {e}")

    def _push(self, peer: Peer, out: Outgoing) -> None:
        n = len(out.src_blocks)
        layout = pages.sliced(self.layout, out.heads or out.dst_heads)
        chunks = list(pages.plan_chunks(layout, n, out.layers, self.chunk_bytes))
        if self._stream is None:
            src = torch.tensor(out.src_blocks, dtype=torch.int64)
        else:
            with torch.cuda.stream(self._stream):  # allocated for the stream that reads it
                src = torch.tensor(out.src_blocks, dtype=torch.int64, device=self.pool.kv.device)
            self._stream.wait_event(out.ready)
        for i, chunk in enumerate(chunks):
            self._check_peer(peer, out)
            first, last = i == 0, i == len(chunks) - 1
            header = Pages(
                out.transfer_id,
                out.send_id,
                chunk.layers,
                chunk.lo,
                chunk.hi,
                chunk.nbytes(layout),
                first,
                last,
                out.dst_blocks if first else None,
                out.layers if first else None,
                out.timeout_s,
                heads=out.dst_heads,
            )
            self._emit(peer, out, header, chunk, src[chunk.lo : chunk.hi])
        out.state = SendState.AWAITING_ACK

    def _gather(
        self,
        chunk: pages.Chunk,
        src: torch.Tensor,
        out: torch.Tensor | None = None,
        heads: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Gather one chunk of pages, only `heads` of each (on the side stream for GPU pools)."""
        if self._stream is None:
            return pages.gather(self.pool.kv, src, chunk.layers, out=out, heads=heads)
        with torch.cuda.stream(self._stream):
            return pages.gather(self.pool.kv, src, chunk.layers, out=out, heads=heads)

    def _digest(self, data: torch.Tensor) -> int | None:
        """The digest a chunk of gathered pages carries (None with integrity off)."""
        if self.integrity is None:
            return None
        if self._stream is None:
            return digest_buffer(data, self.integrity)
        with torch.cuda.stream(self._stream):
            return digest_buffer(data, self.integrity)

    def _do_write(self, peer: Peer, out: Outgoing) -> None:
        try:
            self._check_peer(peer, out)
            digest = self._write(peer, out)
            self._check_peer(peer, out)
        except SendFailed as e:
            self._fail_send(peer, out, str(e))
            return
        except Exception as e:  # a failed copy fails this send, not the sender
            log.exception("%s sender: write of %s failed", self.name, out.transfer_id)
            self._fail_send(peer, out, f"write failed: {e}")
            return
        out.state = SendState.AWAITING_ACK
        self._send_to(peer, Done(out.transfer_id, out.send_id, digest))

    def _digest_pages(self, out: Outgoing) -> int | None:
        """A direct write's digest of its whole source (None with integrity off)."""
        if self.integrity is None:
            return None
        return digest_pages(self.pool.kv, out.src_blocks, out.layers, out.heads, self.integrity)

    def _fail_send(self, peer: Peer, out: Outgoing, why: str) -> None:
        """Fail one send and tell the receiver (if it is still there) to fail the transfer."""
        if out.send_id not in self._outgoing:
            return
        self._finish(out, why)
        if self._peers.get(peer.peer_id) is peer:
            try:
                self._send_to(peer, Abort(out.transfer_id, out.send_id, why))
            except zmq.ZMQError:
                pass
