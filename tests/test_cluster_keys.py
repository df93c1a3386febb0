"""The cluster key set for real: `pdserve keygen` writes a private key set and refuses to
overwrite one; a keyed socket lets in only holders of the keys (a stranger with a key pair of its
own, or without CurveZMQ at all, gets nothing through, and each address is logged once however
often it tries); a context whose ZAP handler is gone refuses everyone rather than admitting
anyone; `pdserve prefill` processes without the keys never join a keyed `pdserve serve` nor
receive a request, while one with them serves; strangers at a keyed KV port change no block, and
keyed transfers (encrypted, or authenticated only) land exact to the bit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import zmq
import zmq.asyncio
from serve_process import ServeProcess
from waiting import wait_until

from pdserve.cluster import keys as cluster_keys
from pdserve.cluster.keys import (
    ClusterKeys,
    close_server,
    curve_client,
    curve_server,
    default_key_dir,
)
from pdserve.cluster.node_messages import NodeRole, Register, reports
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.coordinator import Coordinator
from pdserve.engine.embedded.tiny import ensure_tiny_model
from pdserve.tune.local_server import free_port

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent


def pdserve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def test_keygen_writes_a_private_key_set_and_a_readable_secret_is_refused(tmp_path):
    made = pdserve("keygen", str(tmp_path / "keys"))
    assert made.returncode == 0, made.stderr
    secret = tmp_path / "keys" / "cluster.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    keys = ClusterKeys.load(tmp_path / "keys")
    assert keys.secret.decode() not in repr(keys)  # never in a log line
    # zmq's own certificate reader takes the files too.
    assert zmq.auth.load_certificate(tmp_path / "keys" / "cluster.key")[0] == keys.public
    again = pdserve("keygen", str(tmp_path / "keys"))
    assert again.returncode == 2 and "already holds a cluster key set" in again.stderr
    assert ClusterKeys.load(tmp_path / "keys") == keys  # untouched
    secret.chmod(0o644)
    node = pdserve(
        "prefill",
        "--coordinator",
        "tcp://127.0.0.1:1",
        "--node-id",
        "p",
        "--cluster-keys",
        str(tmp_path / "keys"),
    )
    assert node.returncode == 2 and node.stderr.count("\n") == 1, node.stderr
    assert f"chmod 600 {secret}" in node.stderr
    missing = pdserve(
        "decode",
        "--coordinator",
        "tcp://127.0.0.1:1",
        "--node-id",
        "d",
        "--cluster-keys",
        str(tmp_path / "none"),
    )
    assert missing.returncode == 2 and "no cluster keys in" in missing.stderr
    assert "pdserve keygen DIR" in missing.stderr


def test_two_processes_making_the_default_key_set_at_once_end_up_with_one(tmp_path):
    code = "from pdserve.cluster.keys import ClusterKeys; import sys\n"
    code += "print(ClusterKeys.load_or_create(sys.argv[1]).public.decode())"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / "k")],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    publics = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert publics == {ClusterKeys.load(tmp_path / "k").public.decode()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k"]  # no staging left behind


def _denials(ctx: zmq.Context) -> int:
    gate = cluster_keys._gates.get(ctx.underlying)
    return 0 if gate is None else sum(log.total for log in gate.denied.values())


def test_a_keyed_coordinator_admits_only_key_holders_and_logs_each_address_once(caplog):
    keys = ClusterKeys.generate()

    def refused_before_zap() -> list[str]:
        return [
            r.getMessage() for r in caplog.records if "without the cluster keys" in r.getMessage()
        ]

    async def run() -> tuple[set[str], int]:
        coordinator = Coordinator(CoordinatorConfig(heartbeat_timeout_s=30), keys=keys)
        await coordinator.start()
        ctx = zmq.asyncio.Context.instance()
        socks = []

        def dealer(identity: bytes, own: ClusterKeys | None) -> zmq.asyncio.Socket:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, identity)
            sock.setsockopt(zmq.LINGER, 0)
            if own is not None:
                curve_client(sock, own)
                sock.curve_serverkey = keys.public  # it knows whom to call, not the secret
            sock.connect(coordinator.node_endpoint)
            socks.append(sock)
            return sock

        try:
            # Three strangers with key pairs of their own, one without CurveZMQ: each registers.
            for i in range(3):
                stranger = dealer(f"stranger-{i}".encode(), ClusterKeys.generate())
                await stranger.send(
                    reports.encode(
                        Register(f"stranger-{i}", NodeRole.COLOCATED, "m", 4, 64, 1024, "none")
                    )
                )
            plain = dealer(b"plain", None)
            await plain.send(
                reports.encode(Register("plain", NodeRole.COLOCATED, "m", 4, 64, 1024, "none"))
            )
            member = dealer(b"member", keys)
            await member.send(
                reports.encode(Register("member", NodeRole.COLOCATED, "m", 4, 64, 1024, "none"))
            )
            await coordinator.wait_for_nodes(0, 1, timeout_s=30)
            deadline = time.monotonic() + 30
            # Every stranger was turned away by the ZAP handler, and the one without CurveZMQ
            # before it (logged without an address: libzmq names none).
            while _denials(ctx) < 3 or not refused_before_zap():
                assert time.monotonic() < deadline, "the strangers' handshakes were never denied"
                await asyncio.sleep(0.02)
            return set(coordinator.nodes.nodes), _denials(ctx)
        finally:
            for sock in socks:
                sock.close(0)
            await coordinator.stop(shutdown_nodes=False)

    with caplog.at_level(logging.WARNING, logger="pdserve.cluster.keys"):
        registered, denials = asyncio.run(run())
    assert registered == {"member"}
    assert denials >= 3
    lines = [r.getMessage() for r in caplog.records if "dropped a connection" in r.getMessage()]
    by_address = [x for x in lines if "127.0.0.1" in x]
    assert len(by_address) == 1 and "node socket" in by_address[0], lines
    assert len(lines) == 2 and len(refused_before_zap()) == 1, lines
    assert not cluster_keys._gates  # the coordinator's stop ended its ZAP handler


def test_a_keyed_socket_whose_zap_handler_is_gone_refuses_everyone():
    """libzmq admits any CURVE client where no ZAP handler answers; ZAP_ENFORCE_DOMAIN turns that
    into a refusal, so losing the handler can only lock members out, never let strangers in."""
    keys = ClusterKeys.generate()
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    curve_server(server, keys, "test socket")
    port = server.bind_to_random_port("tcp://127.0.0.1")

    def gets_through(own: ClusterKeys) -> bool:
        client = ctx.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        curve_client(client, own)
        client.curve_serverkey = keys.public
        # Watched from before it connects: a refusal that came first would never be seen.
        monitor = client.get_monitor_socket(cluster_keys.HANDSHAKE_FAILED)
        client.connect(f"tcp://127.0.0.1:{port}")
        client.send(b"hello")
        try:
            # Either the message arrives or the handshake is refused: wait for one of them.
            poller = zmq.Poller()
            poller.register(server, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            events = dict(poller.poll(20_000))
            assert events, "neither admitted nor refused"
            if server in events:
                server.recv_multipart()
                return True
            return False
        finally:
            client.disable_monitor()
            monitor.close(0)
            client.close(0)

    try:
        assert gets_through(keys) and not gets_through(ClusterKeys.generate())
        cluster_keys._gates.pop(ctx.underlying).stop()  # the handler dies
        assert not gets_through(ClusterKeys.generate())
        assert not gets_through(keys)
    finally:
        close_server(server)
        ctx.destroy(0)


@pytest.mark.timeout(600)
def test_nodes_without_the_cluster_keys_never_join_while_one_with_them_serves(tmp_path):
    """`pdserve serve` with a decode node and no prefill node is up but not healthy (it prefills
    locally meanwhile). Two prefill nodes without its keys (a key set of their own; none at all)
    are refused at the handshake: /health stays 503, /metrics never names them, and no request
    reaches them (their debug logs name every order a node receives). A prefill node with the
    keys joins and serves."""
    ensure_tiny_model()
    assert pdserve("keygen", str(tmp_path / "other")).returncode == 0
    node_port = free_port()
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    procs: dict[str, subprocess.Popen] = {}  # the prefill nodes

    def start(name: str, *args: str) -> None:
        with open(log_dir / f"{name}.log", "w") as out:
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "pdserve", *args],
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log(name: str) -> str:
        return (log_dir / f"{name}.log").read_text()

    def prefill(node_id: str, *security: str) -> None:
        start(
            node_id,
            "--log-level",
            "DEBUG",
            "prefill",
            "--coordinator",
            f"tcp://127.0.0.1:{node_port}",
            "--node-id",
            node_id,
            "--num-kv-blocks",
            "64",
            "--block-size",
            "8",
            *security,
        )

    def metrics() -> str:
        return httpx.get(f"{url}/metrics", timeout=10).text

    args = ["--node-port", str(node_port), "--prefill-nodes", "0", "--decode-nodes", "1"]
    serve = ServeProcess(
        [*args, "--num-kv-blocks", "64", "--block-size", "8"], log_dir / "serve.log"
    )
    url = serve.url
    try:
        serve.wait_serving()
        prefill("stranger", "--cluster-keys", str(tmp_path / "other"))
        prefill("keyless", "--insecure")
        for name in ("stranger", "keyless"):
            try:
                wait_until(
                    lambda n=name: "refuses this node's handshake" in log(n),
                    f"{name} to be refused",
                    240,
                )
            except AssertionError as exc:  # what the node was doing meanwhile
                procs[name].send_signal(signal.SIGUSR1)
                time.sleep(3)
                raise AssertionError(f"{exc}; its log:\n{log(name)[-6000:]}") from exc
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        assert "stranger" not in metrics() and "keyless" not in metrics()
        body = {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
        for _ in range(3):  # prefilled on the decode node: the strangers are no prefill nodes
            done = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4

        prefill("member", "--cluster-keys", str(default_key_dir()))
        wait_until(
            lambda: httpx.get(f"{url}/health", timeout=10).status_code == 200,
            "the keyed prefill node to join",
            240,
        )
        done = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
        assert "] received prefill" in log("member")  # the debug line the strangers never wrote
        text = metrics()
        assert 'pdserve_node_up{node="member",role="prefill"} 1.0' in text
        assert "stranger" not in text and "keyless" not in text
        assert "] received " not in log("stranger") + log("keyless")
        assert all(procs[n].poll() is None for n in ("stranger", "keyless"))  # still trying
        # Each stranger says why once, however often ZeroMQ retried its handshake meanwhile.
        assert all(
            log(n).count("refuses this node's handshake") == 1 for n in ("stranger", "keyless")
        )
        refused = [x for x in log("serve").splitlines() if "dropped a connection" in x]
        assert len(refused) == 1 and "without the cluster keys" in refused[0], refused
        assert " registered " not in "".join(
            x for x in log("serve").splitlines(True) if "stranger" in x or "keyless" in x
        )
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        serve.stop(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


# --- keyed KV receivers ------------------------------------------------------------------------

# How a decode node's KV receiver admits senders: CurveZMQ (the default), or kv_encryption = false
# (a password only keyed senders learn from the coordinator; pages in clear).
KV_MODES = [("tcp", True), ("tcp", False), ("shm", True)]
KV_IDS = ["tcp-curve", "tcp-authenticated-only", "shm-curve"]


def _refused(sock: zmq.Socket, monitor: zmq.Socket, timeout_s: float = 20.0) -> None:
    """Wait for the handshake failure of a socket: proof that what it queued never went in."""
    assert monitor.poll(int(timeout_s * 1000)), "the receiver never refused the handshake"
    event = zmq.utils.monitor.recv_monitor_message(monitor)
    assert event["event"] & cluster_keys.HANDSHAKE_FAILED, event


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("transport", "encrypt"), KV_MODES, ids=KV_IDS)
def test_raw_sockets_at_a_keyed_kv_port_change_no_block_and_keyed_senders_land_exact(
    transport: str, encrypt: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Strangers at a keyed receiver's port (no CurveZMQ; a key pair of their own with the
    cluster's public key; for the password mode a wrong password) send every kind of frame, real
    Pages for announced blocks among them: their handshakes are refused, no block changes, the
    receiver holds nothing for them, and each address that reached the ZAP handler is logged
    once. A sender with the cluster keys then lands its pages exactly."""
    from test_kv_malformed_input import junk_for_a_receiver
    from test_kv_transfer import CHUNK, NUM_BLOCKS, blocks_bits, layout, random_pool, wait_result

    from pdserve.kv_transfer import KVSend, make_receiver, make_sender
    from pdserve.kv_transfer.pages import page_bytes
    from pdserve.kv_transfer.protocol import Hello, Pages, control

    caplog.set_level(logging.WARNING)
    keys, lay = ClusterKeys.generate(), layout()
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []
    with make_receiver(transport, lay, NUM_BLOCKS, keys=keys, encrypt=encrypt) as receiver:
        info = receiver.info()
        assert info["security"] == ("curve" if encrypt else "plain")
        receiver.expect("t-target", [2, 14, 6], timeout_s=60.0)  # what a stranger aims at
        everything, others = (
            list(range(NUM_BLOCKS)),
            [b for b in range(NUM_BLOCKS) if b not in (2, 14, 6)],
        )
        before, before_others = (
            blocks_bits(receiver.pool.kv, everything),
            blocks_bits(receiver.pool.kv, others),
        )
        page = page_bytes(lay)
        frames = [
            *junk_for_a_receiver(lay),
            [control.encode(Hello("stranger", transport, lay, "host", 1))],
            [
                control.encode(Pages("t-target", 1, (0, 4), 0, 1, page, True, True, [2], (0, 1))),
                b"\xff" * page,
            ],
        ]

        def stranger(secure: str) -> None:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if secure == "own-keys":
                curve_client(sock, ClusterKeys.generate())
                sock.curve_serverkey = keys.public  # the public key is no secret
            elif secure == "wrong-password":
                sock.plain_username, sock.plain_password = b"pdserve", b"guessed"
            monitor = sock.get_monitor_socket(cluster_keys.HANDSHAKE_FAILED)
            sock.connect(info["address"])
            for f in frames:  # (once the handshake failed there is no pipe left to queue on)
                with contextlib.suppress(zmq.Again):
                    sock.send_multipart(f, zmq.NOBLOCK)
            try:
                _refused(sock, monitor)
            finally:
                sock.disable_monitor()
                monitor.close(0)
            socks.append(sock)

        try:
            strangers = ["none", "own-keys" if encrypt else "wrong-password"]
            for secure in strangers * 2:  # twice: the second time is not logged again
                stranger(secure)
            assert blocks_bits(receiver.pool.kv, everything) == before
            assert receiver.stats() == {
                "expected": 1,
                "units": 0,
                "held_bytes": 0,
                "peers": 0,
                "integrity_failures": 0,
            }
            # An unkeyed sender is refused before it dials, one with other keys at the handshake.
            with make_sender(transport, random_pool(lay, seed=41), chunk_bytes=CHUNK) as sender:
                with pytest.raises(ValueError, match="only holders of the cluster keys"):
                    sender.connect("decode-0", info)
            if encrypt:  # (with kv_encryption off, the password in the info is the credential)
                other = make_sender(
                    transport,
                    random_pool(lay, seed=42),
                    chunk_bytes=CHUNK,
                    keys=ClusterKeys.generate(),
                )
                with other:
                    other.connect("decode-0", info)
                    other.send(
                        KVSend("t-target", "decode-0", [0, 1, 3], [2, 14, 6], timeout_s=30.0)
                    )
                    result = wait_result(other, "t-target", 30.0)
                    assert not result.ok and "refused the handshake" in result.error, result
                assert blocks_bits(receiver.pool.kv, everything) == before

            pool = random_pool(lay, seed=43)
            with make_sender(transport, pool, chunk_bytes=CHUNK, keys=keys) as sender:
                sender.connect("decode-0", info)
                sender.send(KVSend("t-target", "decode-0", [5, 0, 17], [2, 14, 6]))
                assert wait_result(sender, "t-target", 30.0).ok
                assert wait_result(receiver, "t-target", 30.0).ok
            assert blocks_bits(receiver.pool.kv, [2, 14, 6]) == blocks_bits(pool.kv, [5, 0, 17])
            assert blocks_bits(receiver.pool.kv, others) == before_others
            assert receiver.failed is None
        finally:
            for sock in socks:
                sock.close(0)
            ctx.term()
    denied = [r.getMessage() for r in caplog.records if "dropped a connection" in r.getMessage()]
    assert len(denied) == 1 and "KV receiver" in denied[0], denied


@pytest.mark.timeout(120)
@pytest.mark.parametrize("encrypt", [True, False], ids=["curve", "authenticated-only"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_keyed_tcp_transfers_between_processes_land_bit_exact(dtype: str, encrypt: bool) -> None:
    """A keyed receiver in another process takes pages cut in many chunks, from scattered source
    blocks, exactly to the bit (NaN payloads too), and touches no other block."""
    from test_kv_transfer import CHUNK, NUM_BLOCKS, blocks_bits, layout, random_pool, wait_result

    from pdserve.kv_transfer import KVSend, make_sender
    from pdserve.tune.remote_endpoint import RemoteEndpoint

    keys, lay = ClusterKeys.generate(), layout(dtype)
    remote = RemoteEndpoint("receiver", "tcp", lay, NUM_BLOCKS, keys=keys, encrypt=encrypt)
    try:
        assert remote.info["security"] == ("curve" if encrypt else "plain")
        src, dst = [5, 0, 17, 9, 3, 22], [2, 14, 6, 23, 10, 1]
        others = [b for b in range(NUM_BLOCKS) if b not in dst]
        before = remote.read_blocks(others)
        pool = random_pool(lay, seed=51)
        with make_sender("tcp", pool, chunk_bytes=CHUNK, keys=keys) as sender:
            sender.connect("decode-0", remote.info)
            remote.expect("t-keyed", dst, timeout_s=30.0)
            sender.send(KVSend("t-keyed", "decode-0", src, dst))
            assert wait_result(sender, "t-keyed", 30.0).ok
            assert remote.wait("t-keyed", 30.0).ok
        assert remote.read_blocks(dst) == blocks_bits(pool.kv, src)
        assert remote.read_blocks(others) == before
    finally:
        remote.close()
