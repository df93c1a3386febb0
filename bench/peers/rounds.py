"""Rounds of the peer benchmark: the order the engines run in (alternating round by round, so that
drift in what else the machine runs falls on both alike), and the table of their throughput per
round, the medians and the ratio pdserve / peer."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from pdserve.bench.peers.protocol import RoundResult

ENGINE_NAMES = {"pdserve": "pdserve", "vllm": "vLLM"}


@dataclass(frozen=True, slots=True)
class Run:
    round: int  # from 1
    result: RoundResult
    load_1m: float  # the machine's 1-minute load average at the run's end
    nproc: int  # cores the engines may use

    @property
    def others_share(self) -> float:
        """The CPU time other processes took over the timed part / (wall time x cores): 0 on a
        quiet machine, 1 when other work kept every core busy."""
        r = self.result
        return max(0.0, r.machine_cpu_s - r.cpu_s) / (r.elapsed_s * self.nproc)

    @property
    def cpu_share(self) -> float:
        """The engine's CPU time / (wall time x cores): below 1 when it left cores idle or other
        work took them."""
        return self.result.cpu_s / (self.result.elapsed_s * self.nproc)


def round_order(engines: list[str], rounds: int) -> list[list[str]]:
    """Each round runs every engine once; odd rounds in the given order, even ones reversed."""
    if rounds < 1:
        raise ValueError("at least one round")
    return [list(engines) if r % 2 == 0 else list(reversed(engines)) for r in range(rounds)]


def tokens_per_s(runs: list[Run], engine: str) -> list[float]:
    return [
        r.result.tokens_per_s
        for r in sorted(runs, key=lambda r: r.round)
        if r.result.engine == engine
    ]


def median_tokens_per_s(runs: list[Run], engine: str) -> float:
    return statistics.median(tokens_per_s(runs, engine))


def ratio(runs: list[Run], engine: str, peer: str) -> float:
    """The ratio of the medians, engine / peer."""
    return median_tokens_per_s(runs, engine) / median_tokens_per_s(runs, peer)


def summary(runs: list[Run], engine: str, peer: str) -> dict:
    loads = [r.load_1m for r in runs]
    return {
        f"{engine}_tok_s": tokens_per_s(runs, engine),
        f"{peer}_tok_s": tokens_per_s(runs, peer),
        f"{engine}_median_tok_s": median_tokens_per_s(runs, engine),
        f"{peer}_median_tok_s": median_tokens_per_s(runs, peer),
        "ratio": ratio(runs, engine, peer),
        "load_1m": [min(loads), max(loads)],
    }


def table(runs: list[Run], engine: str, peer: str) -> str:
    """A Markdown table: one row per round (both engines' tok/s, their ratio, the load at the end
    of each run), then the medians and the ratio of the medians."""
    a, b = ENGINE_NAMES.get(engine, engine), ENGINE_NAMES.get(peer, peer)
    lines = [
        f"| round | {a} tok/s | {b} tok/s | {a} / {b} | {a} CPU share | {b} CPU share "
        "| other work's CPU share | load |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for rnd in sorted({r.round for r in runs}):
        mine = {r.result.engine: r for r in runs if r.round == rnd}
        x, y = mine[engine], mine[peer]
        loads = "-".join(f"{v:.1f}" for v in sorted({round(x.load_1m, 1), round(y.load_1m, 1)}))
        lines.append(
            f"| {rnd} | {x.result.tokens_per_s:.1f} | {y.result.tokens_per_s:.1f} "
            f"| {x.result.tokens_per_s / y.result.tokens_per_s:.2f}x "
            f"| {x.cpu_share:.0%} | {y.cpu_share:.0%} "
            f"| {x.others_share:.0%}, {y.others_share:.0%} | {loads} |"
        )
    lines.append(
        f"| **median** | **{median_tokens_per_s(runs, engine):.1f}** "
        f"| **{median_tokens_per_s(runs, peer):.1f}** | **{ratio(runs, engine, peer):.2f}x** "
        "| | | | |"
    )
    return "\n".join(lines)


def runs_from_results(results: dict) -> list[Run]:
    """The runs as a results file of `bench.offline_throughput --peer` holds them."""
    nproc = (results.get("machine") or {}).get("cores") or results["machine"]["nproc"]
    fields = RoundResult.__slots__
    return [
        Run(r["round"], RoundResult(**{k: r[k] for k in fields if k in r}), r["load_1m"], nproc)
        for r in results["rounds"]
    ]


def docs_table(results: dict, engine: str = "pdserve") -> str:
    """`table` of a results file: `engine` (pdserve, or a `--pdserve-variant`'s label) against
    the peer, round by round."""
    return table(runs_from_results(results), engine, results["peer"])
