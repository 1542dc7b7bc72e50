"""Workloads: when requests leave (arrival process) and what they carry (prompt, output length, priority).

Prompts are made offline from a fixed word list, so no dataset is downloaded; lengths are measured by the server
(``usage.prompt_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

WORDS = [
    "the",
    "engine",
    "serves",
    "requests",
    "in",
    "data",
    "parallel",
    "mode",
    "and",
    "binds",
    "into",
    "tensor",
    "parallel",
    "groups",
    "when",
    "latency",
    "matters",
    "queue",
    "priority",
    "token",
    "cache",
    "router",
    "gateway",
    "worker",
    "batch",
    "step",
    "prompt",
    "stream",
    "model",
    "weight",
    "shard",
    "group",
    "release",
]


@dataclass(frozen=True)
class PlannedRequest:
    at: float  # seconds after the start of the run
    priority: str
    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    num_requests: int = 50
    rate: float = 10.0  # requests per second
    arrival: str = "poisson"  # poisson | constant
    input_words: tuple[int, int] = (8, 64)
    output_tokens: tuple[int, int] = (16, 48)
    priority_mix: dict[str, float] = field(default_factory=lambda: {"high": 0.2, "normal": 0.6, "low": 0.2})
    seed: int = 0

    def __post_init__(self) -> None:
        assert self.num_requests >= 1 and self.rate > 0, "need >= 1 request and a positive rate"
        assert self.arrival in ("poisson", "constant"), f"unknown arrival process {self.arrival!r}"
        assert abs(sum(self.priority_mix.values()) - 1) < 1e-6, "priority shares must sum to 1"


def arrival_times(w: Workload, rng: np.random.Generator) -> np.ndarray:
    if w.arrival == "constant":
        gaps = np.full(w.num_requests, 1.0 / w.rate)
    else:
        gaps = rng.exponential(1.0 / w.rate, w.num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def make_prompt(n_words: int, rng: np.random.Generator) -> str:
    return " ".join(rng.choice(WORDS, n_words))


def plan(w: Workload) -> list[PlannedRequest]:
    rng = np.random.default_rng(w.seed)
    names, shares = zip(*sorted(w.priority_mix.items()))
    out = []
    for t in arrival_times(w, rng):
        out.append(
            PlannedRequest(
                at=float(t),
                priority=str(rng.choice(names, p=shares)),
                prompt=make_prompt(int(rng.integers(w.input_words[0], w.input_words[1] + 1)), rng),
                max_tokens=int(rng.integers(w.output_tokens[0], w.output_tokens[1] + 1)),
            )
        )
    return out
