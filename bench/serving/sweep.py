"""A sweep: the same kind of load at several request rates against one server, one point per
rate. Each point draws its own requests (seed + index), so no point reuses another's prompts
from a prefix cache, while every system swept with the same seed gets the same requests."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from pdserve.bench.serving.cpu_use import CPUUse
from pdserve.tune.load_generator import LoadConfig, format_summary, run_load
from pdserve.tune.serving_workload import RequestSpec
from pdserve.tune.slo import SLO


async def run_sweep(
    sample: Callable[[int, float], list[RequestSpec]],
    rates: Sequence[float],
    cfg: LoadConfig,
    slo: SLO,
    label: str,
    warmup_specs: list[RequestSpec] | tuple[()] = (),
    system: str | None = None,
    variant: str = "",
    verbose: bool = True,
    cpu: Callable[[float], CPUUse] | None = None,
) -> dict:
    """`sample(seed, rate)` gives one point's requests. Returns {"label", "system", "variant", "points"}
    with one `run_load` result per rate, in the order given; with `cpu(rate)`, each result's
    "cpu" is where the server's CPU went during it (`CPUUse.end`)."""
    points = []
    for i, rate in enumerate(rates):
        point_cfg = dataclasses.replace(cfg, rate=rate, seed=cfg.seed + i)
        warm = warmup_specs if i == 0 else ()
        use = cpu(rate) if cpu is not None else None
        if use is not None:
            use.begin()
        run = await run_load(sample(cfg.seed + i, rate), point_cfg, slo, warm)
        if use is not None:
            run["cpu"] = use.end(run["summary"]["output_tokens"])
        if verbose:
            print(f"== {label} @ {rate:g} req/s\n{format_summary(run['summary'])}", flush=True)
        points.append(run)
    return {"label": label, "system": system or label, "variant": variant, "points": points}


def curve(sweep: dict, x: str, y: str) -> list[tuple[float, float]]:
    """(x, y) of every point; names are summary keys, `a.b` for nested ones (`tpot_ms.p99`),
    and `rate` for the offered rate."""

    def get(point: dict, name: str) -> float:
        if name == "rate":
            return float(point["config"]["rate"])
        value = point["summary"]
        for part in name.split("."):
            value = value[part]
        return float(value)

    return [(get(p, x), get(p, y)) for p in sweep["points"]]
