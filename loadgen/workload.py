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
from loadgen.trace import PRIORITIES, TraceRow

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
        if nums[0] < 1:  # a fixed length, a range's low end, a distribution's mean or median
            raise ValueError(f"bad length spec {spec!r}: at least 1 token")
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
class Sessions:
    """Shared-prefix, multi-turn sessions: the workload a prefix cache (and cache-aware dispatch) is for.

    ``system_prompts`` distinct system prompts of ``system_prompt_words`` words each (0: none). Every arrival
    starts a session that takes system prompt ``session % system_prompts`` and asks ``turns`` questions one after
    another: turn k sends the conversation so far plus a new question (of the workload's input length), and
    leaves when turn k - 1 has ended (:mod:`loadgen.conversation`). Sessions run concurrently with one another
    (within the client's concurrency cap), turns within a session never do. A failed turn ends its session: its
    later turns are recorded as failed without being sent."""

    system_prompts: int = 1
    system_prompt_words: int = 1500
    turns: int = 1

    def __post_init__(self) -> None:
        if self.system_prompts < 0 or self.turns < 1 or self.system_prompt_words < 0:
            raise ValueError("sessions need >= 0 system prompts, >= 1 turn and >= 0 system prompt words")


def system_prompt(index: int, words: int, seed: int = 0) -> str:
    """System prompt ``index``: its number first (prompts differ from their first word on), then ``words``
    words."""
    rng = np.random.default_rng([seed, index, 0x5157])  # not the questions' stream (default_rng(seed))
    return f"System {index}: " + " ".join(rng.choice(WORDS, words))


@dataclass(frozen=True)
class Turn:
    """A request's place in a session."""

    session: int
    index: int  # 0-based turn number
    system: str


@dataclass(frozen=True)
class PlannedRequest:
    at: float  # seconds after the start of the run (a later turn of a session: when the turn before it ends)
    priority: str
    prompt: str  # in a session: this turn's question
    max_tokens: int
    input_tokens: int  # the length asked for (the server's count comes back in usage)
    long: bool = False
    turn: Turn | None = None  # None: a request on its own


@dataclass(frozen=True)
class Workload:
    num_requests: int = 50
    arrivals: Arrivals = field(default_factory=Arrivals)
    input_tokens: Lengths = field(default_factory=lambda: Lengths("uniform", 16, 64))
    output_tokens: Lengths = field(default_factory=lambda: Lengths("uniform", 16, 48))
    priority_mix: dict[str, float] = field(default_factory=lambda: {"high": 0.2, "normal": 0.6, "low": 0.2})
    long_share: float = 0.0  # share of long-context requests ...
    # ... and theirs
    long_input_tokens: Lengths = field(default_factory=lambda: Lengths("uniform", 2048, 4096))
    seed: int = 0
    sessions: Sessions | None = None  # num_requests sessions of sessions.turns requests each

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError("need at least one request")
        if unknown := [p for p in self.priority_mix if p not in PRIORITIES]:
            raise ValueError(
                f"unknown priority class {unknown[0]!r} (the classes are {', '.join(PRIORITIES)})"
            )
        if not self.priority_mix or abs(sum(self.priority_mix.values()) - 1) > 1e-6:
            raise ValueError("priority shares must sum to 1")
        if not 0 <= self.long_share <= 1:
            raise ValueError("long-context share must be in [0, 1]")


def parse_mix(spec: str) -> dict[str, float]:
    """``high=0.2,normal=0.8``: shares of the classes high, normal and low (those not named get no requests); the
    shares must sum to 1 (checked by :class:`Workload`)."""
    mix: dict[str, float] = {}
    for part in spec.split(","):
        name, sep, share = part.partition("=")
        name = name.strip()
        try:
            mix[name] = float(share)
        except ValueError:
            raise ValueError(f"bad priority mix {spec!r}; e.g. high=0.2,normal=0.8") from None
        if not sep or not 0 <= mix[name] <= 1:
            raise ValueError(f"bad priority mix {spec!r}; e.g. high=0.2,normal=0.8")
        if name not in PRIORITIES:
            raise ValueError(
                f"bad priority mix {spec!r}: unknown class {name!r} (the classes are {', '.join(PRIORITIES)})"
            )
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
    """The run's requests. A trace fixes arrival times, lengths and (if it has them) priorities. With
    ``w.sessions``, every arrival is a session's first turn, followed by its later turns (same time, priority and
    system prompt)."""
    prompts = prompts or PromptMaker()
    rng = np.random.default_rng(w.seed)
    names, shares = zip(*sorted(w.priority_mix.items()))
    n = len(trace) if trace is not None else w.num_requests
    times = [r.at for r in trace] if trace is not None else w.arrivals.times(n, rng)
    if w.sessions is not None:
        if trace is not None:
            raise ValueError("a trace cannot be replayed as sessions")
        return _sessions(w, w.sessions, times, prompts, rng)
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


def _sessions(
    w: Workload, s: Sessions, times, prompts: PromptMaker, rng: np.random.Generator
) -> list[PlannedRequest]:
    names, shares = zip(*sorted(w.priority_mix.items()))
    systems = [system_prompt(i, s.system_prompt_words, w.seed) for i in range(s.system_prompts)] or [""]
    out = []
    for k in range(w.num_requests):
        prio = str(rng.choice(names, p=shares))
        for t in range(s.turns):
            # a turn's message is long at long_share (a pasted document): the session's later turns carry it too
            long = w.long_share > 0 and rng.random() < w.long_share
            n_in = (w.long_input_tokens if long else w.input_tokens).sample(rng)
            n_out = w.output_tokens.sample(rng)
            turn = Turn(k, t, systems[k % len(systems)])
            out.append(
                PlannedRequest(float(times[k]), prio, prompts(n_in, rng), n_out, n_in, long, turn=turn)
            )
    return out
