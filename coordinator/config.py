"""The coordinator's configuration file (TOML, flat): the coordinator's own policies, how operators
trade time-to-first-token against time-per-output-token (live ones are re-read on SIGHUP), and the
settings of the nodes `pdserve serve` starts (`EngineConfig`, `NodeOptions`; restart to change)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.cluster.node_options import PLACEMENT, SECURITY, TRACING, NodeOptions
from pdserve.cluster.schema import (
    declared,
    defaults,
    doc_rows,
    markdown_table,
    names,
    read_table,
    setting,
    validate,
)
from pdserve.engine.config import EngineConfig, RoleTensorParallel

PREFILL_ROUTING = ("least_loaded", "prefix_affinity")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")  # (pdserve.coordinator.tool_parsers)
# (pdserve.coordinator.reasoning_parsers)
REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss")
# Node settings the file does not hold, and where they come from instead.
NOT_IN_FILE = {
    **{name: f"give pdserve serve --{name}" for name in ("model", "dtype", "device", "transport")},
    **{name: "serve gives each node its own" for name in PLACEMENT if name != "transport"},
    **{name: f"give pdserve serve --{name.replace('_', '-')}" for name in SECURITY + TRACING},
}


@dataclass(slots=True)
class NodeSettings:
    """What the file sets for the nodes `pdserve serve` starts; they read it at start only."""

    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    node: dict[str, Any] = field(default_factory=dict)  # NodeOptions fields
    roles: dict[str, Any] = field(default_factory=dict)  # RoleTensorParallel fields

    def differences(self, other: NodeSettings) -> list[str]:
        """The settings whose values differ (one the file leaves out has its default)."""
        out = []
        for cls, mine, theirs in (
            (NodeOptions, self.node, other.node),
            (EngineConfig, self.engine, other.engine),
            (RoleTensorParallel, self.roles, other.roles),
        ):
            base = defaults(cls)
            out += [n for n in names(cls) if mine.get(n, base.get(n)) != theirs.get(n, base.get(n))]
        return out


@dataclass(slots=True)
class CoordinatorConfig:
    # Routing and admission.
    prefill_routing: str = setting(
        "prefix_affinity",
        "prefill node choice: least_loaded, or prefix_affinity (the node whose KV tiers hold the most of the prompt's prefix, by the nodes' KV events)",
        live=True,
        choices=PREFILL_ROUTING,
    )
    admission_watermark: float = setting(
        0.05,
        "fraction of a decode node's KV blocks kept free at admission, for its running sequences to grow into",
        live=True,
        minimum=0,
        below=1,
    )
    max_pending_requests: int = setting(
        512,
        "requests not yet decoding beyond which new ones get an 'overloaded' error",
        live=True,
        minimum=1,
    )
    conditional_disagg_threshold: int = setting(
        0,
        "prompts shorter than this many tokens are prefilled on the decode node (0: never)",
        live=True,
        minimum=0,
    )
    local_prefill_max_uncached_tokens: int = setting(
        0,
        "a prompt whose leading blocks a decode node holds (in any KV tier), leaving at most this many tokens for it to compute, is prefilled on that node, with no KV handoff (0: never)",
        live=True,
        minimum=0,
    )
    prefill_queue_limit_tokens: int = setting(
        0,
        "when every prefill node has more queued prompt tokens than this, prefill on the decode node (0: never)",
        live=True,
        minimum=0,
    )
    prefix_affinity_min_blocks: int = setting(
        1,
        "full blocks a prompt must share with a cached prefix for affinity routing to apply",
        live=True,
        minimum=1,
    )
    prefix_affinity_max_load_ratio: float = setting(
        2.0,
        "affinity yields to least-loaded when the cached node's queue exceeds this multiple of the least-loaded node's plus the cached prefix length",
        live=True,
        minimum=0,
    )
    prefix_host_load_cost: float = setting(
        0.1,
        "in prefix routing, a cached block in a node's host-memory tier counts as this fraction of recomputing it (the device tier's count as free)",
        live=True,
        minimum=0,
        maximum=1,
    )
    prefix_disk_load_cost: float = setting(
        0.5,
        "in prefix routing, a cached block in a node's disk tier counts as this fraction of recomputing it",
        live=True,
        minimum=0,
        maximum=1,
    )
    decode_prefix_reuse: bool = setting(
        True,
        "a decode node takes the leading prompt blocks its prefix cache holds (arrived or generated there) and receives only the rest; admission prefers the decode node holding the longest prefix (by the nodes' KV events), by the prefix_affinity rule",
        live=True,
    )
    # Layer-wise KV streaming.
    kv_streaming: bool = setting(
        True,
        "admit long prompts into a decode node when their prefill starts, and send their KV layer by layer while the last chunk computes",
        live=True,
    )
    kv_streaming_min_prompt_tokens: int = setting(
        512,
        "prompts of at least this many tokens stream their KV (with kv_streaming)",
        live=True,
        minimum=1,
    )
    kv_streaming_timeout_s: float = setting(
        120.0,
        "how long a decode node holds an early reservation for the prefill to end and its KV to arrive",
        live=True,
        above=0,
    )
    # Failure handling.
    heartbeat_timeout_s: float = setting(
        3.0,
        "a node silent this long is marked dead and its requests move elsewhere",
        live=True,
        above=0,
    )
    # ZeroMQ reconnects a live node within its reconnect interval (0.1 s), then a handshake of a
    # few ms: 0.5 s is five intervals for that, and the bulk of a dead node's recovery time.
    disconnect_grace_s: float = setting(
        0.5,
        "a node whose connection to the coordinator's node socket closes (its process died, on "
        "any host that closes its sockets) and is not made again within this time is marked "
        "dead, without waiting for heartbeat_timeout_s",
        live=True,
        above=0,
    )
    node_wait_s: float = setting(
        10.0,
        "a request that finds no decode node alive (all of them restarting) waits this long for "
        "one before it fails with HTTP 503; 0 fails it at once",
        live=True,
        minimum=0,
    )
    max_retries: int = setting(
        3,
        "times a request is re-prefilled after node failures before it fails",
        live=True,
        minimum=0,
    )
    transfer_timeout_s: float = setting(
        30.0,
        "a KV handoff not finished in this time fails and is retried (sent with each handoff)",
        live=True,
        above=0,
    )
    request_timeout_s: float = setting(
        1800.0,
        "a request not finished this long after it arrived is ended on every node and its client "
        "gets a timeout error (HTTP 504, or an error event in its stream)",
        live=True,
        above=0,
    )
    # Bounds on what a client may ask (HTTP API), so none can hold the server's memory or time.
    max_pending_tokens: int = setting(
        1 << 20,
        "prompt tokens of requests not yet decoding beyond which new ones get an 'overloaded' error",
        live=True,
        minimum=1,
    )
    max_request_body_bytes: int = setting(
        8 << 20,
        "HTTP request bodies larger than this are refused (413)",
        live=True,
        minimum=1,
    )
    max_n: int = setting(128, "largest n (and best_of) of a request", live=True, minimum=1)
    max_logprobs: int = setting(
        20, "largest logprobs (completions) or top_logprobs (chat)", live=True, minimum=0
    )
    max_stop_strings: int = setting(32, "stop strings a request may give", live=True, minimum=0)
    max_stop_string_chars: int = setting(512, "characters of one stop string", live=True, minimum=1)
    max_logit_bias: int = setting(
        300, "logit_bias entries a request may give", live=True, minimum=0
    )
    max_json_schema_bytes: int = setting(
        64 << 10,
        "bytes of a JSON schema a request constrains its output with (response_format, "
        "structured_outputs, guided_json, a forced tool's parameters); larger ones get a 400",
        live=True,
        minimum=1,
    )
    max_json_schema_depth: int = setting(
        32,
        "how deeply the (sub)schemas of such a JSON schema may nest; deeper ones get a 400",
        live=True,
        minimum=1,
    )
    enable_auto_tool_choice: bool = setting(
        False,
        "tool_choice auto: the model decides whether to call a tool, its calls parsed from its "
        "output by tool_call_parser (also the default choice of a request with tools)",
        live=True,
    )
    tool_call_parser: str | None = setting(
        None,
        "the format of the model's own tool calls: hermes (<tool_call> tags, as Qwen's models "
        "write them), llama3_json or mistral (unset: tool_choice auto is refused)",
        live=True,
        choices=TOOL_CALL_PARSERS,
    )
    reasoning_parser: str | None = setting(
        None,
        "the format of the model's reasoning, returned apart from its answer as "
        "reasoning_content: deepseek_r1 or qwen3 (<think> ... </think>), openai_gptoss (harmony's "
        "analysis channel); a request's constraint and tool calls then apply to the answer "
        "(unset: the reasoning is content)",
        live=True,
        choices=REASONING_PARSERS,
    )
    max_stored_responses: int = setting(
        1000,
        "Responses API responses kept in the coordinator's memory (store: true) for "
        "previous_response_id and GET /v1/responses/{id}, with their conversation; the least "
        "recently used beyond this count are dropped (0: none kept)",
        live=True,
        minimum=0,
    )
    stored_response_ttl_s: float = setting(
        3600.0,
        "a stored response older than this is dropped (a 404 when asked for)",
        live=True,
        above=0,
    )
    metrics_require_api_key: bool = setting(
        False, "with API keys, /metrics needs one too (else it is open, as /health is)", live=True
    )
    # Not a setting of the coordinator: the nodes' part of the same file.
    node_settings: NodeSettings = field(default_factory=NodeSettings)

    def __post_init__(self) -> None:
        validate(self)

    @classmethod
    def from_toml(cls, path: str | Path) -> CoordinatorConfig:
        """The whole file: the coordinator's settings, and the nodes' in `node_settings`."""
        try:
            data = tomllib.loads(Path(path).read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not valid TOML: {exc}") from exc
        own, node, engine, roles = read_table(
            data,
            cls,
            NodeOptions,
            EngineConfig,
            RoleTensorParallel,
            where=f"{path}: ",
            refuse=NOT_IN_FILE,
        )
        try:
            EngineConfig(**engine)  # the checks that span settings, before any node starts
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc
        return cls(**own, node_settings=NodeSettings(engine, node, roles))

    def reload_from(self, new: CoordinatorConfig) -> list[str]:
        """Apply the live fields of `new`; returns the names changed. Fixed fields that differ
        are left alone (they need a restart) and reported in the log by the caller."""
        changed = []
        for d in declared(type(self)):
            if d.spec.live and getattr(self, d.name) != getattr(new, d.name):
                setattr(self, d.name, getattr(new, d.name))
                changed.append(d.name)
        return changed

    def fixed_differences(self, new: CoordinatorConfig) -> list[str]:
        """The settings of `new` that differ but take a restart: the coordinator's own that are
        not live, and every node setting."""
        own = [
            d.name
            for d in declared(type(self))
            if not d.spec.live and getattr(self, d.name) != getattr(new, d.name)
        ]
        return own + self.node_settings.differences(new.node_settings)


def file_keys(cls: type) -> list[str]:
    """The keys of cls the file holds."""
    return [n for n in names(cls) if n not in NOT_IN_FILE]


def doc_tables() -> tuple[str, str]:
    """The tables of docs/configuration.md: the file's keys, and the node settings that are only
    flags."""

    def quoted(rows: list[tuple[str, ...]], flag: bool = False) -> list[tuple[str, ...]]:
        key = (lambda n: "`--" + n.replace("_", "-") + "`") if flag else (lambda n: f"`{n}`")
        return [(key(row[0]), *row[1:]) for row in rows]

    file_rows = doc_rows(CoordinatorConfig)
    file_rows += doc_rows(NodeOptions, file_keys(NodeOptions))
    file_rows += doc_rows(EngineConfig, file_keys(EngineConfig))
    file_rows += doc_rows(RoleTensorParallel)
    flag_rows = [
        (name, default.strip('"'), meaning)
        for cls in (NodeOptions, EngineConfig)
        for name, default, _, meaning in doc_rows(cls, NOT_IN_FILE)
    ]
    return (
        markdown_table(("key", "default", "applies", "meaning"), quoted(file_rows)),
        markdown_table(("flag", "default", "meaning"), quoted(flag_rows, flag=True)),
    )


if __name__ == "__main__":
    print(*doc_tables(), sep="\n", end="")  # python -m pdserve.coordinator.config: the docs' tables
