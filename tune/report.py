"""What `pdserve tune` hands back: the table of the best candidates, the plot of goodput against
rate, and the winner as files pdserve reads as they are: the coordinator's config
(`pdserve serve --config`) and a cluster file (`pdserve launch`)."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

from pdserve.tune.deployment import Deployment
from pdserve.tune.metrics import Summary
from pdserve.tune.profile import Profile
from pdserve.tune.search import Evaluation, SearchResult
from pdserve.tune.slo import SLO


def _ms(summary: dict | None, key: str) -> str:
    if summary is None:
        return "-"
    d = summary[key]
    return " / ".join(
        "-" if d[p] is None or math.isnan(d[p]) else f"{d[p]:.0f}" for p in ("p50", "p90", "p99")
    )


# --- the results a search hands back, and their tables ------------------------------------------


def evaluation_results(e: Evaluation, shown: Summary | None = None) -> dict:
    """One evaluation as the results file keeps it: the deployment, its goodput on every device,
    its probes, and the run its latencies are shown from (at goodput unless `shown`)."""
    d = e.deployment
    s = shown if shown is not None else e.at_goodput
    return {
        "deployment": d.label,
        "placement": d.placement,
        "tp": d.tp,
        "settings": asdict(d),
        "devices": d.devices,
        "scale": e.scale,
        "goodput": e.full_goodput,
        "burst": e.burst,
        "probes": [{"rate": p.rate * e.scale, "attainment": p.attainment} for p in e.probes],
        "at_goodput": e.at_goodput.to_dict() if e.at_goodput is not None else None,
        "shown": s.to_dict() if s is not None else None,
    }


def search_results(
    result: SearchResult,
    top: int,
    at: dict[Deployment, Summary] | None = None,
    rate: float | None = None,
) -> dict:
    """What `pdserve tune` found, as its results file keeps it: every final candidate (the
    first `top` are the table's), every placement screened on a slice."""
    return {
        "devices": result.devices,
        "seconds": result.seconds,
        "simulations": result.num_simulations,
        "top": top,
        "latencies_at_rate": rate,
        "ranked": [evaluation_results(e, (at or {}).get(e.deployment)) for e in result.ranked],
        "screened": [evaluation_results(e) for e in result.screened],
    }


def candidates_table(results: dict, per: str = "device", top: int | str | None = None) -> str:
    """Best first: placement, knobs, goodput (and per device), latency percentiles at the
    goodput rate (or at the rate given). `per` names a device in the header ("GPU")."""
    head = (
        "| # | placement | TP (P / D) | chunk | max seqs | watermark | goodput (req/s) "
        f"| per {per} | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) |"
    )
    rows = [head, "|" + " --- |" * 10]
    count = int(top) if top is not None else results.get("top", len(results["ranked"]))
    for i, e in enumerate(results["ranked"][:count], 1):
        d = e["settings"]
        rows.append(
            f"| {i} | {e['placement']} | {e['tp']} | {d['max_num_batched_tokens']} "
            f"| {d['max_num_seqs']} | {d['admission_watermark']:g} "
            f"| {'>= ' if e['burst'] else ''}{e['goodput']:.2f} "
            f"| {e['goodput'] / results['devices']:.3f} "
            f"| {_ms(e['shown'], 'ttft_ms')} | {_ms(e['shown'], 'tpot_ms')} |"
        )
    return "\n".join(rows)


def opening(results: dict) -> str:
    """What `pdserve tune` prints before it searches: the profile, the workload, the SLO."""
    slo = results["slo"]
    return "\n".join(
        [
            f"profile: {results['profile']}",
            f"workload: {results['num_requests']} requests, {results['workload']}",
            f"SLO: TTFT <= {slo['ttft_s'] * 1e3:g} ms and TPOT <= {slo['tpot_s'] * 1e3:g} ms for "
            f"{slo['attainment']:.0%} of requests; {results['devices']} devices, nodes of "
            f"{'/'.join(map(str, results['tp_sizes']))} ({results['gpus_per_host']} a host)",
        ]
    )


def outcome(results: dict) -> str:
    """What `pdserve tune` prints after it searched: the table, its warning, the serve command."""
    rate = results.get("latencies_at_rate")
    where = f"at {rate:g} req/s" if rate else "at each one's goodput"
    lines = [
        f"best of {results['simulations']} simulations in {results['seconds']:.0f} s "
        f"(latencies {where}; goodput: the highest rate with "
        f"{results['slo']['attainment']:.0%} within the SLO)",
        "",
        candidates_table(results),
    ]
    if results.get("warning"):
        lines += ["", f"warning: {results['warning']}"]
    if results.get("serve_command"):
        lines += ["", results["serve_command"]]
    if results.get("written"):
        lines.append("wrote " + ", ".join(results["written"]))
    return "\n".join(lines)


def transcript(results: dict) -> str:
    """A search's console, as `pdserve tune` printed it: its command, then what it printed."""
    command = results.get("command", "pdserve tune")
    return "\n".join(["```console", f"$ {command}", opening(results), "", outcome(results), "```"])


def _per_gpu(e: dict, devices: int) -> str:
    return f"{e['goodput'] / devices:.2f}"


def _target(ms: float) -> str:
    return f"{ms / 1e3:g} s" if ms >= 1000 else f"{ms:g} ms"


def slo_table(*runs: dict) -> str:
    """One row per search of the same devices under another SLO: the pick (and any candidate
    tied with it at the shown precision), its goodput per GPU against colocated workers'."""
    rows = [
        "| TTFT / TPOT target (p90) | pick | TP (P / D) | goodput per GPU (req/s) "
        "| colocated workers per GPU (TP) | pick / colocated |",
        "|" + " --- |" * 6,
    ]
    for r in runs:
        devices = r["devices"]
        best = r["ranked"][0]
        tied = [e for e in r["ranked"][1:] if _per_gpu(e, devices) == _per_gpu(best, devices)]
        pick = ", tied with ".join(e["placement"] for e in [best, *tied])
        tp = ", or ".join(e["tp"] for e in [best, *tied])
        together = next((e for e in r["ranked"] if e["settings"]["colocated"]), None)
        if together is None:
            colocated, ratio = "-", "-"
        else:
            s = together["settings"]
            colocated = f"{_per_gpu(together, devices)} ({s['decode']} x TP{s['decode_tp']})"
            ratio = f"{best['goodput'] / together['goodput']:.2f}"
        slo = r["slo"]
        target = f"{_target(slo['ttft_s'] * 1e3)} / {_target(slo['tpot_s'] * 1e3)}"
        rows.append(
            f"| {target} | {pick} | {tp} | {_per_gpu(best, devices)} | {colocated} | {ratio} |"
        )
    return "\n".join(rows)


def plot_curves(
    curves: dict[Deployment, list[Summary]], slo: SLO, out: str | Path, title: str
) -> Path | None:
    """Goodput and SLO attainment against the offered rate, one line per deployment; None
    without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for d, runs in curves.items():
        rates = [s.rate for s in runs]
        left.plot(rates, [s.goodput for s in runs], marker="o", label=d.label)
        right.plot(rates, [s.attainment for s in runs], marker="o", label=d.placement)
    top = max((s.rate for runs in curves.values() for s in runs), default=1.0)
    left.plot([0, top], [0, top], ":", color="grey", label="every request within the SLO")
    left.set_xlabel("offered rate (req/s)")
    left.set_ylabel("goodput (req/s within the SLO)")
    right.axhline(slo.attainment, ls=":", color="grey")
    right.set_xlabel("offered rate (req/s)")
    right.set_ylabel("SLO attainment")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# --- files pdserve reads ------------------------------------------------------------------------


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return str(v)


def _lines(settings: dict) -> list[str]:
    return [f"{k} = {_toml_value(v)}" for k, v in settings.items()]


def node_settings(d: Deployment, profile: Profile) -> dict:
    """The engine settings every node of the winner takes."""
    settings = {"block_size": profile.block_size, **d.engine_settings()}
    if profile.kv_blocks_setting:
        settings["num_kv_blocks"] = profile.kv_blocks
    return settings


def serve_command(d: Deployment, config: str) -> str:
    if d.colocated:
        return f"pdserve serve --config {config} --colocated --decode-nodes {d.decode}"
    return f"pdserve serve --config {config} --prefill-nodes {d.prefill} --decode-nodes {d.decode}"


def coordinator_config(e: Evaluation, profile: Profile, slo: SLO, devices: int) -> str:
    """The coordinator's file: its own settings and the nodes' (docs/configuration.md)."""
    d = e.deployment
    settings = {**d.coordinator_settings(), **node_settings(d, profile), **d.role_settings()}
    settings.pop("block_size")  # the default; the cluster file states it for every node
    header = [
        f"# Written by pdserve tune: {d.placement} on {devices} devices, predicted goodput "
        f"{e.goodput:.2f} req/s",
        f"# (TTFT <= {slo.ttft_s * 1e3:g} ms and TPOT <= {slo.tpot_s * 1e3:g} ms for "
        f"{slo.attainment:.0%} of requests). Profile: {profile.source}",
        f"#   {serve_command(d, 'pdserve.toml')}",
    ]
    if d.colocated:
        header.append(
            "# conditional_disagg_threshold sends every prompt to the node that decodes it: "
            "colocated workers, also under pdserve launch (decode-only hosts)."
        )
    return "\n".join(header + _lines(settings)) + "\n"


def cluster_file(
    e: Evaluation,
    profile: Profile,
    model: str | None,
    gpus_per_host: int,
    config_name: str = "pdserve.toml",
) -> str:
    """The cluster file of `pdserve launch`: every node's GPUs on hosts of `gpus_per_host` (a
    tensor-parallel node within one host), each role's tensor_parallel_size in its table."""
    d = e.deployment
    engine = node_settings(d, profile)
    lines = [
        f"# Written by pdserve tune: {d.placement}, predicted goodput {e.goodput:.2f} req/s.",
        "#   pdserve launch cluster.toml --host NAME      (on every host)",
    ]
    if model:
        lines.append(f"model = {_toml_value(model)}")
    lines += [
        f"dtype = {_toml_value(profile.dtype)}",
        f"block_size = {engine.pop('block_size')}",
        f"coordinator_config = {_toml_value(config_name)}",
        "",
    ]
    gpus = not profile.kv_blocks_setting  # a CPU profile sizes pools in blocks: CPU workers
    if gpus:  # hosts off loopback: launch requires the cluster's keys (docs/security.md)
        lines[-1:-1] = [
            "# The cluster key set: `pdserve keygen /etc/pdserve/cluster-keys`, copied to every host.",
            'cluster_keys = "/etc/pdserve/cluster-keys"',
        ]
    sizes = {"prefill": d.prefill_tp, "decode": d.decode_tp}
    nodes = [("prefill", d.prefill_tp)] * d.prefill + [("decode", d.decode_tp)] * d.decode
    hosts = _hosts(nodes, gpus_per_host if gpus else sum(size for _, size in nodes))
    if len(hosts) > 1:
        lines.append("# Host names and addresses are placeholders: write your hosts'.")
    for index, host in enumerate(hosts):
        name = f"gpu{index}" if gpus else "local"
        address = name if gpus else "127.0.0.1"
        lines += ["[[host]]", f'name = "{name}"', f'address = "{address}"']
        for role in ("prefill", "decode"):
            if role not in host:
                continue
            if gpus:
                lines.append(f"{role}_gpus = {host[role]}")
            else:
                lines.append(f"{role}_workers = {len(host[role]) // sizes[role]}")
        for role in ("prefill", "decode"):
            if role in host:
                lines.append(f"[host.{role}]")
                if sizes[role] > 1:
                    lines.append(f"tensor_parallel_size = {sizes[role]}")
                lines += _lines(engine)
        lines.append("")
    return "\n".join(lines)


def _hosts(nodes: list[tuple[str, int]], gpus_per_host: int) -> list[dict[str, list[int]]]:
    """Nodes (role, GPUs) onto hosts of `gpus_per_host` GPUs, largest first, each into the first
    host with room (sizes that divide the host's GPUs fill every host but the last): each host's
    GPU indices by role, a node's contiguous."""
    hosts: list[dict[str, list[int]]] = []
    free: list[int] = []
    for role, size in sorted(nodes, key=lambda n: -n[1]):
        if size > gpus_per_host:
            raise ValueError(f"a node of {size} GPUs does not fit a host of {gpus_per_host}")
        index = next((i for i, f in enumerate(free) if f >= size), None)
        if index is None:
            hosts.append({})
            free.append(gpus_per_host)
            index = len(hosts) - 1
        first = gpus_per_host - free[index]
        hosts[index].setdefault(role, []).extend(range(first, first + size))
        free[index] -= size
    return hosts


def write_outputs(
    e: Evaluation,
    profile: Profile,
    slo: SLO,
    devices: int,
    out_dir: str | Path,
    model: str | None,
    gpus_per_host: int,
) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = out / "pdserve.toml"
    config.write_text(coordinator_config(e, profile, slo, devices))
    written = [config]
    path = out / "cluster.toml"
    path.write_text(cluster_file(e, profile, model, gpus_per_host, config.name))
    written.append(path)
    return written


# --- sentences of the docs' worked examples, from a search's results ----------------------------


def _colocated(results: dict) -> dict | None:
    return next((e for e in results["ranked"] if e["settings"]["colocated"]), None)


def _seconds(ms: float) -> str:
    return f"{ms / 1e3:.1f} s" if ms >= 1000 else f"{ms:.0f} ms"


def pick_sentence(results: dict, per: str = "GPU") -> str:
    """The pick, its goodput in all and a device, against colocated workers'."""
    devices = results["devices"]
    best = results["ranked"][0]
    text = (
        f"**Pick**: {best['placement']}, predicted {best['goodput']:.0f} requests a second "
        f"({best['goodput'] / devices:.1f} a {per})"
    )
    together = _colocated(results)
    if together is best:  # colocated workers won: against the best disaggregated deployment
        apart = next((e for e in results["ranked"] if not e["settings"]["colocated"]), None)
        if apart is None:
            return text + "."
        return text + (
            f", {best['goodput'] / apart['goodput']:.2f} times {apart['placement']} "
            f"({apart['goodput']:.0f}, {apart['goodput'] / devices:.1f} a {per})."
        )
    if together is None:
        return text + "."
    mine, theirs = best["shown"]["ttft_ms"]["p99"], together["shown"]["ttft_ms"]["p99"]
    return text + (
        f", {best['goodput'] / together['goodput']:.2f} times colocated workers "
        f"({together['placement']}: {together['goodput'] / devices:.1f} a {per}, with a TTFT p99 "
        f"of {_seconds(theirs)} against {_seconds(mine)} at their goodput)."
    )


def screened_sentence(results: dict) -> str:
    """Each disaggregated (prefill TP, decode TP) pair screened: its best split on its slice and
    the goodput it reached there, scaled to every device."""
    best: dict[tuple[int, int], dict] = {}
    for e in results["screened"]:
        s = e["settings"]
        if s["colocated"]:
            continue
        key = (s["prefill_tp"], s["decode_tp"])
        if key not in best or e["goodput"] > best[key]["goodput"]:
            best[key] = e
    ranked = sorted(best.values(), key=lambda e: -e["goodput"])
    slices = ", ".join(f"{e['placement']} on {e['devices']} GPUs" for e in ranked)
    rates = " and ".join(f"{e['goodput']:.0f}" for e in ranked)
    return (
        f"On their slices ({slices}), the (prefill TP, decode TP) pairs screened reached "
        f"{rates} req/s scaled to {results['devices']} GPUs."
    )


def span_sentence(results: dict) -> str:
    """How long the requests take to arrive at the pick's goodput, against what a request may
    take within the SLO: the tuner's warning, or why it gave none."""
    rate, n = results["ranked"][0]["goodput"], results["num_requests"]
    span, budget = results["arrivals_span_s"], results["request_budget_s"]
    text = (
        f"At {rate:.0f} req/s the {n:,} requests arrive over {span:.0f} s, "
        f"{'less' if span < 3 * budget else 'more'} than 3 times the {budget:.0f} s a request of "
        f"mean length may take within this SLO"
    )
    if span < 3 * budget:
        needed = round(3 * budget * rate, -3)
        text += (
            f"; a sustained figure needs about {needed:,.0f} requests "
            f"(3 x {budget:.0f} s at {rate:.0f} req/s)"
        )
    return text + "."


def spans_table(*runs: dict) -> str:
    """For each search of the same devices under another SLO: how long its requests take to
    arrive at the pick's goodput, against what a request may take within the SLO."""
    rows = [
        "| TTFT / TPOT target (p90) | arrivals at the pick's goodput (s) "
        "| a request of mean length within the SLO (s) | the tuner warns | search (s) |",
        "|" + " --- |" * 5,
    ]
    for r in runs:
        slo = r["slo"]
        target = f"{_target(slo['ttft_s'] * 1e3)} / {_target(slo['tpot_s'] * 1e3)}"
        span, budget = r["arrivals_span_s"], r["request_budget_s"]
        rows.append(
            f"| {target} | {span:.0f} | {budget:.0f} | {'yes' if r.get('warning') else 'no'} "
            f"| {r['seconds']:.0f} |"
        )
    return "\n".join(rows)


def search_time_sentence(results: dict) -> str:
    """How long the search took, in what."""
    screened = results["screened"]
    slices = sorted({(e["devices"], e["shown"]["num_requests"]) for e in screened if e["shown"]})
    tokens = results["num_requests"] * results["mean_output_len"]
    cpu = results.get("cpu_seconds")
    cpu_text = f" ({cpu / 60:.1f} min of CPU)" if cpu is not None else ""
    return (
        f"The search took {results['seconds'] / 60:.1f} min{cpu_text}: "
        f"{results['simulations']} simulations ({len(screened)} placements screened on slices of "
        f"{' and '.join(str(d) for d, _ in slices)} GPUs with "
        f"{' and '.join(f'{n:,}' for _, n in slices)} requests, {len(results['ranked'])} finals "
        f"on all {results['devices']} GPUs with all {results['num_requests']:,} requests). A "
        f"final's probe at a rate the deployment sustains generates {tokens / 1e6:.1f} million "
        "tokens."
    )


def workload_sentence(results: dict) -> str:
    """The searched workload's size and mean lengths."""
    return (
        f"The search's {results['num_requests']:,} requests ({results['workload']}): prompts of "
        f"{results['mean_prompt_len']:,.0f} tokens and outputs of "
        f"{results['mean_output_len']:,.0f} on average."
    )
