"""Every wait on another process has a bound (docs/deployment.md, "Every wait has a bound"): the
waits that had none are shown to end, at their bound, with an error that says what was waited
for. Each test gives its bound a fraction of a second; without the bound it would hang (a
pytest-timeout of a few seconds turns that into a failure)."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import zmq

from pdserve.cluster.node_link import CoordinatorUnreachable, NodeLink
from pdserve.cluster.node_messages import Tokens, reports
from pdserve.cluster.sampling_params import SamplingParams
from pdserve.coordinator.client import CoordinatorClient
from pdserve.coordinator.coordinator import SubmitError


def silent_router() -> tuple[zmq.Socket, str]:
    """A bound ROUTER that never answers: a coordinator that is there but says nothing."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"tcp://127.0.0.1:{port}"


def unused_address() -> str:
    """A port nothing listens on (bound, then released): a coordinator that is gone."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.close(0)
    return f"tcp://127.0.0.1:{port}"


@pytest.mark.timeout(10)
def test_a_node_whose_coordinator_takes_no_reports_stops_at_its_send_timeout():
    link = NodeLink(unused_address(), "decode-0", heartbeat_interval_s=1.0, send_timeout_s=0.2)
    try:
        t0 = time.monotonic()
        with pytest.raises(
            CoordinatorUnreachable, match="none of node decode-0's reports for 0.2s"
        ):
            for _ in range(5000):  # the queue holds 1000: then a report waits for room
                link.send(Tokens("decode-0", []))
        assert time.monotonic() - t0 < 5
    finally:
        link.close()


def test_a_client_whose_coordinator_never_answers_times_out_and_cancels():
    router, address = silent_router()

    async def run() -> None:
        async with CoordinatorClient(address, keys=None, timeout_s=0.3) as client:
            with pytest.raises(SubmitError, match="no answer from the coordinator") as refused:
                await client.complete([1, 2, 3], SamplingParams(max_tokens=4))
            assert refused.value.code == "timeout"

    try:
        asyncio.run(asyncio.wait_for(run(), 10))  # (unbounded, this would time out here)
        types = []
        while router.poll(500):
            _, frame = router.recv_multipart()
            types.append(type(_client_request(frame)).__name__)
        assert types == ["Submit", "Cancel"]  # what the coordinator may still hold is freed
    finally:
        router.close(0)


def _client_request(frame: bytes):  # noqa: ANN202
    from pdserve.cluster.client_messages import client_requests

    return client_requests.decode(frame)


@pytest.mark.timeout(10)
def test_rank_0_stops_waiting_for_a_rank_that_never_joins_its_group():
    from pdserve.engine.tp.group import TPGroup, host_store
    from pdserve.engine.tp.shard import TPShard

    store = host_store(2)  # rank 1 never comes (alive but stuck on its way, say)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks \[1\] did not join their group within 0.3s"):
        TPGroup.join(TPShard(0, 2), "cpu", store=store, timeout_s=0.3)
    assert time.monotonic() - t0 < 5


def test_serve_says_which_nodes_did_not_register_in_time(monkeypatch, tmp_path):
    import pdserve.serve as serve
    from pdserve.launch import NodeSpec

    # Nodes that start and never register (a model that takes forever to load).
    monkeypatch.setattr(
        NodeSpec, "command", lambda self: [sys.executable, "-c", "import time; time.sleep(30)"]
    )
    monkeypatch.setattr(serve, "NODE_START_TIMEOUT_S", 0.5)
    options = serve.ServeOptions(port=0, node_port=0, insecure=True, log_dir=str(tmp_path))
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="within 0.5s: 0 of 1 prefill, 0 of 1 decode") as failed:
        asyncio.run(asyncio.wait_for(serve.serve_async(options), 20))
    assert str(tmp_path) in str(failed.value)  # where to look
    assert time.monotonic() - t0 < 15  # the nodes were stopped too


def test_a_report_that_fits_the_queue_is_sent_at_once():
    router, address = silent_router()
    link = NodeLink(address, "decode-0", heartbeat_interval_s=1.0, send_timeout_s=0.2)
    try:
        link.send(Tokens("decode-0", []))
        assert router.poll(5000)
        identity, header, frame = router.recv_multipart()  # in the link's session
        assert identity == b"decode-0" and isinstance(reports.decode(frame), Tokens)
    finally:
        link.close()
        router.close(0)


def test_the_docs_table_of_bounds_cites_the_constants_as_they_are():
    from pathlib import Path

    from pdserve.cluster import link_session, node_link
    from pdserve.coordinator import client
    from pdserve.coordinator.config import CoordinatorConfig
    from pdserve.engine.tp import group as tp_group
    from pdserve.kv_transfer import channel, sharded
    from pdserve.serve import NODE_START_TIMEOUT_S

    doc = (Path(__file__).resolve().parent.parent / "docs" / "deployment.md").read_text()
    table = doc.split("### Every wait has a bound")[1].split("\n## ")[0]
    config = CoordinatorConfig()
    cited = {
        f"`request_timeout_s` ({config.request_timeout_s:g} s": "request_timeout_s",
        f"`transfer_timeout_s` ({config.transfer_timeout_s:g} s)": "transfer_timeout_s",
        f"`kv_streaming_timeout_s` ({config.kv_streaming_timeout_s:g} s)": "kv_streaming",
        f"`heartbeat_timeout_s` ({config.heartbeat_timeout_s:g} s)": "heartbeat_timeout_s",
        f"{node_link.SEND_TIMEOUT_S:g} s (`SEND_TIMEOUT_S`": "SEND_TIMEOUT_S",
        f"{client.REQUEST_TIMEOUT_S:g} s by default (`REQUEST_TIMEOUT_S`": "REQUEST_TIMEOUT_S",
        f"{NODE_START_TIMEOUT_S:g} s (`NODE_START_TIMEOUT_S`": "NODE_START_TIMEOUT_S",
        f"{tp_group.COLLECTIVE_TIMEOUT_S:g} s (`COLLECTIVE_TIMEOUT_S`": "COLLECTIVE_TIMEOUT_S",
        f"{sharded.RANK_START_TIMEOUT_S:g} s (`RANK_START_TIMEOUT_S`": "RANK_START_TIMEOUT_S",
        f"{channel.HEARTBEAT_TIMEOUT_MS / 1000:g} s of ZeroMQ heartbeats": "HEARTBEAT_TIMEOUT_MS",
        f"`node_wait_s` ({config.node_wait_s:g} s, live)": "node_wait_s",
        f"every {link_session.RESEND_AFTER_S:g} s (`RESEND_AFTER_S`": "RESEND_AFTER_S",
    }
    missing = [name for text, name in cited.items() if text not in table]
    assert not missing, f"docs/deployment.md's bounds table is out of date for {missing}"
