"""Tensor parallelism in the tuner: a roofline group's all-reduces, the search over each role's
TP size, and the cluster file of a TP deployment that `pdserve launch` takes as it is."""

from __future__ import annotations

import pytest
from test_deploy import engine

from pdserve.cli import main
from pdserve.cluster_file import load_cluster_file, plan
from pdserve.tune.deployment import Deployment
from pdserve.tune.model_shape import DTYPE_BYTES, PRESETS, ModelShape
from pdserve.tune.profile import GroupModel, Profile
from pdserve.tune.report import (
    candidates_table,
    cluster_file,
    coordinator_config,
    search_results,
)
from pdserve.tune.roofline import (
    DEVICES,
    Assumptions,
    allreduce_seconds,
    roofline_profile,
    roofline_step,
)
from pdserve.tune.search import Evaluation, SearchSpace, search, usable_tp_sizes
from pdserve.tune.slo import SLO
from pdserve.tune.step_model import StepShape, StepTimeModel
from pdserve.tune.transfer_model import TransferModel
from pdserve.tune.workload import LengthDist, synthetic

H100 = DEVICES["h100"]
LLAMA_70B = PRESETS["llama3-70b"]


def test_an_all_reduce_costs_two_a_layer_of_the_tokens_hidden_states_over_a_ring():
    a = Assumptions()
    assert allreduce_seconds(LLAMA_70B, "bfloat16", 1, 4096, H100, a) == 0.0  # no group
    # Two a layer, each a latency plus 2(G-1)/G of tokens x hidden x 2 bytes over NVLink.
    message = 1000 * 8192 * 2
    expected = 2 * 80 * (10e-6 + 2 * 7 / 8 * message / (450e9 * 0.7))
    assert allreduce_seconds(LLAMA_70B, "bfloat16", 8, 1000, H100, a) == pytest.approx(expected)
    by_size = [allreduce_seconds(LLAMA_70B, "bfloat16", g, 1000, H100, a) for g in (2, 4, 8)]
    assert by_size[0] < by_size[1] < by_size[2]
    # Linear in tokens beyond the latencies.
    one, two = (allreduce_seconds(LLAMA_70B, "bfloat16", 4, n, H100, a) for n in (1000, 2000))
    latency = allreduce_seconds(LLAMA_70B, "bfloat16", 4, 0, H100, a)
    assert latency == pytest.approx(160 * 10e-6)
    assert two - latency == pytest.approx(2 * (one - latency))


@pytest.mark.parametrize("gpus", [4, 8])
@pytest.mark.parametrize("shape", [StepShape.decode(64, 1000), StepShape.prefill(2, 2048)])
def test_a_group_step_is_the_roofline_of_g_gpus_plus_its_all_reduces(gpus, shape):
    a = Assumptions()
    p = roofline_profile(LLAMA_70B, "h100").at_tp(gpus)
    assert p.devices_per_node == gpus
    # Weights, KV and FLOPs split over G: the roofline of G times the peaks.
    split = roofline_step(
        LLAMA_70B,
        "bfloat16",
        gpus * 989.0 * 0.6,
        gpus * 3350.0 * 0.75,
        a.step_overhead_s,
        a.per_seq_s,
    )
    allreduce = allreduce_seconds(LLAMA_70B, "bfloat16", gpus, shape.num_tokens, H100, a)
    assert p.step.time(shape) == pytest.approx(split.time(shape) + allreduce, rel=1e-9)
    # The pool: G GPUs' memory less the weights once.
    pool = gpus * (80 * 0.9 - 4) * 1e9 - LLAMA_70B.weight_bytes("bfloat16")
    assert p.kv_blocks == int(pool // LLAMA_70B.kv_bytes_per_block(16, "bfloat16"))
    assert p.transfer.bytes_per_s == gpus * 50e9  # every GPU of the group sends its heads
    assert DTYPE_BYTES[p.dtype] == 2


def test_a_profile_keeps_each_group_through_json(tmp_path):
    p = roofline_profile(PRESETS["llama3-8b"], "h100")
    assert p.tp_sizes == [1, 2, 4, 8] and p.devices_per_node == 1
    p.save(tmp_path / "p.json")
    q = Profile.load(tmp_path / "p.json")
    for g in (1, 2, 4, 8):
        assert q.at_tp(g).step == p.at_tp(g).step and q.at_tp(g).kv_blocks == p.at_tp(g).kv_blocks
    # From any group, every other one.
    assert q.at_tp(8).at_tp(2).at_tp(1).step == p.step
    with pytest.raises(ValueError, match="not 3"):
        q.at_tp(3)
    assert usable_tp_sizes(q, 64, gpus_per_host=4) == [1, 2, 4]
    assert usable_tp_sizes(q, 2, gpus_per_host=8) == [1, 2]


SHAPE = ModelShape("test", 2, 64, 192, 4, 2, 16, 512, 4096)


def two_sizes() -> Profile:
    """Constructed so that prefill gains from TP 2 (a 200-token prompt: 205 ms at TP 1, 47 ms at
    TP 2) and decode does not (its per-sequence cost triples): on 4 devices, one prefill node of
    2 and two decode nodes of 1 (bound 21 req/s) beat every other split and pair (at most 16)."""
    transfer = TransferModel(0.001, 1e9)
    tp1 = StepTimeModel(base_s=0.004, per_seq_s=0.001, per_token_s=0.001)
    tp2 = StepTimeModel(base_s=0.004, per_seq_s=0.003, per_token_s=0.0002)
    return Profile(
        SHAPE, "float32", tp1, transfer, kv_blocks=512, groups=(GroupModel(2, tp2, transfer, 512),)
    )


def test_the_search_picks_the_known_best_pair_of_tensor_parallel_sizes():
    workload = synthetic(300, LengthDist.parse("200"), LengthDist.parse("20"), seed=1)
    slo = SLO(ttft_s=1.5, tpot_s=0.030, attainment=0.9)
    space = SearchSpace(
        chunks=(256, 512),
        max_seqs=(16, 256),
        watermarks=(0.05,),
        threshold_quantiles=(0.5,),
        screen_nodes=4,
        tolerance=0.08,
        final_tolerance=0.05,
    )
    base = Deployment(1, 1, max_num_batched_tokens=256)
    result = search(two_sizes(), workload, slo, 4, space=space, base=base, processes=1)
    best = result.best.deployment
    assert (best.prefill, best.prefill_tp, best.decode, best.decode_tp) == (1, 2, 2, 1)
    assert 17.0 <= result.best.goodput <= 23.0
    # Screened: the two pairs of highest bound ((2, 1) and (1, 1)) and colocated workers.
    pairs = {
        (e.deployment.prefill_tp, e.deployment.decode_tp)
        for e in result.screened
        if not e.deployment.colocated
    }
    assert pairs == {(2, 1), (1, 1)}
    assert any(e.deployment.colocated for e in result.ranked)  # the baseline
    table = candidates_table(search_results(result, top=5))
    assert "| 1P x TP2 + 2D x TP1 | 2 / 1 |" in table.splitlines()[2]
    # Hosts of 3 GPUs take no group of 2: TP 1 alone, where 3P + 1D is best.
    result = search(
        two_sizes(), workload, slo, 4, space=space, base=base, processes=1, gpus_per_host=3
    )
    assert {e.deployment.decode_tp for e in result.screened} == {1}
    assert result.best.deployment.placement == "3P + 1D"


def test_a_tensor_parallel_cluster_file_is_what_launch_takes(tmp_path, capsys):
    p = roofline_profile(LLAMA_70B, "h100")
    d = Deployment(2, 3, max_num_seqs=128, prefill_tp=4, decode_tp=8)
    e = Evaluation(d, 40.0)
    (tmp_path / "pdserve.toml").write_text(coordinator_config(e, p, SLO(2.0, 0.1), 32))
    (tmp_path / "cluster.toml").write_text(cluster_file(e, p, None, gpus_per_host=8))
    spec = load_cluster_file(tmp_path / "cluster.toml")
    assert len(spec.hosts) == 4  # 32 GPUs on hosts of 8
    assert sum(h.num_prefill for h in spec.hosts) == 2
    assert sum(h.num_decode for h in spec.hosts) == 3
    nodes = []
    for host in spec.hosts:
        assert (
            main(["launch", str(tmp_path / "cluster.toml"), "--host", host.name, "--dry-run"]) == 0
        )
        nodes += [n for n in plan(spec, host.name) if n.role != "coordinator"]
    assert "pdserve-coordinator" in capsys.readouterr().out
    sizes = {n.name: engine(n).tensor_parallel_size for n in nodes}
    assert sorted(sizes.values()) == [4, 4, 8, 8, 8]
    for n in nodes:
        gpus = n.env["CUDA_VISIBLE_DEVICES"].split(",")
        assert len(gpus) == sizes[n.name] and engine(n).max_num_seqs == 128
    # pdserve serve --config starts the same sizes.
    from pdserve.coordinator.config import CoordinatorConfig

    roles = CoordinatorConfig.from_toml(tmp_path / "pdserve.toml").node_settings.roles
    assert roles == {"prefill_tensor_parallel_size": 4, "decode_tensor_parallel_size": 8}
