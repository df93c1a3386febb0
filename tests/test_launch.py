"""`pdserve launch` for real: a CPU cluster file on loopback (it says it serves once every node
has registered, not before; a killed worker is restarted and the end of its log shown; SIGTERM
lets running streams finish and refuses new ones), a child that keeps dying at start stops
everything, logs go to pdserve's cache folder, two hosts in network namespaces with a cluster key
set and an API key, and a file whose hosts face a network without keys is refused naming the
fix."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from waiting import wait_until

from pdserve.supervisor import cluster_serves
from pdserve.tune.local_server import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CLUSTER = """
dtype = "float32"
block_size = 8
log_dir = "{log_dir}"
{security}

[coordinator]
host = "{first}"
http_port = {http_port}
node_port = {node_port}
drain_timeout_s = 600   # longer than any test waits: a drain ends when its streams do

{hosts}
"""
HOST = """
[[host]]
name = "{name}"
address = "{address}"
{roles}
kv_port_base = {kv_port}
[host.prefill]
num_kv_blocks = 256
[host.decode]
num_kv_blocks = 256
"""

# How long a cluster's processes may take to start, or to answer, on two shared cores.
START_S = 180.0


def wait_health(url: str, status: int = 200, timeout_s: float = 180) -> None:
    """Until /health answers `status` (200: serving; 503: draining)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == status:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url}/health never answered {status}")


def children_titled(parent: int, title: str) -> list[int]:
    res = subprocess.run(
        ["pgrep", "-P", str(parent), "-f", f"^{title}"], capture_output=True, text=True
    )
    return [int(p) for p in res.stdout.split()]


def node_process(parent: int, node_id: str) -> int | None:
    """The node's process from its exec on: found by its command line until it sets its title."""
    res = subprocess.run(
        ["pgrep", "-P", str(parent), "-f", f" --node-id {node_id} |^pdserve-{node_id}$"],
        capture_output=True,
        text=True,
    )
    pids = [int(p) for p in res.stdout.split()]
    return pids[0] if len(pids) == 1 else None


def complete(url: str, max_tokens: int = 8) -> httpx.Response:
    body = {
        "model": "pdserve-tiny",
        "prompt": "Hello there",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


@pytest.fixture
def cpu_cluster(tmp_path):
    http_port, node_port, kv_port = free_port(), free_port(), free_port()
    hosts = HOST.format(
        name="local",
        address="127.0.0.1",
        kv_port=kv_port,
        roles='prefill_workers = 2\ndecode_workers = 2\ntransport = "tcp"',
    )
    path = tmp_path / "cluster.toml"
    path.write_text(
        CLUSTER.format(
            log_dir=tmp_path / "logs",
            first="local",
            http_port=http_port,
            node_port=node_port,
            hosts=hosts,
            security="",
        )
    )
    console = tmp_path / "console.txt"
    with open(console, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "launch", str(path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{http_port}"
    try:
        yield proc, url, tmp_path / "logs", console
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def metric(url: str, name: str, node: str) -> float | None:
    """The gauge's value, or None while the coordinator has no such node registered."""
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f'{name}{{node="{node}"}}'):
            return float(line.split()[-1])
    return None


def registered(url: str, node: str) -> bool:
    return metric(url, "pdserve_kv_blocks_total", node) is not None


def test_launch_says_it_serves_once_health_counts_every_node_of_the_file():
    nodes = {"prefill": 2, "decode": 2}
    health = {"status": "ok", "nodes": {"prefill": 2, "decode": 2, "colocated": 0}}
    assert cluster_serves(200, health, nodes)
    assert cluster_serves(200, {**health, "nodes": {"prefill": 3, "decode": 2}}, nodes)
    # Healthy (a request can be served) is not enough: a decode node has not registered yet.
    assert not cluster_serves(200, {**health, "nodes": {"prefill": 2, "decode": 1}}, nodes)
    assert not cluster_serves(503, health, nodes)  # draining
    assert not cluster_serves(200, {"status": "ok"}, nodes)  # says nothing of its nodes
    assert not cluster_serves(0, None, nodes)  # not answering


@pytest.mark.timeout(900)  # generous deadlines below for a loaded machine; it takes ~40 s idle
def test_cpu_cluster_file_serves_restarts_a_killed_worker_and_drains_on_sigterm(cpu_cluster):
    launch, url, logs, console = cpu_cluster

    def log(node: str) -> str:
        path = logs / f"pdserve-{node}.log"
        return path.read_text() if path.is_file() else ""

    # decode-1 is held before it can register: the cluster is healthy with the other three
    # nodes, but launch says it serves only once decode-1 has registered too.
    late = wait_until(lambda: node_process(launch.pid, "decode-1"), "decode-1 to start", 120)
    os.kill(late, signal.SIGSTOP)
    try:
        wait_health(url)
        for node in ("prefill-0", "prefill-1", "decode-0"):
            wait_until(lambda n=node: registered(url, n), f"{node} to register", START_S)
        assert not registered(url, "decode-1")
        assert "decode node decode-1 serving" not in log("decode-1")
        time.sleep(2)  # four of the supervisor's probes of /health
        assert "pdserve: serving" not in console.read_text()
    finally:
        os.kill(late, signal.SIGCONT)
    serving = f"pdserve: serving {url}\n"
    wait_until(lambda: serving in console.read_text(), "the serving line", START_S)
    assert all(registered(url, n) for n in ("prefill-0", "prefill-1", "decode-0", "decode-1"))
    assert complete(url).status_code == 200
    titles = [
        "pdserve-coordinator",
        "pdserve-prefill-0",
        "pdserve-prefill-1",
        "pdserve-decode-0",
        "pdserve-decode-1",
    ]
    for title in titles:
        assert len(children_titled(launch.pid, title)) == 1, title
        assert (logs / f"{title}.log").is_file()

    # SIGUSR1 writes a process's thread stacks to its log, and it goes on serving (decode-0
    # registered above: its handler is in place, so the signal cannot end its start).
    (dumped,) = children_titled(launch.pid, "pdserve-decode-0")
    os.kill(dumped, signal.SIGUSR1)
    wait_until(
        lambda: "most recent call first" in (logs / "pdserve-decode-0.log").read_text(),
        "decode-0's stacks",
        START_S,
    )
    assert complete(url).status_code == 200
    assert children_titled(launch.pid, "pdserve-decode-0") == [dumped]

    # A worker killed outright is restarted by the supervisor and registers again. It is up
    # (registered, its log says it serves) before it is killed: killed in its start, it would
    # never have said so, and its log would never say it twice.
    wait_until(
        lambda: registered(url, "decode-1") and "decode node decode-1 serving" in log("decode-1"),
        "decode-1 to serve",
        START_S,
    )
    (victim,) = children_titled(launch.pid, "pdserve-decode-1")
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        pids = children_titled(launch.pid, "pdserve-decode-1")
        started_again = log("decode-1").count("decode node decode-1 serving") == 2
        # Its new start's registration: the old one's lingers until its heartbeats are missed.
        again = log("coordinator").count("node decode-1 registered") == 2
        if pids and pids != [victim] and started_again and again and registered(url, "decode-1"):
            break
        time.sleep(0.3)
    if pids and pids != [victim] and not (started_again and again):
        os.kill(pids[0], signal.SIGUSR1)  # every pdserve process dumps its threads' stacks
        time.sleep(3)
    assert pids and pids != [victim] and started_again and again, (
        f"the restarted decode-1 ({pids}) never served; its log:\n{log('decode-1')[-6000:]}"
    )
    # The console showed the end of the dead worker's log.
    shown = console.read_text().split("pdserve-decode-1 died (-9)", 1)[1]
    assert "| " in shown and "decode node decode-1 serving" in shown
    responses = [complete(url) for _ in range(6)]
    assert all(r.status_code == 200 for r in responses)

    # SIGTERM with 8 streams running: all 8 finish, new requests get 503, everything exits.
    results: list[tuple[str | None, int]] = [(None, 0)] * 8
    first_tokens = threading.Barrier(9, timeout=300)

    def stream(i: int) -> None:
        # Long enough that the drain is still under way when the refused request is sent.
        body = {
            "model": "pdserve-tiny",
            "prompt": f"stream {i}",
            "max_tokens": 800,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        count, reason, waited = 0, None, False
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # the stream was cut: say why in the assertion below
                    reason = f"error: {chunk['error'].get('message')}"
                    break
                count += 1
                reason = chunk["choices"][0].get("finish_reason") or reason
                if not waited:
                    waited = True
                    first_tokens.wait()
        results[i] = (reason, count)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    first_tokens.wait()
    os.kill(launch.pid, signal.SIGTERM)
    wait_health(url, 503, timeout_s=60)  # the supervisor has passed the signal on: draining
    refused = complete(url)
    assert refused.status_code == 503 and "retry-after" in refused.headers
    for t in threads:
        t.join(600)
    assert [reason for reason, _ in results] == ["length"] * 8
    assert launch.wait(120) == 0
    assert not children_titled(launch.pid, "pdserve-")


def test_a_child_that_keeps_dying_at_start_stops_everything_with_its_log(tmp_path):
    """The coordinator's HTTP port is taken: it exits at once, every time. Launch gives up after
    three quick deaths, stops the nodes and exits non-zero with the coordinator's last lines.
    With no log_dir, the logs are in pdserve's cache folder."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        http_port = taken.getsockname()[1]
        hosts = HOST.format(
            name="local",
            address="127.0.0.1",
            kv_port=free_port(),
            roles="prefill_workers = 1\ndecode_workers = 1",
        )
        text = CLUSTER.format(
            log_dir="",
            first="local",
            http_port=http_port,
            node_port=free_port(),
            hosts=hosts,
            security="",
        )
        path = tmp_path / "doomed.toml"
        path.write_text(text.replace('log_dir = ""\n', ""))
        dry = subprocess.run(
            [sys.executable, "-m", "pdserve", "launch", str(path), "--dry-run"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        logs = Path(os.environ["PDSERVE_CACHE"]) / "logs" / "doomed"
        assert f"logs in {logs}" in dry.stdout
        res = subprocess.run(
            [sys.executable, "-m", "pdserve", "launch", str(path)],
            capture_output=True,
            text=True,
            timeout=240,
        )
    assert res.returncode == 1, res.stderr[-3000:]
    error = res.stderr[res.stderr.index("pdserve: error: ") :]
    assert "pdserve-coordinator exited (2) within 10 s of starting, 3 times in a row" in error
    assert f"cannot listen on 127.0.0.1:{http_port}" in error
    assert (logs / "pdserve-coordinator.log").read_text().count("cannot listen") == 3
    assert (logs / "pdserve-decode-0.log").is_file()
    assert not list(tmp_path.glob("**/*.log"))  # nothing beside the cluster file


def _netns_available() -> bool:
    if os.geteuid() != 0 or not Path("/usr/sbin/ip").exists() and not Path("/sbin/ip").exists():
        return False
    name = f"pdprobe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: 10.77.<n>.1 and 10.77.<n>.2."""
    if not _netns_available():
        pytest.skip("network namespaces cannot be made here (needs root and iproute2)")
    tag = os.getpid() % 200 + 20
    a, b = f"pd-a-{tag}", f"pd-b-{tag}"
    addr_a, addr_b = f"10.77.{tag}.1", f"10.77.{tag}.2"
    cmds = [
        ["ip", "netns", "add", a],
        ["ip", "netns", "add", b],
        ["ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}"],
        ["ip", "link", "set", f"va{tag}", "netns", a],
        ["ip", "link", "set", f"vb{tag}", "netns", b],
        ["ip", "-n", a, "addr", "add", f"{addr_a}/24", "dev", f"va{tag}"],
        ["ip", "-n", b, "addr", "add", f"{addr_b}/24", "dev", f"vb{tag}"],
        ["ip", "-n", a, "link", "set", f"va{tag}", "up"],
        ["ip", "-n", b, "link", "set", f"vb{tag}", "up"],
        ["ip", "-n", a, "link", "set", "lo", "up"],
        ["ip", "-n", b, "link", "set", "lo", "up"],
    ]
    try:
        for cmd in cmds:
            subprocess.run(cmd, check=True, capture_output=True)
        yield (a, addr_a), (b, addr_b)
    finally:
        subprocess.run(["ip", "netns", "del", a], capture_output=True)
        subprocess.run(["ip", "netns", "del", b], capture_output=True)


def test_two_hosts_in_network_namespaces_serve_across_the_link(tmp_path, two_hosts):
    """With a key set made by `pdserve keygen` and an API key: the decode node in namespace b
    joins the coordinator in a and takes KV pages over the link; a client needs the API key."""
    (ns_a, addr_a), (ns_b, addr_b) = two_hosts
    keygen = subprocess.run(
        [sys.executable, "-m", "pdserve", "keygen", str(tmp_path / "keys")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert keygen.returncode == 0, keygen.stderr
    http_port, node_port, kv_port = 8000, 5555, 5700  # each namespace has its own ports
    hosts = HOST.format(name="a", address=addr_a, kv_port=kv_port, roles="prefill_workers = 1")
    hosts += HOST.format(name="b", address=addr_b, kv_port=kv_port, roles="decode_workers = 1")
    path = tmp_path / "two-hosts.toml"
    text = CLUSTER.format(
        log_dir=tmp_path / "logs",
        first="a",
        http_port=http_port,
        node_port=node_port,
        hosts=hosts,
        security='cluster_keys = "keys"',
    )
    path.write_text(text.replace("[coordinator]\n", '[coordinator]\napi_key = "sesame"\n'))
    launches = [
        subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-m",
                "pdserve",
                "launch",
                str(path),
                "--host",
                host,
            ],
            start_new_session=True,
        )
        for ns, host in ((ns_a, "a"), (ns_b, "b"))
    ]
    client = (
        "import httpx, sys, time\n"
        f"url = 'http://{addr_a}:{http_port}'\n"
        "for _ in range(600):\n"
        "    try:\n"
        "        if httpx.get(url + '/health', timeout=2).status_code == 200: break\n"
        "    except httpx.HTTPError: pass\n"
        "    time.sleep(0.3)\n"
        "body = {'model': 'pdserve-tiny', 'prompt': 'across the link', 'max_tokens': 8,"
        " 'temperature': 0, 'ignore_eos': True}\n"
        "r = httpx.post(url + '/v1/completions', timeout=60, json=body)\n"
        "print(r.status_code)\n"
        "r = httpx.post(url + '/v1/completions', timeout=60, json=body,"
        " headers={'Authorization': 'Bearer sesame'})\n"
        "print(r.status_code, r.json()['usage']['completion_tokens'])\n"
    )
    try:
        res = subprocess.run(
            ["ip", "netns", "exec", ns_a, sys.executable, "-c", client],
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert res.stdout.split() == ["401", "200", "8"], res.stderr[-2000:]
        # The decode node lives only in namespace b: the KV pages crossed the veth link.
        log_b = (tmp_path / "logs" / "pdserve-decode-0.log").read_text()
        assert "decode node decode-0 serving (transport tcp)" in log_b
        # launch gave every process the file's key set: nobody was refused on the way.
        log_a = (tmp_path / "logs" / "pdserve-coordinator.log").read_text()
        assert f"cluster keys {tmp_path / 'keys'}" in log_a  # the file's set, not a default one
        assert "dropped a connection" not in log_a and "refuses this node" not in log_b
    finally:
        for proc in launches:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in launches:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_hosts_off_loopback_without_keys_are_refused_naming_the_fix(tmp_path):
    """No namespaces needed: launch refuses before it starts anything (a dry run too), and
    `insecure = true` is the written way around it."""
    hosts = HOST.format(name="a", address="10.77.0.1", kv_port=5700, roles="prefill_workers = 1")
    hosts += HOST.format(name="b", address="10.77.0.2", kv_port=5700, roles="decode_workers = 1")
    path = tmp_path / "far.toml"

    def launch(security: str) -> subprocess.CompletedProcess:
        path.write_text(
            CLUSTER.format(
                log_dir=tmp_path / "logs",
                first="a",
                http_port=8000,
                node_port=5555,
                hosts=hosts,
                security=security,
            )
        )
        return subprocess.run(
            [sys.executable, "-m", "pdserve", "launch", str(path), "--host", "b", "--dry-run"],
            capture_output=True,
            text=True,
            timeout=60,
        )

    refused = launch("")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    error = refused.stderr
    assert error.startswith("pdserve: error: ") and "10.77.0.1" in error
    for fix in ("pdserve keygen DIR", 'cluster_keys = "DIR"', "insecure = true"):
        assert fix in error, fix
    insecure = launch("insecure = true")
    assert insecure.returncode == 0, insecure.stderr
    assert "--insecure" in insecure.stdout and "--cluster-keys" not in insecure.stdout
    keyed = launch(f'cluster_keys = "{tmp_path / "keys"}"')
    assert keyed.returncode == 0 and f"--cluster-keys {tmp_path / 'keys'}" in keyed.stdout
    # A real start checks the key set first: here there is none.
    path.write_text(path.read_text())
    res = subprocess.run(
        [sys.executable, "-m", "pdserve", "launch", str(path), "--host", "b"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "no cluster keys in" in res.stderr
    assert not (tmp_path / "logs").exists()  # nothing was started
