"""Every setting is declared once (`pdserve.cluster.schema`) by EngineConfig, NodeOptions or
CoordinatorConfig, and every key of the cluster file by its tables' declarations; flags, node
command lines, the coordinator's file, the cluster file and the docs' tables follow from those
declarations."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.cli import build_parser
from pdserve.cluster.node_options import NodeOptions
from pdserve.cluster.schema import (
    Declared,
    add_flags,
    check,
    declared,
    from_args,
    to_flags,
    values_from_args,
)
from pdserve.cluster_file import (
    CLUSTER_WIDE,
    NOT_PER_ROLE,
    ClusterFileError,
    ClusterOptions,
    CoordinatorPlace,
    HostSpec,
    doc_table,
    load_cluster_file,
    plan,
)
from pdserve.coordinator.config import CoordinatorConfig, doc_tables, file_keys
from pdserve.engine.config import EngineConfig, RoleTensorParallel
from pdserve.launch import NodeSpec
from pdserve.serve import ServeOptions, load_config, node_engine, node_specs

REPO = Path(__file__).resolve().parent.parent
DECLARATIONS = (EngineConfig, NodeOptions, CoordinatorConfig, RoleTensorParallel)
COORDINATOR = "tcp://127.0.0.1:5555"


def parse_node_command(command: list[str]) -> tuple[NodeOptions, EngineConfig]:
    """What a node process runs with: its command line parsed as `pdserve` parses it."""
    assert command[1:3] == ["-m", "pdserve"]
    args = build_parser().parse_args(command[3:])
    return from_args(NodeOptions, args), from_args(EngineConfig, args)


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)  # strings and numbers are written alike in TOML


# --- the declarations ---------------------------------------------------------------------------


def test_no_setting_is_declared_twice():
    names = [
        name for cls in DECLARATIONS for d in declared(cls) for name in (d.name, *d.spec.old_names)
    ]
    assert [name for name, n in Counter(names).items() if n > 1] == []


def test_every_field_of_the_declarations_is_a_setting():
    for cls in DECLARATIONS:
        fields = {f.name for f in dataclasses.fields(cls)}
        settings_ = {d.name for d in declared(cls)}
        # The coordinator's config carries the nodes' part of its file beside its own settings.
        assert fields - settings_ == ({"node_settings"} if cls is CoordinatorConfig else set())


def test_bad_values_are_refused_naming_the_setting():
    with pytest.raises(ValueError, match="prefill_routing"):
        CoordinatorConfig(prefill_routing="random")
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="enforce_eager must be true or false"):
        EngineConfig(enforce_eager=1)
    with pytest.raises(ValueError, match="heartbeat_interval_s must be > 0"):
        NodeOptions(coordinator=COORDINATOR, node_id="n", heartbeat_interval_s=0)
    assert EngineConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1.0


def test_a_list_setting_checks_each_item():
    gpus = next(d for d in declared(HostSpec) if d.name == "prefill_gpus")
    assert gpus.many and gpus.kind is int
    assert check(gpus, [3, 1]) == (3, 1)
    with pytest.raises(ValueError, match=r"prefill_gpus: every item must be >= 0, got -1"):
        check(gpus, [0, -1])
    with pytest.raises(ValueError, match=r"prefill_gpus must be a list of integers, got 2"):
        check(gpus, 2)
    host = HostSpec(name="h", address="127.0.0.1", decode_gpus=[2, 3])
    parser = argparse.ArgumentParser()
    add_flags(parser, HostSpec)
    assert from_args(HostSpec, parser.parse_args(to_flags(host))) == host


def test_decode_routing_is_gone():
    assert "decode_routing" not in {d.name for d in declared(CoordinatorConfig)}


# --- flags --------------------------------------------------------------------------------------


# Text settings with a format of their own (checked when the object is made).
FORMATTED = {
    "cpu_bind": st.sampled_from(["auto", "0", "1-3", "0,2", "0-1,4"]),
    "speculative_config": st.sampled_from(
        [
            '{"num_speculative_tokens": 3}',
            '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, '
            '"prompt_lookup_min": 1, "adaptive": false}',
        ]
    ),
}


def values(d: Declared) -> st.SearchStrategy:
    """Every value the declaration allows (bounded where it is)."""
    s = d.spec
    if d.name in FORMATTED:
        base = FORMATTED[d.name]
    elif s.choices is not None:
        base = st.sampled_from(s.choices)
    elif d.kind is bool:
        base = st.booleans()
    elif d.kind is int:
        low = s.minimum if s.minimum is not None else None if s.above is None else s.above + 1
        high = s.maximum if s.maximum is not None else None if s.below is None else s.below - 1
        base = st.integers(min_value=low, max_value=high)
    elif d.kind is float:
        base = st.floats(
            min_value=s.minimum if s.minimum is not None else s.above,
            max_value=s.maximum if s.maximum is not None else s.below,
            exclude_min=s.above is not None,
            exclude_max=s.below is not None,
            allow_nan=False,
            allow_infinity=False,
        )
    else:
        base = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"))
    return st.none() | base if d.optional else base


def consistent(fields: dict) -> bool:
    """Settings that each hold alone but not together (checked when the object is made): KV
    tiers need a one-process node, and a disk tier a host tier."""
    tiers = fields.get("kv_host_bytes") or fields.get("kv_disk_path") is not None
    if tiers and fields.get("tensor_parallel_size", 1) > 1:
        return False
    return not (fields.get("kv_disk_path") is not None and fields.get("kv_host_bytes") == 0)


def instances(cls: type) -> st.SearchStrategy:
    fields = st.fixed_dictionaries({d.name: values(d) for d in declared(cls)})
    return fields.filter(consistent).map(lambda f: cls(**f))


@settings(max_examples=150, deadline=None)
@given(
    options=instances(NodeOptions),
    engine=instances(EngineConfig),
    role=st.sampled_from(["prefill", "decode", "colocated"]),
)
def test_a_node_command_parses_back_to_the_same_settings(options, engine, role):
    command = NodeSpec(role, options, engine).command()
    assert parse_node_command(command) == (options, engine)
    args = build_parser().parse_args(command[3:])
    assert args.command == ("prefill" if role == "prefill" else "decode")
    assert getattr(args, "colocated", False) == (role == "colocated")


def test_a_node_with_default_settings_gets_no_setting_flags_but_its_keys_and_cores(tmp_path):
    from pdserve.cluster.keys import ClusterKeys
    from pdserve.engine.cpu.threads import available_cores, node_bindings

    keys = ClusterKeys.generate().write(tmp_path / "keys")
    (spec,) = [
        s
        for s in node_specs(ServeOptions(), CoordinatorConfig(), COORDINATOR, keys)
        if s.role == "decode"
    ]
    # serve's two nodes (a prefill and a decode) split this host's cores.
    cores = node_bindings(None, [1, 1], available_cores())[1]
    assert spec.command()[3:] == [
        "decode",
        "--coordinator",
        COORDINATOR,
        "--node-id",
        "decode-0",
        "--cluster-keys",
        str(keys.directory),
        "--cpu-bind",
        cores,
    ]
    assert parse_node_command(spec.command()) == (
        NodeOptions(coordinator=COORDINATOR, node_id="decode-0", cluster_keys=str(keys.directory)),
        EngineConfig(cpu_bind=cores),
    )
    (insecure, *_) = node_specs(ServeOptions(), CoordinatorConfig(), COORDINATOR, None)
    assert parse_node_command(insecure.command())[0].insecure


def test_flags_added_without_defaults_hold_only_what_was_given():
    import argparse

    parser = argparse.ArgumentParser()
    add_flags(parser, EngineConfig, suppress_defaults=True)
    assert values_from_args(EngineConfig, parser.parse_args([])) == {}
    given_ = parser.parse_args(["--no-enable-prefix-caching", "--max-num-seqs", "8"])
    assert values_from_args(EngineConfig, given_) == {
        "enable_prefix_caching": False,
        "max_num_seqs": 8,
    }


def test_a_bad_flag_value_is_one_line():
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "prefill",
            "--coordinator",
            COORDINATOR,
            "--node-id",
            "p",
            "--max-num-seqs",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert res.stderr == "pdserve: error: max_num_seqs must be >= 1, got 0\n"


# --- the coordinator's file ---------------------------------------------------------------------

# Every key the file took before the settings had one declaration each (decode_routing aside).
KEYS_BEFORE = """
prefill_routing = "least_loaded"
admission_watermark = 0.1
max_pending_requests = 64
conditional_disagg_threshold = 16
prefill_queue_limit_tokens = 4096
prefix_affinity_min_blocks = 2
prefix_affinity_max_load_ratio = 3.0
heartbeat_timeout_s = 5.0
max_retries = 2
transfer_timeout_s = 12.0
heartbeat_interval_s = 0.25
block_size = 8
max_num_seqs = 32
max_num_batched_tokens = 512
num_kv_blocks = 1024
kv_cache_bytes = 1000000
gpu_memory_utilization = 0.8
enable_prefix_caching = false
max_model_len = 256
scheduling_policy = "static"
kv_handoff = "between-steps"
kernel_backend = "torch"
enforce_eager = true
cuda_graph_max_batch_size = 16
"""


def test_the_flat_file_loads_into_the_three_declarations(tmp_path):
    path = tmp_path / "pdserve.toml"
    path.write_text(KEYS_BEFORE)
    cfg = CoordinatorConfig.from_toml(path)
    assert cfg.prefill_routing == "least_loaded" and cfg.transfer_timeout_s == 12.0
    assert cfg.node_settings.node == {"heartbeat_interval_s": 0.25, "kv_handoff": "between-steps"}
    assert cfg.node_settings.engine["max_num_batched_tokens"] == 512
    # The nodes `serve` starts get the file's node settings, and serve's flags over them.
    args = build_parser().parse_args(["serve", "--model", "/m", "--dtype", "float32"])
    options = ServeOptions(
        model=args.model,
        prefill_nodes=2,
        decode_nodes=1,
        engine=values_from_args(EngineConfig, args),
        node=values_from_args(NodeOptions, args),
    )
    specs = node_specs(options, cfg, COORDINATOR)
    assert [s.node_id for s in specs] == ["prefill-0", "prefill-1", "decode-0"]
    for spec in specs:
        node, engine = parse_node_command(spec.command())
        assert (node.heartbeat_interval_s, node.kv_handoff, node.transport) == (
            0.25,
            "between-steps",
            "tcp",
        )
        assert engine == EngineConfig(
            model="/m", dtype="float32", cpu_bind=engine.cpu_bind, **cfg.node_settings.engine
        )


def test_the_example_configs_load(tmp_path):
    cfg = CoordinatorConfig.from_toml(REPO / "deploy" / "pdserve.example.toml")
    assert cfg.max_pending_requests == 256
    assert cfg.node_settings.engine == {"max_num_batched_tokens": 1024}
    doc = (REPO / "docs" / "configuration.md").read_text()
    example = tmp_path / "example.toml"
    example.write_text(doc.split("```toml\n")[1].split("```")[0])
    cfg = CoordinatorConfig.from_toml(example)
    assert cfg.conditional_disagg_threshold == 32
    assert cfg.node_settings.engine == {"max_num_batched_tokens": 1024, "num_kv_blocks": 2048}


@pytest.mark.parametrize(
    "text,words",
    [
        ("max_pending_request = 3", ["unknown key 'max_pending_request'", "max_pending_requests"]),
        ("max_num_seqs = true", ["key 'max_num_seqs'", "an integer"]),
        ("admission_watermark = '0.1'", ["key 'admission_watermark'", "a number"]),
        ("admission_watermark = 1.0", ["key 'admission_watermark'", "< 1"]),
        ('prefill_routing = "random"', ["key 'prefill_routing'", "least_loaded"]),
        ('kv_handoff = "later"', ["key 'kv_handoff'", "between-steps"]),
        ('model = "/models/x"', ["key 'model'", "--model"]),
        ('node_id = "decode-9"', ["key 'node_id'"]),
        ('decode_routing = "kv_capacity"', ["unknown key 'decode_routing'"]),
        ("max_num_seqs =", ["not valid TOML"]),
    ],
)
def test_file_errors_name_the_file_and_the_key(tmp_path, text, words):
    path = tmp_path / "bad.toml"
    path.write_text(text + "\n")
    with pytest.raises(ValueError) as err:
        CoordinatorConfig.from_toml(path)
    for word in [str(path), *words]:
        assert word in str(err.value)


def test_live_reload_applies_live_fields_and_reports_the_rest(tmp_path):
    path = tmp_path / "pdserve.toml"
    path.write_text('prefill_routing = "least_loaded"\nmax_pending_requests = 7\nblock_size = 8\n')
    cfg = CoordinatorConfig.from_toml(path)
    assert cfg.prefill_routing == "least_loaded" and cfg.max_pending_requests == 7
    path.write_text(
        'prefill_routing = "prefix_affinity"\nmax_pending_requests = 9\nblock_size = 32\n'
        'kv_handoff = "between-steps"\n'
    )
    new = CoordinatorConfig.from_toml(path)
    assert sorted(cfg.reload_from(new)) == ["max_pending_requests", "prefill_routing"]
    assert cfg.fixed_differences(new) == ["kv_handoff", "block_size"]
    assert cfg.node_settings.engine == {"block_size": 8}  # the nodes keep what they started with
    assert cfg.fixed_differences(cfg) == []


def test_sighup_reload_applies_live_fields_only(tmp_path, caplog):
    from pdserve.coordinator.coordinator import Coordinator

    path = tmp_path / "pdserve.toml"
    path.write_text("admission_watermark = 0.1\nmax_num_seqs = 8\n")
    coordinator = Coordinator(CoordinatorConfig.from_toml(path), config_path=path)
    path.write_text("admission_watermark = 0.3\nmax_num_seqs = 16\n")
    with caplog.at_level(logging.WARNING):
        assert coordinator.reload_config() == ["admission_watermark"]
    assert coordinator.config.admission_watermark == 0.3
    assert coordinator.config.node_settings.engine == {"max_num_seqs": 8}  # restart to change
    assert "max_num_seqs" in caplog.text and "restart" in caplog.text


def test_serve_with_a_bad_config_is_one_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("max_num_seqs = 0\n")
    res = subprocess.run(
        [sys.executable, "-m", "pdserve", "serve", "--config", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    assert res.stderr.startswith("pdserve: error: ") and res.stderr.count("\n") == 1
    assert "max_num_seqs" in res.stderr


# --- serve's flags over the file ---------------------------------------------------------------


def serve_options(argv: list[str]) -> ServeOptions:
    """ServeOptions as `pdserve serve ARGV` builds them."""
    args = build_parser().parse_args(["serve", *argv])
    return ServeOptions(
        model=args.model_arg or args.model,
        config_path=args.config,
        engine={k: v for k, v in values_from_args(EngineConfig, args).items() if k != "model"},
        node=values_from_args(NodeOptions, args),
        coordinator=values_from_args(CoordinatorConfig, args),
    )


def test_every_setting_a_file_gives_the_nodes_is_a_serve_flag_of_the_same_name():
    parser = build_parser()
    for cls in (EngineConfig, NodeOptions):
        for name in file_keys(cls):
            d = next(d for d in declared(cls) if d.name == name)
            argv = [d.flag if d.kind is bool else f"{d.flag}={other_value(d)}"]
            args = parser.parse_args(["serve", *argv])
            assert name in values_from_args(cls, args), name
    # vLLM's engine flags, by vLLM's names; dtype and device are flags only.
    args = parser.parse_args(
        [
            "serve",
            "/m",
            "--max-model-len",
            "1024",
            "--max-num-seqs",
            "8",
            "--block-size",
            "32",
            "--max-num-batched-tokens",
            "512",
            "--gpu-memory-utilization",
            "0.5",
            "--seed",
            "3",
            "--no-enable-prefix-caching",
            "--enforce-eager",
            "--dtype",
            "float16",
            "--kv-cache-bytes",
            "1000000",
            "--served-model-name",
            "a",
            "b",
            "--max-pending-requests",
            "9",
            "--chat-template",
            "t.jinja",
        ]
    )
    assert args.model_arg == "/m" and args.served_model_name == ["a", "b"]
    assert args.chat_template == "t.jinja" and args.max_pending_requests == 9
    assert values_from_args(EngineConfig, args) == {
        "model": None,
        "max_model_len": 1024,
        "max_num_seqs": 8,
        "block_size": 32,
        "max_num_batched_tokens": 512,
        "gpu_memory_utilization": 0.5,
        "seed": 3,
        "enable_prefix_caching": False,
        "enforce_eager": True,
        "dtype": "float16",
        "kv_cache_bytes": 1000000,
    }


def test_a_flag_beats_the_file_which_beats_the_default(tmp_path):
    path = tmp_path / "pdserve.toml"
    path.write_text(
        "max_model_len = 50\nmax_num_seqs = 8\nmax_pending_requests = 7\n"
        "kv_handoff = 'between-steps'\n"
    )
    options = serve_options(
        [
            "--config",
            str(path),
            "--max-model-len",
            "100",
            "--max-pending-requests",
            "3",
            "--kv-handoff",
            "immediate",
        ]
    )
    config = load_config(options)
    engine = node_engine(options, config)
    assert (engine.max_model_len, engine.max_num_seqs, engine.block_size) == (100, 8, 16)
    assert config.max_pending_requests == 3
    assert config.admission_watermark == CoordinatorConfig().admission_watermark
    (spec, *_) = node_specs(options, config, COORDINATOR)
    assert parse_node_command(spec.command())[0].kv_handoff == "immediate"
    without = serve_options(["--config", str(path)])
    assert load_config(without).max_pending_requests == 7
    assert node_engine(without, load_config(without)).max_model_len == 50


def test_the_precedence_example_of_the_docs_holds(monkeypatch):
    doc = (REPO / "docs" / "configuration.md").read_text()
    command = doc.split("## Flag, file, default")[1].split("```\n")[1].split()
    assert command[:2] == ["pdserve", "serve"]
    monkeypatch.chdir(REPO)  # the command names deploy/ from the repository's root
    options = serve_options(command[2:])
    engine = node_engine(options, load_config(options))
    assert (engine.max_num_batched_tokens, engine.max_num_seqs) == (512, 64)
    assert load_config(options).conditional_disagg_threshold == 32  # the file's


def test_sighup_keeps_the_flags_over_the_file(tmp_path):
    from pdserve.coordinator.coordinator import Coordinator
    from pdserve.serve import reload_config

    path = tmp_path / "pdserve.toml"
    path.write_text("max_pending_requests = 7\nadmission_watermark = 0.1\n")
    options = serve_options(["--config", str(path), "--max-pending-requests", "3"])
    coordinator = Coordinator(load_config(options))
    path.write_text("max_pending_requests = 9\nadmission_watermark = 0.2\n")
    reload_config(coordinator, options)
    assert coordinator.config.max_pending_requests == 3
    assert coordinator.config.admission_watermark == 0.2


def test_the_docs_tables_are_the_declarations():
    doc = (REPO / "docs" / "configuration.md").read_text()
    for table in doc_tables():
        assert table in doc, (
            "docs/configuration.md's tables differ from the declarations; "
            f"`python -m pdserve.coordinator.config` prints them:\n{table}"
        )


# --- the cluster file ---------------------------------------------------------------------------


def test_the_cluster_files_keys_are_declared_once_per_table():
    for cls in (ClusterOptions, CoordinatorPlace, HostSpec):
        fields = {f.name for f in dataclasses.fields(cls)}
        settings_ = {d.name for d in declared(cls)}
        # A host carries its role tables, read by EngineConfig's and NodeOptions' declarations.
        assert fields - settings_ == ({"prefill", "decode"} if cls is HostSpec else set())
    # The top's engine settings are EngineConfig's, not declared a second time.
    assert not {d.name for d in declared(ClusterOptions)} & set(CLUSTER_WIDE)


def test_the_cluster_files_table_in_the_docs_is_the_declarations():
    doc = (REPO / "docs" / "deployment.md").read_text()
    assert doc_table() in doc, (
        "docs/deployment.md's table of the cluster file differs from its declarations; "
        f"`python -m pdserve.cluster_file` prints it:\n{doc_table()}"
    )


def test_the_cluster_files_table_is_what_python_m_prints():
    res = subprocess.run(
        [sys.executable, "-m", "pdserve.cluster_file"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert res.stdout == doc_table()


# --- the cluster file's role tables -------------------------------------------------------------

CLUSTER = """
dtype = "float32"
block_size = 8

[[host]]
name = "local"
address = "127.0.0.1"
prefill_workers = 1
decode_workers = 1
{tables}
"""


def cluster_file(tmp_path: Path, tables: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(CLUSTER.format(tables=tables))
    return path


def launched(path: Path) -> dict[str, tuple[NodeOptions, EngineConfig]]:
    procs = plan(load_cluster_file(path), "local")
    return {p.role: parse_node_command(p.command) for p in procs if p.role != "coordinator"}


def other_value(d: Declared) -> object:
    """A valid value of the setting that is not its default."""
    if d.spec.choices is not None:
        return next(c for c in d.spec.choices if c != d.default)
    if d.kind is bool:
        return not d.default
    if d.kind is float:
        return d.default / 2
    if d.name == "cpu_bind":
        return "0,2"
    if d.name == "speculative_config":
        return '{"method": "ngram", "num_speculative_tokens": 3}'
    if d.kind is str:
        return "/var/tmp/pdserve-kv" if d.name == "kv_disk_path" else "seven"
    return (d.default or 0) + 7


ROLE_SETTINGS = [
    d for cls in (EngineConfig, NodeOptions) for d in declared(cls) if d.name not in NOT_PER_ROLE
]


@pytest.mark.parametrize("d", ROLE_SETTINGS, ids=[d.name for d in ROLE_SETTINGS])
def test_a_role_table_sets_any_node_setting_on_that_roles_nodes(tmp_path, d):
    value = other_value(d)
    nodes = launched(cluster_file(tmp_path, f"[host.decode]\n{d.name} = {toml_value(value)}\n"))
    (decode_options, decode_engine), (prefill_options, prefill_engine) = (
        nodes["decode"],
        nodes["prefill"],
    )
    on_decode = decode_engine if hasattr(decode_engine, d.name) else decode_options
    on_prefill = prefill_engine if hasattr(prefill_engine, d.name) else prefill_options
    assert getattr(on_decode, d.name) == value
    if d.name != "cpu_bind":  # a prefill node given none binds to its share of the host's
        assert getattr(on_prefill, d.name) == d.default
    assert (decode_engine.dtype, decode_engine.block_size, decode_engine.device) == (
        "float32",
        8,
        "cpu",
    )


def test_an_old_name_warns_and_is_read_as_its_setting(tmp_path, caplog):
    path = cluster_file(tmp_path, "[host.prefill]\nchunk_size = 512\nkv_memory_fraction = 0.5\n")
    with caplog.at_level(logging.WARNING, logger="pdserve.settings"):
        nodes = launched(path)
    assert nodes["prefill"][1].max_num_batched_tokens == 512
    assert nodes["prefill"][1].gpu_memory_utilization == 0.5
    warned = " ".join(r.getMessage() for r in caplog.records)
    for word in ("chunk_size", "max_num_batched_tokens", "kv_memory_fraction", "host 'local'"):
        assert word in warned


@pytest.mark.parametrize(
    "tables,words",
    [
        ("[host.decode]\nchunk_size = 64\nmax_num_batched_tokens = 64\n", ["chunk_size"]),
        ("[host.decode]\nblock_size = 16\n", ["[host.decode]", "block_size", "top of the file"]),
        ("[host.decode]\ndevice = 'cuda'\n", ["[host.decode]", "device"]),
        ("[host.prefill]\nkv_port = 6000\n", ["[host.prefill]", "kv_port"]),
        ("[host.decode]\nenforce_eager = 1\n", ["enforce_eager", "true or false"]),
        ("[host.decode]\ngpu_memory_utilization = 1.5\n", ["gpu_memory_utilization", "<= 1"]),
    ],
)
def test_bad_role_tables_are_refused_naming_the_key(tmp_path, tables, words):
    with pytest.raises(ClusterFileError) as err:
        load_cluster_file(cluster_file(tmp_path, tables))
    for word in ["host 'local'", *words]:
        assert word in str(err.value)
