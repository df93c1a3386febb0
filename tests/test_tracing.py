"""OpenTelemetry traces: spans reach a real OTLP collector (HTTP or gRPC, tests/otlp_receiver.py)
as children of the traceparent they were given; a request served by `pdserve serve
--otlp-traces-endpoint` is one trace across the coordinator and both nodes, each node's spans
children of the coordinator span that sent its order, carrying the prefill's chunks and the KV
transfer's bytes, transport and digest check; and with no endpoint nothing of OpenTelemetry's
SDK is loaded."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
pytest.importorskip("opentelemetry.proto", reason="the otel extra is not installed")

import httpx  # noqa: E402
from otlp_receiver import ReceivedSpan, grpc_collector, http_collector  # noqa: E402
from serve_process import ServeProcess  # noqa: E402

from pdserve.cli import build_parser  # noqa: E402
from pdserve.cluster import tracing  # noqa: E402
from pdserve.cluster_file import load_cluster_file, plan  # noqa: E402
from pdserve.engine.embedded.tiny import ensure_tiny_model  # noqa: E402
from pdserve.kv_transfer.faults import ENV as FAULTS  # noqa: E402

pytestmark = pytest.mark.cluster
PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"  # W3C's example


# --- the setup and the exporter -------------------------------------------------------------------


def test_the_protocol_is_the_environments_else_the_endpoints():
    assert tracing.protocol_for("http://c:4318/v1/traces", {}) == "http/protobuf"
    assert tracing.protocol_for("http://c:4317", {}) == "grpc"  # vLLM's default
    assert tracing.protocol_for("c:4317", {}) == "grpc"
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    assert tracing.protocol_for("http://c:4318", env) == "http/protobuf"
    env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "grpc"  # the traces' own variable first
    assert tracing.protocol_for("http://c:4318/v1/traces", env) == "grpc"
    with pytest.raises(ValueError, match="http/json"):
        tracing.protocol_for("http://c:4318", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    assert tracing.http_traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert tracing.http_traces_url("http://c:4318/otlp/v1/traces") == "http://c:4318/otlp/v1/traces"


def test_node_spans_reach_an_http_collector_as_children_of_the_order_s_traceparent(monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "traced-by-env")  # the SDK's variable wins
    with http_collector() as (collector, endpoint):
        assert tracing.setup(endpoint, "pdserve-prefill", node_id="prefill-7")
        try:
            spans = tracing.RequestSpans()
            spans.start("r#0", "prefill", PARENT, {"pdserve.prompt_tokens": 70})
            spans.start("r#0", "queue", None, within="prefill")
            spans.end("r#0", "queue")
            for _ in range(3):
                spans.count("r#0", "prefill", "pdserve.prefill.chunks")
            spans.end("r#0", "prefill")
            spans.start("r#0", "kv_send", PARENT)
            spans.end_all("r#0", "aborted")
            spans.start("r#1", "prefill", "")  # an order without a trace context: untraced
            spans.end("r#1", "prefill")
            tracing.flush()
        finally:
            tracing.shutdown()
        assert not tracing.enabled()
        got = collector.wait_for("three spans", lambda s: len(s) >= 3)
    by_name = {s.name: s for s in got}
    assert sorted(by_name) == ["kv_send", "prefill", "queue"]
    prefill, queue, send = by_name["prefill"], by_name["queue"], by_name["kv_send"]
    assert prefill.trace_id == queue.trace_id == "0af7651916cd43dd8448eb211c80319c"
    assert prefill.parent_id == "b7ad6b7169203331" and queue.parent_id == prefill.span_id
    assert prefill.attributes == {"pdserve.prompt_tokens": 70, "pdserve.prefill.chunks": 3}
    assert send.error and not prefill.error
    assert prefill.service == "traced-by-env"
    assert prefill.resource["pdserve.node_id"] == "prefill-7"


def test_a_grpc_collector_takes_an_endpoint_without_a_traces_path():
    with grpc_collector() as (collector, endpoint):
        assert tracing.protocol_for(endpoint, {}) == "grpc"
        tracing.setup(endpoint, "pdserve-decode")
        try:
            span = tracing.start_span("decode", PARENT)
            assert tracing.traceparent(span).startswith("00-0af7651916cd43dd8448eb211c80319c-")
            tracing.end_span(span, attributes={"pdserve.completion_tokens": 4})
            tracing.flush()
        finally:
            tracing.shutdown()
        (got,) = collector.wait_for("the decode span", lambda s: len(s) >= 1)
    assert (got.name, got.service, got.parent_id) == (
        "decode",
        "pdserve-decode",
        "b7ad6b7169203331",
    )
    assert got.attributes == {"pdserve.completion_tokens": 4}


def test_a_tensor_parallel_transfer_s_digest_check_is_its_ranks_worst():
    from pdserve.kv_transfer.sharded import merged

    assert merged({"ok"}) == "ok"
    assert merged({"ok", "off"}) == "off"  # a rank whose sender sent no digests
    assert merged({"ok", "failed", "off"}) == "failed"
    assert merged({"ok", ""}) == ""  # a rank's part failed otherwise: nothing to say


def test_without_an_endpoint_no_opentelemetry_sdk_is_loaded():
    # FastAPI imports OpenTelemetry's API itself (recent releases do), so the serving modules
    # are checked for what they add to it; the nodes' modules, without FastAPI, for nothing.
    code = textwrap.dedent(
        """
        import json, sys
        def loaded():
            return {m for m in sys.modules if m.split(".")[0] == "opentelemetry"}
        import pdserve.prefill_node.worker, pdserve.decode_node.worker, pdserve.cluster.tracing
        nodes = loaded()
        import fastapi
        before = loaded()
        import pdserve.serve, pdserve.coordinator.api_server
        from pdserve.coordinator.coordinator import Coordinator
        from pdserve.cluster import tracing
        assert not tracing.setup(None, "pdserve-coordinator") and not tracing.enabled()
        assert Coordinator().tracer is None
        assert tracing.start_span("request") is None and tracing.traceparent(None) == ""
        spans = tracing.RequestSpans()
        spans.start("r#0", "prefill", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
        assert not spans.is_open("r#0", "prefill")
        print(json.dumps({"nodes": sorted(nodes), "serving": sorted(loaded() - before)}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout.splitlines()[-1]) == {"nodes": [], "serving": []}


# --- the coordinator's spans ---------------------------------------------------------------------


def span_of(traceparent: str) -> str:
    return traceparent.split("-")[2]


def test_a_retried_handoff_is_an_error_span_and_each_order_hangs_from_its_phase():
    from test_coordinator_core import cluster

    from pdserve.cluster.node_messages import (
        Admit,
        Admitted,
        FinishReason,
        FirstToken,
        Prefill,
        SendKV,
        TransferDone,
    )
    from pdserve.coordinator.request_tracing import RequestTracer

    with http_collector() as (collector, endpoint):
        tracing.setup(endpoint, "pdserve-coordinator")
        try:
            sim, tracer = cluster(), RequestTracer()
            sim.core.listeners.append(tracer)
            stamped: list = []

            def sent(kind: type) -> object:
                tracer.stamp(sim.orders)  # as the coordinator's shell does to every outbox
                (order,) = sim.sent(kind)
                stamped.append(order)
                return order

            sim.submit(max_tokens=4)
            prefill = sent(Prefill)
            sim.report("p0", FirstToken(prefill.request_id, 99, None, 0, num_blocks=4))
            admit = sent(Admit)
            sim.report("d0", Admitted(admit.request_id, True, [1, 2, 3, 4]))
            sent(SendKV)
            failure = "KV integrity check failed: pages of r#0 landed with xxh3_64 0x1"
            sim.report("d0", TransferDone(admit.request_id, False, failure))
            retry = sent(Prefill)
            sim.report("p0", FirstToken(retry.request_id, 7, FinishReason.LENGTH, 0, 0))
            assert sim.events[-1].finish_reason == "length" and not tracer.traces
            tracing.flush()
        finally:
            tracing.shutdown()
        spans = collector.wait_for(
            "the request span", lambda s: any(x.name == "request" for x in s)
        )
    (request,) = [s for s in spans if s.name == "request"]
    assert request.attributes["pdserve.attempts"] == 2 and not request.error
    assert request.events == ("first_token", "retry")
    phases = [s for s in spans if s.parent_id == request.span_id and s.name != "routing"]
    by_attempt = [(s.name, s.attributes["pdserve.attempt"], s.error) for s in phases]
    assert sorted(by_attempt) == sorted(
        [
            ("prefill", 0, False),
            ("queue", 0, False),
            ("admission", 0, False),
            ("kv_transfer", 0, True),  # ended by the failed handoff
            ("prefill", 1, False),
        ]
    )
    routes = [s for s in spans if s.name == "routing"]
    assert sorted(s.attributes["pdserve.attempt"] for s in routes) == [0, 1]
    # Each order carries the traceparent of the phase span it was sent in.
    ids = {(s.name, s.attributes["pdserve.attempt"]): s.span_id for s in phases}
    assert [span_of(o.trace_context) for o in stamped] == [
        ids[("prefill", 0)],
        ids[("admission", 0)],
        ids[("kv_transfer", 0)],
        ids[("prefill", 1)],
    ]


# --- the flag reaches every process --------------------------------------------------------------


def test_the_endpoint_is_a_flag_of_every_command_and_a_cluster_file_key(tmp_path):
    endpoint = "http://collector:4317"
    parser = build_parser()
    node = ["--coordinator", "tcp://c:1", "--node-id", "n"]
    for command in (["serve"], ["coordinator"], ["prefill", *node], ["decode", *node]):
        args = parser.parse_args(command)
        assert getattr(args, "otlp_traces_endpoint", None) is None
        args = parser.parse_args([*command, "--otlp-traces-endpoint", endpoint])
        assert args.otlp_traces_endpoint == endpoint
    path = tmp_path / "cluster.toml"
    path.write_text(
        f'otlp_traces_endpoint = "{endpoint}"\n'
        '[[host]]\nname = "local"\naddress = "127.0.0.1"\nprefill_workers = 1\ndecode_workers = 1\n'
    )
    procs = plan(load_cluster_file(path), "local")
    assert [p.role for p in procs] == ["coordinator", "prefill", "decode"]
    for p in procs:
        at = p.command.index("--otlp-traces-endpoint")
        assert p.command[at + 1] == endpoint, p.name
    path.write_text(path.read_text() + f'[host.decode]\notlp_traces_endpoint = "{endpoint}"\n')
    with pytest.raises(ValueError, match="otlp_traces_endpoint.*top of the file"):
        load_cluster_file(path)


# --- one request, one trace, three processes ----------------------------------------------------


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> dict[str, ReceivedSpan]:
    return {s.name: s for s in spans if s.parent_id == parent.span_id}


def test_a_request_is_one_trace_across_the_coordinator_and_both_nodes(tmp_path):
    # The decode node corrupts its first landing (PDSERVE_KV_FAULTS, as
    # test_cluster_kv_integrity.py does): the first handoff fails its digest check, the request
    # is prefilled again, and the trace shows both handoffs.
    ensure_tiny_model()  # once here, not raced by the nodes
    chunk, prompt_tokens, max_tokens = 32, 70, 4
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # each process exports within 0.1 s of a span's end
    env[FAULTS] = "corrupt=0.14,seed=1"  # its first draw, 0.134, corrupts the first landing
    with http_collector() as (collector, endpoint):
        args = ["pdserve-tiny", "--otlp-traces-endpoint", endpoint, "--transport", "tcp"]
        args += ["--max-num-batched-tokens", str(chunk), "--num-kv-blocks", "128"]
        serve = ServeProcess([*args, "--block-size", "8", "--max-model-len", "256"], log, env)
        url = serve.url
        try:
            serve.wait_healthy(180)
            trace_id = f"{random.getrandbits(128):032x}"
            client_span = f"{random.getrandbits(64):016x}"
            body = {
                "prompt": [random.Random(7).randrange(4, 400) for _ in range(prompt_tokens)],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            traced = httpx.post(
                f"{url}/v1/completions",
                json=body,
                headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
                timeout=60,
            )
            assert traced.status_code == 200, traced.text
            assert traced.headers["x-pdserve-trace-id"] == trace_id
            assert traced.json()["usage"]["completion_tokens"] == max_tokens
            # A client without a traceparent starts a trace of its own, named in the header.
            untraced = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            own = untraced.headers["x-pdserve-trace-id"]
            assert len(own) == 32 and int(own, 16) and own != trace_id

            def ours(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
                return [s for s in spans if s.trace_id == trace_id]

            def complete(spans: list[ReceivedSpan]) -> bool:
                """The request's span, and each node's spans of every attempt."""
                got = [(s.service, s.name) for s in ours(spans)]
                requests = [s for s in ours(spans) if s.name == "request"]
                if not requests or ("pdserve-decode", "decode") not in got:
                    return False
                attempts = requests[0].attributes["pdserve.attempts"]
                return (
                    got.count(("pdserve-prefill", "kv_send")) == attempts
                    and got.count(("pdserve-decode", "kv_transfer")) == attempts
                    and ("pdserve-coordinator", "POST /v1/completions") in got
                )

            spans = ours(collector.wait_for("the request's spans from all three", complete))
            others = collector.wait_for(
                "the untraced request's own trace",
                lambda got: any(s.trace_id == own and not s.parent_id for s in got),
            )
        finally:
            serve.stop()
    assert "Traceback" not in log.read_text(), log.read_text()[-4000:]
    assert {s.service for s in spans} == {
        "pdserve-coordinator",
        "pdserve-prefill",
        "pdserve-decode",
    }
    roots = [s.name for s in others if s.trace_id == own and not s.parent_id]
    assert roots == ["POST /v1/completions"]

    # The coordinator: the HTTP request (the client's span its parent), the request, its phases.
    coordinator = [s for s in spans if s.service == "pdserve-coordinator"]
    (http,) = [s for s in coordinator if s.name == "POST /v1/completions"]
    assert http.parent_id == client_span
    assert http.attributes["http.response.status_code"] == 200
    assert http.attributes["pdserve.request_id"].startswith("cmpl-")
    (request,) = [s for s in coordinator if s.parent_id == http.span_id]
    assert request.name == "request" and request.attributes["pdserve.finish_reason"] == "length"
    assert request.attributes["pdserve.completion_tokens"] == max_tokens
    attempts = request.attributes["pdserve.attempts"]
    assert attempts >= 2 and request.events.count("retry") == attempts - 1
    phases = [s for s in coordinator if s.parent_id == request.span_id]
    assert {s.name for s in phases} == {
        "routing",
        "prefill",
        "queue",
        "admission",
        "kv_transfer",
        "decode",
    }

    def phase(name: str, attempt: int) -> ReceivedSpan:
        (found,) = [
            s for s in phases if s.name == name and s.attributes["pdserve.attempt"] == attempt
        ]
        return found

    last = attempts - 1
    assert phase("kv_transfer", 0).error and not phase("kv_transfer", last).error
    assert phase("routing", 0).attributes["pdserve.prefill_node"] == "prefill-0"

    # The prefill node's spans hang from the coordinator's phase that sent their order: its
    # prefill from the prefill phase (Prefill), its KV sends from the kv_transfer phase (SendKV).
    prefill_node = [s for s in spans if s.service == "pdserve-prefill"]
    assert {s.resource["pdserve.node_id"] for s in prefill_node} == {"prefill-0"}
    (prefill,) = children(prefill_node, phase("prefill", 0)).values()
    assert prefill.name == "prefill"
    assert prefill.attributes["pdserve.prefill.chunks"] == math.ceil(prompt_tokens / chunk)
    assert prefill.attributes["pdserve.prompt_tokens"] == prompt_tokens
    assert set(children(prefill_node, prefill)) == {"queue"}
    (send,) = children(prefill_node, phase("kv_transfer", last)).values()
    assert send.name == "kv_send" and not send.error
    assert send.attributes["pdserve.kv.transport"] == "tcp"
    assert send.attributes["pdserve.kv.bytes"] > 0

    # The decode node's spans hang from the admission phase (Admit). The first handoff's pages
    # failed their digest check; the last one's passed, and the sequence decoded there.
    decode_node = [s for s in spans if s.service == "pdserve-decode"]
    assert {s.resource["pdserve.node_id"] for s in decode_node} == {"decode-0"}
    first = children(decode_node, phase("admission", 0))
    assert set(first) == {"admission", "kv_transfer"}
    # (unless the attempt's abort, sent on the prefill node's report of the same failure, ended
    # the span before the receiver's own result came: the span is then failed, unattributed)
    assert first["kv_transfer"].attributes.get("pdserve.kv.integrity", "failed") == "failed"
    assert first["kv_transfer"].error
    final = children(decode_node, phase("admission", last))
    assert set(final) == {"admission", "kv_transfer", "decode"}
    received = final["kv_transfer"]
    assert received.attributes["pdserve.kv.integrity"] == "ok" and not received.error
    assert received.attributes["pdserve.kv.transport"] == "tcp"
    assert received.attributes["pdserve.kv.bytes"] == send.attributes["pdserve.kv.bytes"] > 0
    # Each attempt's prefill sampled one token; the decode node made the rest.
    assert final["decode"].attributes["pdserve.completion_tokens"] == max_tokens - attempts
