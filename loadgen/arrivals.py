"""Arrival processes: when each request of an open-loop run leaves, in seconds from the start of the run.

All return a sorted float array of ``n`` times starting at 0. ``rate`` is requests per second; ``inf`` sends
everything at once (use a concurrency cap to make that a closed loop).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

KINDS = ("constant", "poisson", "gamma", "two-level")


@dataclass(frozen=True)
class Arrivals:
    kind: str = "poisson"
    rate: float = 10.0
    burstiness: float = 1.0  # gamma shape: 1 is Poisson, < 1 burstier, > 1 more regular (as in vLLM/SGLang)
    low_rate: tuple[float, float] = (2.0, 5.0)  # two-level: a rate drawn uniformly per low phase
    burst_rate: tuple[float, float] = (10.0, 30.0)  # ... and per burst phase
    low_s: float = 30.0  # phase durations
    burst_s: float = 10.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown arrival process {self.kind!r}; choose one of {', '.join(KINDS)}")
        if not self.rate > 0:
            raise ValueError("rate must be positive (inf sends every request at once)")
        if not self.burstiness > 0:
            raise ValueError("burstiness must be positive")
        for lo, hi in (self.low_rate, self.burst_rate):
            if not 0 < lo <= hi:
                raise ValueError("two-level rates need 0 < low <= high")
        if not (self.low_s > 0 and self.burst_s > 0):
            raise ValueError("two-level phase durations must be positive")

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "two-level":
            return two_level(n, rng, self.low_rate, self.burst_rate, self.low_s, self.burst_s)
        if math.isinf(self.rate):
            return np.zeros(n)
        if self.kind == "constant":
            gaps = np.full(n, 1.0 / self.rate)
        elif self.kind == "poisson":
            gaps = rng.exponential(1.0 / self.rate, n)
        else:
            gaps = rng.gamma(self.burstiness, 1.0 / (self.rate * self.burstiness), n)
        gaps[0] = 0.0
        return np.cumsum(gaps)


def two_level(
    n: int,
    rng: np.random.Generator,
    low_rate: tuple[float, float],
    burst_rate: tuple[float, float],
    low_s: float,
    burst_s: float,
    anchor: bool = True,
) -> np.ndarray:
    """The paper's pattern: Poisson arrivals whose rate alternates between a low phase (a rate drawn from
    ``low_rate``) and a burst phase (from ``burst_rate``), starting low. Phases are memoryless, so an arrival
    that would fall past the end of a phase is redrawn at the next phase's rate from the boundary. With
    ``anchor`` the times start at 0; without, they stay on the phase clock (phase k starts at k-th boundary)."""
    out: list[float] = []
    t, phase_end, burst = 0.0, low_s, False
    rate = rng.uniform(*low_rate)
    while len(out) < n:
        nxt = t + rng.exponential(1.0 / rate)
        if nxt < phase_end:
            out.append(nxt)
            t = nxt
            continue
        t, burst = phase_end, not burst
        rate = rng.uniform(*(burst_rate if burst else low_rate))
        phase_end = t + (burst_s if burst else low_s)
    a = np.asarray(out)
    return a - a[0] if anchor else a
