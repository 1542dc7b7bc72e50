"""Workloads: when requests leave (arrivals or a trace) and what they carry (prompt, output length, priority).

Prompts are made offline from a fixed word list, so no dataset is downloaded. With a tokenizer (a model folder
holding ``tokenizer.json``) prompts are cut to the requested token count; without one a word stands for a token.
Either way the length the server saw comes back in ``usage.prompt_tokens`` and is what the metrics use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loadgen.arrivals import Arrivals
from loadgen.trace import TraceRow

_TEXT = (
    "the engine serves requests in data parallel mode and binds into tensor parallel groups when latency "
    "matters queue priority token cache router gateway worker batch step prompt stream model weight shard "
    "group release"
)
WORDS = _TEXT.split(" ")


@dataclass(frozen=True)
class Lengths:
    """Token counts: ``fixed:n`` (or ``n``), ``uniform:lo:hi`` (or ``lo:hi``, inclusive), ``normal:mean:std``,
    ``lognormal:median:sigma``; always >= 1."""

    dist: str = "uniform"
    a: float = 16
    b: float = 64

    @classmethod
    def parse(cls, spec: str) -> Lengths:
        parts = spec.split(":")
        if parts[0] not in ("fixed", "uniform", "normal", "lognormal"):
            parts = (["fixed"] if len(parts) == 1 else ["uniform"]) + parts
        try:
            nums = [float(x) for x in parts[1:]]
        except ValueError:
            raise ValueError(f"bad length spec {spec!r}") from None
        if len(nums) != (1 if parts[0] == "fixed" else 2) or min(nums) < 0:
            raise ValueError(f"bad length spec {spec!r}; e.g. 128, 64:256, normal:200:50, lognormal:200:0.6")
        if parts[0] == "uniform" and nums[0] > nums[1]:
            raise ValueError(f"bad length spec {spec!r}: low > high")
        return cls(parts[0], nums[0], nums[1] if len(nums) > 1 else nums[0])

    def sample(self, rng: np.random.Generator) -> int:
        if self.dist == "fixed":
            x = self.a
        elif self.dist == "uniform":
            x = float(rng.integers(int(self.a), int(self.b) + 1))
        elif self.dist == "normal":
            x = rng.normal(self.a, self.b)
        else:
            x = self.a * np.exp(rng.normal(0.0, self.b))
        return max(1, int(round(float(x))))


@dataclass(frozen=True)
class PlannedRequest:
    at: float  # seconds after the start of the run
    priority: str
    prompt: str
    max_tokens: int
    input_tokens: int  # the length asked for (the server's count comes back in usage)
    long: bool = False


@dataclass(frozen=True)
class Workload:
    num_requests: int = 50
    arrivals: Arrivals = field(default_factory=Arrivals)
    input_tokens: Lengths = field(default_factory=lambda: Lengths("uniform", 16, 64))
    output_tokens: Lengths = field(default_factory=lambda: Lengths("uniform", 16, 48))
    priority_mix: dict[str, float] = field(default_factory=lambda: {"high": 0.2, "normal": 0.6, "low": 0.2})
    long_share: float = 0.0  # share of long-context requests ...
    long_input_tokens: Lengths = field(
        default_factory=lambda: Lengths("uniform", 2048, 4096)
    )  # ... and theirs
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError("need at least one request")
        if not self.priority_mix or abs(sum(self.priority_mix.values()) - 1) > 1e-6:
            raise ValueError("priority shares must sum to 1")
        if not 0 <= self.long_share <= 1:
            raise ValueError("long-context share must be in [0, 1]")


def parse_mix(spec: str) -> dict[str, float]:
    """``high=0.2,normal=0.8``: classes not named get no requests; the shares must sum to 1."""
    mix: dict[str, float] = {}
    for part in spec.split(","):
        name, sep, share = part.partition("=")
        try:
            mix[name.strip()] = float(share)
        except ValueError:
            raise ValueError(f"bad priority mix {spec!r}; e.g. high=0.2,normal=0.8") from None
        if not sep or mix[name.strip()] < 0:
            raise ValueError(f"bad priority mix {spec!r}; e.g. high=0.2,normal=0.8")
    return mix


class PromptMaker:
    """Random word prompts of a target token length (exact with a tokenizer, one word per token without)."""

    def __init__(self, tokenizer_dir: str | Path | None = None) -> None:
        self.tok = None
        if tokenizer_dir is not None:
            from tokenizers import Tokenizer

            self.tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))

    def __call__(self, n_tokens: int, rng: np.random.Generator) -> str:
        words = " ".join(rng.choice(WORDS, n_tokens))
        if self.tok is None:
            return words
        ids = self.tok.encode(words, add_special_tokens=False).ids[:n_tokens]
        return self.tok.decode(ids)


def plan(
    w: Workload, prompts: PromptMaker | None = None, trace: list[TraceRow] | None = None
) -> list[PlannedRequest]:
    """The run's requests. A trace fixes arrival times, lengths and (if it has them) priorities."""
    prompts = prompts or PromptMaker()
    rng = np.random.default_rng(w.seed)
    names, shares = zip(*sorted(w.priority_mix.items()))
    n = len(trace) if trace is not None else w.num_requests
    times = [r.at for r in trace] if trace is not None else w.arrivals.times(n, rng)
    out = []
    for i in range(n):
        row = trace[i] if trace is not None else None
        long = row is None and w.long_share > 0 and rng.random() < w.long_share
        if row is not None:
            n_in, n_out = row.input_tokens, row.output_tokens
        else:
            n_in = (w.long_input_tokens if long else w.input_tokens).sample(rng)
            n_out = w.output_tokens.sample(rng)
        prio = row.priority if row is not None and row.priority else str(rng.choice(names, p=shares))
        out.append(PlannedRequest(float(times[i]), prio, prompts(n_in, rng), n_out, n_in, long))
    return out
