"""``flying-sim --seeds 0-19``: the systems over many seeds of the paper workload, and per target how many seeds
meet it, the mean and the worst ratio (:data:`TARGETS`). The simulator is deterministic: a seed's result is the
same on every run."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """``dynamic``'s ``metric`` over ``against``'s: the mean over the seeds within ``mean_bound``, every seed
    within ``seed_bound`` (``higher``: at least the bounds, else at most)."""

    what: str
    metric: str
    against: str
    mean_bound: float
    seed_bound: float
    higher: bool = False

    def ratio(self, summary: dict[str, dict]) -> float:
        return summary["dynamic"][self.metric] / summary[self.against][self.metric]

    def meets(self, x: float, bound: float) -> bool:
        return x >= bound if self.higher else x <= bound


TARGETS = (
    Target("P90 TTFT at low load, dynamic / shift", "ttft_p90_low_ms", "shift", 1.00, 1.10),
    Target("mean TTFT in flat periods, dynamic / shift", "ttft_mean_flat_ms", "shift", 1.00, 1.10),
    Target("P90 TTFT at burst, dynamic / static DP", "ttft_p90_burst_ms", "dp", 1.00, 1.10),
    Target("peak throughput, dynamic / static DP", "peak_tokens_per_s", "dp", 0.96, 0.90, higher=True),
)


def parse_seeds(text: str) -> list[int]:
    """``0-19`` or ``1,4,7`` (or both, comma-separated) -> the seeds, in order."""
    out: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.partition("-")
        try:
            out += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
        except ValueError:
            raise ValueError(
                f"--seeds {text!r}: expected FROM-TO or a comma-separated list of seeds"
            ) from None
    if not out:
        raise ValueError(f"--seeds {text!r}: no seeds (FROM-TO needs FROM <= TO)")
    return out


@dataclass(frozen=True)
class TargetResult:
    target: Target
    ratios: tuple[float, ...]  # one per seed (NaN: a metric the seed's run has no value for)

    @property
    def measured(self) -> int:
        """Seeds whose run has a value for the target (a short run may reach no burst)."""
        return sum(1 for x in self.ratios if not math.isnan(x))

    @property
    def met_seeds(self) -> int:
        return sum(1 for x in self.ratios if self.target.meets(x, self.target.seed_bound))

    @property
    def mean(self) -> float:
        ok = [x for x in self.ratios if not math.isnan(x)]
        return sum(ok) / len(ok) if ok else math.nan

    @property
    def worst(self) -> float:
        ok = [x for x in self.ratios if not math.isnan(x)]
        if not ok:
            return math.nan
        return min(ok) if self.target.higher else max(ok)

    @property
    def met(self) -> bool:
        t = self.target
        return t.meets(self.mean, t.mean_bound) and self.met_seeds == len(self.ratios)


def over_seeds(
    seeds: Sequence[int], run: Callable[[int], dict[str, dict]], targets: Sequence[Target] = TARGETS
) -> tuple[list[TargetResult], dict[int, dict[str, dict]]]:
    """``run(seed)`` -> that seed's summary by system; the targets' results over all seeds, and the summaries."""
    summaries = {seed: run(seed) for seed in seeds}
    results = [TargetResult(t, tuple(t.ratio(summaries[s]) for s in seeds)) for t in targets]
    return results, summaries


def seeds_table(results: Sequence[TargetResult], seeds: Sequence[int]) -> str:
    """Markdown: per target, the bounds, how many seeds meet the per-seed bound, the mean and the worst ratio."""
    lines = [
        f"| target ({len(seeds)} seeds) | bound: mean / every seed | seeds met | mean | worst | met |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        t = r.target
        op = ">=" if t.higher else "<="
        bounds = f"{op} {t.mean_bound:.2f} / {op} {t.seed_bound:.2f}"
        if not r.measured:
            lines.append(f"| {t.what} | {bounds} | not measured | - | - | not measured |")
            continue
        unmeasured = len(seeds) - r.measured
        met = f"{r.met_seeds} of {len(seeds)}" + (f" ({unmeasured} not measured)" if unmeasured else "")
        lines.append(
            f"| {t.what} | {bounds} | {met} | {r.mean:.3f} | {r.worst:.3f} | {'yes' if r.met else 'no'} |"
        )
    return "\n".join(lines)
