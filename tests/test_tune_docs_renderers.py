"""The docs' renderers of the tuner's results files: a search's candidates under several SLOs, and
a roofline profile's steps at each node size."""

from pdserve.bench import roofline_steps
from pdserve.tune.report import slo_table


def run(ttft_s: float, tpot_s: float, ranked: list[tuple[str, str, bool, int, float]]) -> dict:
    """A search's results with (placement, tp, colocated, decode nodes or workers, goodput)."""
    return {
        "devices": 16,
        "slo": {"ttft_s": ttft_s, "tpot_s": tpot_s, "attainment": 0.9},
        "ranked": [
            {
                "placement": placement,
                "tp": tp,
                "goodput": goodput,
                "settings": {"colocated": colocated, "decode": decode, "decode_tp": int(tp[-1])},
            }
            for placement, tp, colocated, decode, goodput in ranked
        ],
    }


def test_the_slo_table_names_the_pick_its_ties_and_colocated_workers():
    loose = run(
        2.0,
        0.1,
        [
            ("2P x TP4 + 2D x TP4", "4 / 4", False, 2, 110.2),
            ("4 colocated x TP4", "4", True, 4, 90.1),
        ],
    )
    tight = run(
        0.5,
        0.015,
        [
            ("2 colocated x TP8", "8", True, 2, 41.3),
            ("2P x TP4 + 1D x TP8", "4 / 8", False, 1, 41.28),
        ],
    )
    lines = slo_table(loose, tight).splitlines()
    assert (
        lines[2] == "| 2 s / 100 ms | 2P x TP4 + 2D x TP4 | 4 / 4 | 6.89 | 5.63 (4 x TP4) | 1.22 |"
    )
    assert lines[3] == (
        "| 500 ms / 15 ms | 2 colocated x TP8, tied with 2P x TP4 + 1D x TP8 | 8, or 4 / 8 "
        "| 2.58 | 2.58 (2 x TP8) | 1.00 |"
    )


def test_a_roofline_profile_of_deepseek_v2_lite_keeps_its_latent_on_every_gpu():
    from pdserve.tune.model_shape import model_shape
    from pdserve.tune.roofline import roofline_profile

    profile = roofline_profile(model_shape("deepseek-v2-lite"), "h100")
    nodes = roofline_steps.node_steps(profile, [(128, 3000, "")], [(1, 2670, "prompt")])
    results = {"roofline_device": "h100", "mla": True, "nodes": nodes}
    table = roofline_steps.docs_table(results).splitlines()
    assert table[0].startswith("| node | KV room (tokens) | decode step: 128 sequences at 3,000")
    assert table[2].startswith("| 1 H100 | 1,176,288 | 18.2 ms | 4.8 ms |")
    # The latent reads take as long on eight GPUs as on one: none of them is split.
    reads = {round(n["steps"][0]["context_read_s"], 6) for n in nodes}
    assert len(reads) == 1 and [n["size"] for n in nodes] == [1, 2, 4, 8]
