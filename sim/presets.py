"""Synthetic workloads shaped like public LLM-serving traces (``flying-sim --preset NAME`` without ``--trace``).

No trace can be downloaded where the simulator is built, so these are *synthetic*: request lengths and arrivals
drawn from distributions whose shape and medians follow what the traces' papers publish. They are not the traces
and not fitted to them; a user with the real CSV runs it with ``--trace FILE --preset NAME`` (the column names are
:data:`loadgen.trace.PRESETS`). What each follows:

- ``azure`` (Azure LLM inference trace 2023, *conversation*; Splitwise, Patel et al., ISCA 2024): prompt median
  about 1,020 tokens, output median about 129 tokens, both log-normal-like with long right tails;
- ``azure-code`` (the same trace's *coding* part): prompt median about 1,500 tokens, output median about 13 tokens
  (short completions);
- ``burstgpt`` (BurstGPT, Wang et al. 2024, ChatGPT/GPT-4 conversation logs in Azure OpenAI): request lengths with
  a Zipf-like power-law tail, response lengths with a bimodal shape (short answers and long ones), bursty arrivals
  whose inter-arrival times follow a Gamma distribution with a shape below 1.

The Azure traces' arrivals are bursty too; here every preset draws Gamma inter-arrival times (shape ``burstiness``:
1 is Poisson, below 1 burstier) around a rate that itself alternates slowly between a quieter and a busier level,
so the runs have quiet stretches and bursts. The mean rate is set for one node of 8 engines (the paper's cluster)
at about the paper workload's average load; ``--nodes N`` scales it. Phases for the report (``low`` / ``burst``)
come from the arrivals themselves (:func:`rate_phase`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sim.workload import SimRequest


@dataclass(frozen=True)
class Preset:
    """A synthetic workload's shape: log-normal prompt/output lengths (median, sigma), bounds, arrivals."""

    name: str
    follows: str  # the published source, for --help and reports
    prompt_median: float
    prompt_sigma: float
    output_median: float
    output_sigma: float
    rate: tuple[float, float]  # requests per second per node: the quieter and the busier level
    level_s: float = 60.0  # seconds each level lasts on average (exponential)
    burstiness: float = 0.5  # Gamma shape of the inter-arrival times
    prompt_zipf: float = 0.0  # > 0: prompt lengths from a Zipf-like power law of this exponent instead
    output_long_share: float = 0.0  # bimodal outputs: this share drawn around output_long_median
    output_long_median: float = 0.0
    max_prompt: int = 16_000
    max_output: int = 2_000
    high_share: float = 0.1


PRESETS: dict[str, Preset] = {
    "azure": Preset(
        "azure",
        "Azure LLM inference trace 2023, conversation (Splitwise, ISCA 2024): prompt median ~1,020, "
        "output median ~129 tokens",
        1020,
        0.9,
        129,
        0.9,
        (3.0, 12.0),
    ),
    "azure-code": Preset(
        "azure-code",
        "Azure LLM inference trace 2023, coding (Splitwise, ISCA 2024): prompt median ~1,500, "
        "output median ~13 tokens",
        1500,
        0.9,
        13,
        1.0,
        (3.0, 15.0),
        max_output=1000,
    ),
    "burstgpt": Preset(
        "burstgpt",
        "BurstGPT (Wang et al. 2024): Zipf-like request lengths, bimodal response lengths, "
        "Gamma inter-arrivals with shape < 1",
        600,
        0.0,
        60,
        0.7,
        (3.0, 15.0),
        burstiness=0.3,
        prompt_zipf=2.0,
        output_long_share=0.5,
        output_long_median=400,
    ),
}


# the real trace's column names (loadgen.trace.PRESETS) for a preset, with --trace
TRACE_COLUMNS = {"azure-code": "azure"}


def preset_workload(name: str, n: int = 4000, seed: int = 0, nodes: int = 1) -> list[SimRequest]:
    """``n`` requests of preset ``name`` (:data:`PRESETS`), arrival rates times ``nodes``."""
    p = PRESETS[name]
    rng = np.random.default_rng(seed)
    times = arrivals(p, n, rng, nodes)
    prompts = prompt_lengths(p, n, rng)
    outputs = output_lengths(p, n, rng)
    high = rng.random(n) < p.high_share
    return [
        SimRequest(at=float(t), priority="high" if h else "normal", prompt=int(i), output=int(o))
        for t, i, o, h in zip(times, prompts, outputs, high)
    ]


def arrivals(p: Preset, n: int, rng: np.random.Generator, nodes: int) -> np.ndarray:
    """Gamma inter-arrival times (shape ``burstiness``) around a rate that switches between ``p.rate``'s two
    levels after exponential stretches of mean ``level_s``."""
    out: list[float] = []
    t, level, until = 0.0, 0, rng.exponential(p.level_s)
    while len(out) < n:
        rate = p.rate[level] * nodes
        t += rng.gamma(p.burstiness, 1.0 / (rate * p.burstiness))
        while t >= until:
            level, until = 1 - level, until + rng.exponential(p.level_s)
        out.append(t)
    a = np.array(out)
    return a - a[0]


def prompt_lengths(p: Preset, n: int, rng: np.random.Generator) -> np.ndarray:
    if p.prompt_zipf:  # a power law whose median is prompt_median: P(X > x) = (x / x_min) ** -(zipf - 1)
        a = p.prompt_zipf - 1
        x_min = p.prompt_median / 2 ** (1 / a)
        x = x_min * rng.random(n) ** (-1 / a)
    else:
        x = rng.lognormal(np.log(p.prompt_median), p.prompt_sigma, n)
    return np.clip(x, 16, p.max_prompt).astype(int)


def output_lengths(p: Preset, n: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.lognormal(np.log(p.output_median), p.output_sigma, n)
    if p.output_long_share:
        long = rng.random(n) < p.output_long_share
        x = np.where(long, rng.lognormal(np.log(p.output_long_median), 0.5, n), x)
    return np.clip(x, 1, p.max_output).astype(int)


def rate_phase(times: list[float], window_s: float = 10.0, factor: float = 1.5) -> Callable[[float], str]:
    """``burst`` where the arrival rate over the preceding ``window_s`` exceeds ``factor`` times the run's mean,
    else ``low``."""
    t = np.sort(np.asarray(times))
    mean = len(t) / max(t[-1] - t[0], 1e-9) if len(t) > 1 else 0.0

    def phase(x: float) -> str:
        n = np.searchsorted(t, x, side="right") - np.searchsorted(t, x - window_s, side="left")
        return "burst" if n / window_s > factor * mean else "low"

    return phase
