"""The search: which deployment of N devices serves a workload with the most goodput under an SLO.

Goodput of a deployment is the highest request rate at which at least `slo.attainment` of the
requests meet both the TTFT and the TPOT target, found by bisection on the rate, each probe a
simulation of the workload at that rate (a probe stops as soon as too many requests have missed).

The space is placement (colocated workers, or P prefill + D decode nodes, with conditional
disaggregation) x each role's tensor-parallel size x `max_num_batched_tokens` x `max_num_seqs` x
`admission_watermark`. A simulation costs in proportion to the tokens it generates, so the space
is searched coarse to fine:
0. TP sizes, by throughput bound alone: colocated workers at the size of highest bound, and the
   `screen_pairs` (prefill TP, decode TP) pairs whose best split has the highest bound;
1. screen, on a slice of the cluster (`screen_nodes` nodes of the larger size, the rate and the
   number of requests scaled down with it, so that requests arrive over the same span of time as
   on every device): those colocated workers and, for each pair, the `screen_splits` P:D splits
   whose throughput bound is highest;
2. refine, on the slice, the best placement one knob at a time (coordinate descent): the knob's
   values either side of its current one, going on while goodput grows (hill climbing);
3. final: the best candidates, and colocated workers as the baseline, on every device with the
   whole workload; a slice's split maps to several on every node, of which the one with the
   highest throughput bound is also tried.
Evaluations of a stage run in parallel processes.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.tune.deployment import Deployment
from pdserve.tune.metrics import Summary, summarize
from pdserve.tune.profile import Profile
from pdserve.tune.simulator import Simulation
from pdserve.tune.slo import SLO
from pdserve.tune.step_model import StepShape
from pdserve.tune.workload import Workload

KV_TIGHT = 0.7  # decode pools fuller than this at goodput: the admission watermark matters
CEILING = 4.0  # probes stay below this multiple of a deployment's throughput bound


@dataclass(frozen=True, slots=True)
class SearchSpace:
    chunks: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)  # max_num_batched_tokens
    max_seqs: tuple[int, ...] = (32, 64, 128, 256, 512)
    watermarks: tuple[float, ...] = (0.0, 0.02, 0.05, 0.1, 0.2)
    # conditional_disagg_threshold, as quantiles of the workload's prompt lengths
    threshold_quantiles: tuple[float, ...] = (0.25, 0.5, 0.75)
    screen_nodes: int = 4
    screen_splits: int = 2  # disaggregated P:D splits simulated, by throughput bound
    min_screen_requests: int = 300  # on the slice, however small it is against every node
    refine_top: int = 1
    final_top: int = 2
    tolerance: float = 0.1  # bisection on the rate: stop when hi / lo - 1 is below this
    final_tolerance: float = 0.05
    # (prefill TP, decode TP) pairs simulated, by throughput bound on every device; colocated
    # workers at the TP size of highest bound.
    screen_pairs: int = 2
    # local_prefill_max_uncached_tokens, as quantiles of the tokens after a shared prefix (a
    # workload with shared prefixes only)
    uncached_quantiles: tuple[float, ...] = (0.5, 0.9)

    @classmethod
    def quick(cls) -> SearchSpace:
        """A few values of each knob, for checking the command itself."""
        return cls((1024, 2048), (64, 256), (0.05,), (0.5,), 4, 2, 100, 1, 2, 0.15, 0.1, 1, (0.5,))


@dataclass(slots=True)
class Probe:
    rate: float
    summary: Summary

    @property
    def attainment(self) -> float:
        return self.summary.attainment


@dataclass(slots=True)
class Evaluation:
    deployment: Deployment
    goodput: float  # requests per second at which the SLO attainment holds (0: not even slowly)
    probes: list[Probe] = field(default_factory=list)
    scale: float = 1.0  # every device / the devices simulated (a slice's)
    # It met the SLO even at CEILING times its throughput bound: the workload arrives as one
    # burst it absorbs, too short to measure a sustained rate.
    burst: bool = False

    @property
    def full_goodput(self) -> float:
        """The goodput on every node: a slice's scaled up."""
        return self.goodput * self.scale

    @property
    def at_goodput(self) -> Summary | None:
        """The run at the goodput rate."""
        passing = [p for p in self.probes if p.rate == self.goodput]
        return passing[0].summary if passing else None


@dataclass(slots=True)
class SearchResult:
    ranked: list[Evaluation]  # the final candidates, best first
    screened: list[Evaluation]  # every placement evaluated on a slice
    devices: int
    seconds: float
    num_simulations: int

    @property
    def best(self) -> Evaluation:
        return self.ranked[0]


# --- one deployment -----------------------------------------------------------------------------


def probe(profile: Profile, d: Deployment, workload: Workload, slo: SLO, rate: float) -> Probe:
    result = Simulation(d, profile).run(workload.at_rate(rate), slo)
    summary = summarize(result.outcomes, slo, rate)
    summary.stopped_early = result.stopped_early
    summary.peak_kv_usage = result.peak_kv_usage
    return Probe(rate, summary)


def max_rate(
    profile: Profile,
    d: Deployment,
    workload: Workload,
    slo: SLO,
    hint: float,
    tolerance: float,
    spread: float = 1.5,
) -> Evaluation:
    """Bisection (geometric) on the rate between a passing and a failing probe, found from
    `hint` in steps of `spread` (small where the hint is good). Rates are kept within a factor
    of CEILING of the deployment's throughput bound: a workload that still passes there is too
    short to tell (the deployment absorbs it as one burst), and the ceiling is reported."""
    probes: list[Probe] = []
    bound = throughput_bound(profile, d, workload, slo)
    ceiling, floor = bound * CEILING, bound / 1000

    def passes(rate: float) -> bool:
        probes.append(probe(profile, d, workload, slo, rate))
        return probes[-1].attainment >= slo.attainment

    hint = min(max(hint, floor), ceiling)
    if passes(hint):
        lo, hi = hint, min(hint * spread, ceiling)
        while hi > lo and passes(hi):
            lo, spread = hi, min(spread * spread, 4.0)  # a poor hint: widen
            hi = min(hi * spread, ceiling)
        if hi <= lo:
            return Evaluation(d, lo, probes, burst=True)
    else:
        lo, hi = max(hint / spread, floor), hint
        while not passes(lo):
            if lo <= floor:
                return Evaluation(d, 0.0, probes)
            spread = min(spread * spread, 4.0)
            lo, hi = max(lo / spread, floor), lo
    while hi / lo - 1 > tolerance:
        mid = math.sqrt(lo * hi)
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return Evaluation(d, lo, probes)


def throughput_bound(profile: Profile, d: Deployment, workload: Workload, slo: SLO) -> float:
    """An optimistic estimate of the requests per second a deployment sustains, from the step and
    transfer models: prefill nodes' prompts per second in full chunks, their links' KV bytes per
    second, and decode nodes' tokens per second at the largest batch that fits their KV pool,
    max_num_seqs and the TPOT target; colocated workers pay for prefill and decode both. It
    orders placements and starts the bisection; the simulation decides."""
    prefill_profile, decode_profile = profile.at_tp(d.prefill_tp), profile.at_tp(d.decode_tp)
    step, prompt, output = prefill_profile.step, workload.mean_prompt_len, workload.mean_output_len
    if d.colocated:
        step = decode_profile.step
    length = max(1, round(prompt))
    per_step = max(1, d.max_num_batched_tokens // length)  # prompts a chunk holds
    if length > d.max_num_batched_tokens:  # one prompt over several chunks
        chunks = -(-length // d.max_num_batched_tokens)
        prefill_s = chunks * step.time(StepShape.prefill(1, length // chunks, length // 2))
    else:
        prefill_s = step.time(StepShape.prefill(per_step, length)) / per_step
    step = decode_profile.step
    context = prompt + output / 2
    # Sequences of the mean prompt and output that the decode pool holds, each its blocks in
    # every KV group (a window's only, in a windowed or chunked one).
    held = profile.model.kv_blocks_held(max(1, round(prompt + output)), profile.block_size)
    fits = decode_profile.kv_blocks // held
    batch = max(1, min(d.max_num_seqs, fits))
    while batch > 1 and step.time(StepShape.decode(batch, round(context))) > slo.tpot_s:
        batch = max(1, batch * 3 // 4)
    decode_s = step.time(StepShape.decode(batch, round(context))) / batch  # one token's share
    if d.colocated:
        return d.decode / (prefill_s + output * decode_s)
    kv_bytes = profile.model.kv_handoff_bytes(length, profile.block_size, profile.dtype)
    transfer_s = prefill_profile.transfer.wire_time(kv_bytes)
    return min(d.prefill / max(prefill_s, transfer_s), d.decode / (output * decode_s))


# --- the search ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Task:
    profile: Profile
    deployment: Deployment
    workload: Workload
    slo: SLO
    hint: float
    tolerance: float
    scale: float
    spread: float = 1.5


def _evaluate(task: _Task) -> Evaluation:
    found = max_rate(
        task.profile,
        task.deployment,
        task.workload,
        task.slo,
        task.hint,
        task.tolerance,
        task.spread,
    )
    found.scale = task.scale
    return found


class _Runner:
    """Evaluates batches of tasks in parallel processes (forked), each deployment once per
    workload: a stage that asks again gets the earlier evaluation."""

    def __init__(self, processes: int, progress: Callable[[int], None]) -> None:
        self.processes = processes
        self.progress = progress
        self.pool = mp.get_context("fork").Pool(processes) if processes > 1 else None
        self.num_simulations = 0
        self.done: dict[tuple[Deployment, int], Evaluation] = {}

    def run(self, tasks: Sequence[_Task]) -> list[Evaluation]:
        key = lambda t: (t.deployment, len(t.workload))  # noqa: E731
        todo = list({key(t): t for t in tasks if key(t) not in self.done}.values())
        self.progress(len(tasks) - len(todo))
        if self.pool is None:
            results = []
            for t in todo:
                results.append(_evaluate(t))
                self.progress(1)
        else:
            results = []
            for r in self.pool.imap(_evaluate, todo):
                results.append(r)
                self.progress(1)
        self.num_simulations += sum(len(r.probes) for r in results)
        self.done.update((key(t), r) for t, r in zip(todo, results))
        return [self.done[key(t)] for t in tasks]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool.join()


def splits(devices: int, prefill_tp: int, decode_tp: int) -> list[tuple[int, int]]:
    """(prefill nodes, decode nodes) of those sizes that use every one of `devices`."""
    out = []
    for p in range(1, devices // prefill_tp + 1):
        rest = devices - p * prefill_tp
        if rest >= decode_tp and rest % decode_tp == 0:
            out.append((p, rest // decode_tp))
    return out


def placements(
    devices: int, base: Deployment, prefill_tp: int = 1, decode_tp: int = 1
) -> list[Deployment]:
    """The P:D splits of `devices` into prefill nodes of `prefill_tp` and decode nodes of
    `decode_tp` devices."""
    return [
        base.with_(prefill=p, decode=q, colocated=False, prefill_tp=prefill_tp, decode_tp=decode_tp)
        for p, q in splits(devices, prefill_tp, decode_tp)
    ]


def colocated(devices: int, base: Deployment, tp: int = 1) -> Deployment | None:
    """Colocated workers of `tp` devices on every one of `devices` (None if they do not divide)."""
    if devices % tp:
        return None
    return base.with_(
        prefill=0,
        decode=devices // tp,
        colocated=True,
        conditional_disagg_threshold=0,
        prefill_tp=tp,
        decode_tp=tp,
    )


def usable_tp_sizes(profile: Profile, devices: int, gpus_per_host: int) -> list[int]:
    """The node sizes the profile models that fit a host (divide its GPUs) and the devices."""
    sizes = [g for g in profile.tp_sizes if g <= devices and (g == 1 or gpus_per_host % g == 0)]
    if not sizes:
        raise ValueError(
            f"the profile models nodes of {profile.tp_sizes} devices: none divides "
            f"--gpus-per-host {gpus_per_host} within {devices} devices"
        )
    return sizes


def slice_devices(devices: int, d: Deployment, screen_nodes: int) -> int:
    """The slice of the cluster a deployment of these TP sizes is screened on: `screen_nodes`
    nodes of its larger size (all of them where there are fewer)."""
    return min(devices, screen_nodes * max(d.prefill_tp, d.decode_tp))


def knob_values(space: SearchSpace, workload: Workload, d: Deployment) -> dict[str, list]:
    values: dict[str, list] = {
        "max_num_batched_tokens": list(space.chunks),
        "max_num_seqs": list(space.max_seqs),
        "admission_watermark": list(space.watermarks),
    }
    if not d.colocated:
        thresholds = sorted(
            {workload.prompt_len_quantile(q) + 1 for q in space.threshold_quantiles}
        )
        values["conditional_disagg_threshold"] = [0, *thresholds]
        uncached = {workload.uncached_len_quantile(q) for q in space.uncached_quantiles} - {None}
        if uncached:
            values["local_prefill_max_uncached_tokens"] = [0, *sorted(u + 1 for u in uncached)]
    return values


def search(
    profile: Profile,
    workload: Workload,
    slo: SLO,
    devices: int,
    space: SearchSpace | None = None,
    base: Deployment | None = None,
    processes: int = 2,
    progress: Callable[[str], None] | None = None,
    gpus_per_host: int = 8,
) -> SearchResult:
    """The best deployments of `devices` devices, with nodes of the sizes the profile models
    that divide `gpus_per_host`, prefill and decode each of its own size."""
    space = space or SearchSpace()
    base = base or Deployment(1, 1)
    say = progress or (lambda _: None)
    started = time.monotonic()
    sizes = usable_tp_sizes(profile, devices, gpus_per_host)
    samples: dict[float, Workload] = {}

    def sample(scale: float) -> Workload:
        if scale not in samples:
            count = max(space.min_screen_requests, round(len(workload) / scale))
            samples[scale] = workload.head(count)
        return samples[scale]

    bar = _bar(progress)
    runner = _Runner(processes, bar.update)
    try:
        # 0. The TP sizes: colocated workers at the size, and the (prefill, decode) pairs, of
        # the highest throughput bound on every device.
        together = [c for g in sizes if (c := colocated(devices, base, g)) is not None]
        pairs = [placements(devices, base, p, q) for p in sizes for q in sizes]
        pairs = [options for options in pairs if options]
        if not together and not pairs:
            raise ValueError(f"{devices} devices make no node of {sizes} devices")

        def bound(c: Deployment) -> float:
            return throughput_bound(profile, c, workload, slo)

        together = sorted(together, key=lambda c: -bound(c))[:1]
        pairs = sorted(pairs, key=lambda options: -max(map(bound, options)))
        pairs = pairs[: space.screen_pairs]
        # 1. Those colocated workers and each pair's splits of highest bound, on a slice.
        candidates: list[tuple[Deployment, float]] = []  # (on the slice, scale)
        for c in together:
            small = slice_devices(devices, c, space.screen_nodes)
            candidates.append((c.with_(decode=small // c.decode_tp), devices / small))
        for options in pairs:
            small = slice_devices(devices, options[0], space.screen_nodes)
            scale = devices / small
            on_slice = placements(small, base, options[0].prefill_tp, options[0].decode_tp)
            if not on_slice:  # no split of the slice: the whole cluster is the slice
                small, scale, on_slice = devices, 1.0, options
            part = sample(scale)
            on_slice.sort(key=lambda c, w=part: -throughput_bound(profile, c, w, slo))
            candidates += [(c, scale) for c in on_slice[: space.screen_splits]]
        hints: dict[float, float] = {}
        for c, scale in candidates:
            hints[scale] = max(
                hints.get(scale, 0.0), 0.7 * throughput_bound(profile, c, sample(scale), slo)
            )
        bar.stage(f"screening {len(candidates)} placements on slices", len(candidates))
        screened = runner.run(
            [
                _Task(profile, c, sample(scale), slo, hints[scale], space.tolerance, scale)
                for c, scale in candidates
            ]
        )
        screened.sort(key=lambda e: -e.full_goodput)
        say(_summary_line("screened", screened[0]))
        # 2. One knob at a time for the best placements.
        refined: list[Evaluation] = []
        for incumbent in screened[: space.refine_top]:
            values = knob_values(space, workload, incumbent.deployment)
            bar.stage(f"refining {incumbent.deployment.placement}", None)
            for knob, options in values.items():
                run = incumbent.at_goodput
                if knob == "admission_watermark" and run and run.peak_kv_usage < KV_TIGHT:
                    continue  # the pools never filled: what is kept free never mattered
                incumbent = _climb(
                    runner, incumbent, knob, options, profile, sample(incumbent.scale), slo, space
                )
            refined.append(incumbent)
            say(_summary_line("refined", incumbent))
        # 3. Every device, the whole workload.
        best_of = {e.deployment: e for e in [*refined, *screened]}
        pool = sorted(best_of.values(), key=lambda e: -e.full_goodput)[: space.final_top]
        # Colocated workers stay in as the baseline disaggregation is measured against.
        pool += [e for e in screened if e.deployment.colocated and e not in pool][:1]
        finals: dict[Deployment, float] = {}
        for rank, e in enumerate(pool):
            for d in _scaled(e.deployment, devices, profile, workload, slo, rank == 0):
                finals.setdefault(d, e.full_goodput)
        bar.stage(
            f"final: {len(finals)} candidates on {devices} devices, {len(workload)} requests",
            len(finals),
        )
        spread = 1 + space.final_tolerance  # the slice's goodput is a good hint: two probes
        tasks = [
            _Task(profile, d, workload, slo, hint, space.final_tolerance, 1.0, spread)
            for d, hint in finals.items()
        ]
        ranked = sorted(runner.run(tasks), key=lambda e: -e.goodput)
    finally:
        runner.close()
        bar.close()
    return SearchResult(
        ranked, screened, devices, time.monotonic() - started, runner.num_simulations
    )


def _climb(
    runner: _Runner,
    incumbent: Evaluation,
    knob: str,
    options: list,
    profile: Profile,
    workload: Workload,
    slo: SLO,
    space: SearchSpace,
) -> Evaluation:
    """Try the knob's values either side of the incumbent's, and go on in the direction that
    gains (by more than half the tolerance) until it stops gaining."""
    current = getattr(incumbent.deployment, knob)
    index = options.index(current) if current in options else None
    if index is None:  # a value the space does not list: start from the closest one listed
        index = min(range(len(options)), key=lambda i: abs(options[i] - current))
    tried = {current}

    def evaluate(indexes: list[int]) -> list[Evaluation]:
        picks = [i for i in indexes if 0 <= i < len(options) and options[i] not in tried]
        tried.update(options[i] for i in picks)
        # Near the incumbent's goodput, a bracket of one tolerance: two probes when it holds.
        tasks = [
            _Task(
                profile,
                incumbent.deployment.with_(**{knob: options[i]}),
                workload,
                slo,
                incumbent.goodput or 1.0,
                space.tolerance,
                incumbent.scale,
                1 + space.tolerance,
            )
            for i in picks
        ]
        return runner.run(tasks)

    found = evaluate([index - 1, index + 1])
    while True:
        better = [e for e in found if e.goodput > incumbent.goodput * (1 + space.tolerance / 2)]
        if not better:
            return incumbent
        best = max(better, key=lambda e: e.goodput)
        new_index = options.index(getattr(best.deployment, knob))
        step = 1 if new_index > index else -1
        incumbent, index = best, new_index
        found = evaluate([index + step])


def _scaled(
    d: Deployment,
    devices: int,
    profile: Profile,
    workload: Workload,
    slo: SLO,
    alternatives: bool,
) -> list[Deployment]:
    """A slice's deployment on every device: its split scaled; with alternatives, also the split
    of highest throughput bound among those the slice's split stands for."""
    if d.colocated:
        return [d.with_(decode=devices // d.decode_tp)]
    scale = devices / d.devices
    out = [_split_near(d, devices, d.prefill * d.prefill_tp * scale)]
    if alternatives and scale > 1:
        lo, hi = ((d.prefill + side) * d.prefill_tp * scale for side in (-0.5, 0.5))
        options = [
            c
            for c in placements(devices, d, d.prefill_tp, d.decode_tp)
            if lo <= c.prefill * c.prefill_tp <= hi
        ]
        if options:
            best = max(options, key=lambda c: throughput_bound(profile, c, workload, slo))
            if best not in out:
                out.append(best)
    return out


def _split_near(d: Deployment, devices: int, prefill_devices: float) -> Deployment:
    """`d`'s TP sizes on `devices` devices, the split whose prefill devices are nearest."""
    options = placements(devices, d, d.prefill_tp, d.decode_tp)
    return min(options, key=lambda c: (abs(c.prefill * c.prefill_tp - prefill_devices), c.prefill))


def _summary_line(stage: str, e: Evaluation) -> str:
    return f"{stage}: {e.deployment.label}: {e.full_goodput:.2f} req/s on every device"


def curves(
    profile: Profile,
    workload: Workload,
    slo: SLO,
    evaluations: Sequence[Evaluation],
    devices: int,
    slice_nodes: int = 4,
    factors: Sequence[float] = (0.6, 0.85, 1.0, 1.2),
    processes: int = 2,
) -> dict[Deployment, list[Summary]]:
    """Each deployment's whole runs (no early stop) at rates around its goodput, simulated on a
    slice of `slice_nodes` nodes (of its larger TP size) as the search screens, rates and
    goodputs scaled to every device."""
    jobs = []
    for e in evaluations:
        d = e.deployment
        small = slice_devices(devices, d, slice_nodes)
        scale = devices / small
        sample = workload.head(max(300, round(len(workload) / scale)))
        if d.colocated:
            part = d.with_(decode=small // d.decode_tp)
        else:
            part = _split_near(d, small, d.prefill * d.prefill_tp / scale)
        jobs += [(profile, part, sample, slo, f * e.goodput / scale, d, scale) for f in factors]
    if processes > 1:
        with mp.get_context("fork").Pool(processes) as pool:
            runs = pool.starmap(_whole_run, [job[:5] for job in jobs])
    else:
        runs = [_whole_run(*job[:5]) for job in jobs]
    out: dict[Deployment, list[Summary]] = {}
    for job, summary in zip(jobs, runs):
        scale = job[6]
        summary.rate *= scale
        summary.goodput *= scale
        summary.throughput *= scale
        out.setdefault(job[5], []).append(summary)
    return out


def _whole_run(profile: Profile, d: Deployment, workload: Workload, slo: SLO, rate: float):
    result = Simulation(d, profile).run(workload.at_rate(rate))
    return summarize(result.outcomes, slo, rate)


class _bar:
    """A progress bar per stage (tqdm), or nothing."""

    def __init__(self, progress: Callable[[str], None] | None) -> None:
        self.enabled = progress is not None
        self.tqdm = None

    def stage(self, text: str, total: int | None) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        self.close()
        self.tqdm = tqdm(total=total, desc=text, unit="deployment", leave=True)

    def update(self, n: int) -> None:
        if self.tqdm is not None:
            self.tqdm.update(n)

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()
            self.tqdm = None
