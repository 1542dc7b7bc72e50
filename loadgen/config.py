"""The settings of ``loadgen run`` and ``loadgen compare``: frozen; their flags are generated from them
(:mod:`flying.config`), with the argparse types that read their values."""

from __future__ import annotations

import argparse
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from flying import cli
from flying.cli import non_negative
from flying.config import setting
from loadgen import metrics
from loadgen.trace import PRIORITIES
from loadgen.workload import Lengths, parse_mix

T = TypeVar("T")

API_KEY_ENV = "OPENAI_API_KEY"  # as the openai client reads it
DEFAULT_REQUESTS = 100  # -n without a trace
ARRIVALS, MIX, SESSIONS, CLIENT, OUTPUT = "arrivals", "request mix", "sessions", "client", "output"
DESCRIPTIONS = {
    SESSIONS: "shared-prefix, multi-turn sessions: each of the -n arrivals starts a session that asks --turns "
    "questions (of --input-tokens) one after another, each with the conversation so far"
}


def _words(parse: Callable[[str], T]) -> Callable[[str], T]:
    """``parse`` as an argparse type whose ValueError's words are the error (argparse would say only
    "invalid <function name> value")."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _range(spec: str) -> tuple[float, float]:
    lo, _, hi = spec.partition(":")
    try:
        return float(lo), float(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad rate range {spec!r}; e.g. 2:5 (req/s)") from None


def _slo(spec: str) -> dict[str, float]:
    out = {}
    for part in spec.split(","):
        key, sep, val = part.partition("=")
        if not sep or key not in metrics.SLO_KEYS:
            raise argparse.ArgumentTypeError(
                f"bad SLO {part!r}; e.g. ttft=200,tpot=50 (ms; keys ttft, tpot, e2el)"
            )
        try:
            out[key] = float(val)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad SLO {part!r}: {val!r} is not a number of ms") from None
        if not out[key] > 0:
            raise argparse.ArgumentTypeError(f"bad SLO {part!r}: a bound is above 0 ms")
    return out


def _priority_slo(spec: str) -> tuple[str, dict[str, float]]:
    priority, sep, rest = spec.partition(":")
    if not sep or priority not in PRIORITIES:
        raise argparse.ArgumentTypeError(f"bad priority SLO {spec!r}; e.g. high:ttft=5000 (ms)")
    return priority, _slo(rest)


def base_url(url: str) -> str:
    """``--url`` (an ``argparse`` type): the server's base URL as given, or an OpenAI client's base URL (ending in
    ``/v1``) without it; an http(s) URL with a host."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"must be an http:// or https:// URL with a host, got {url!r}")
    return url.rstrip("/").removesuffix("/v1")


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """``loadgen run``: the endpoint, the workload (arrivals, request mix, sessions), the client, the output."""

    url: str = setting(
        "http://127.0.0.1:8000", "the server's base URL (a trailing /v1 is taken off)", type=base_url
    )
    model: str | None = setting(None, "model name (default: the first of GET /v1/models)")
    api_key: str | None = setting(
        None,
        f"sent as Authorization: Bearer KEY, for a gateway with --api-key-file (default: env {API_KEY_ENV}, "
        "else none)",
    )
    api: Literal["chat", "completions"] = setting("chat", "which endpoint")
    num_requests: int | None = setting(
        None,
        f"requests (or sessions) (default: {DEFAULT_REQUESTS}; with --trace, every row of the trace)",
        flag=("-n", "--num-requests"),
        type=cli.positive(int),
    )
    arrival: Literal["constant", "poisson", "gamma", "two-level"] = setting(
        "poisson", "process", group=ARRIVALS
    )
    rate: float = setting(10.0, "req/s; inf sends all at once", group=ARRIVALS)
    burstiness: float = setting(1.0, "gamma shape (1 = Poisson, < 1 burstier)", group=ARRIVALS)
    low_rate: tuple[float, float] = setting(
        "2:5", "two-level low phase rate range (req/s)", type=_range, group=ARRIVALS
    )
    burst_rate: tuple[float, float] = setting(
        "10:30", "two-level burst phase rate range (req/s)", type=_range, group=ARRIVALS
    )
    low_duration: float = setting(30.0, "two-level low phase length (s)", group=ARRIVALS)
    burst_duration: float = setting(10.0, "two-level burst phase length (s)", group=ARRIVALS)
    trace: Path | None = setting(
        None, "CSV trace to replay, overriding arrivals and lengths (default: none)", group=ARRIVALS
    )
    trace_columns: str | None = setting(
        None,
        "the trace's columns: native | burstgpt | azure | timestamp=COL,input_tokens=COL,... (default: native)",
        group=ARRIVALS,
    )
    trace_time_unit: Literal["s", "ms"] = setting("s", "the trace's timestamps' unit", group=ARRIVALS)
    trace_speed: float = setting(1.0, "replay speed-up factor", type=cli.positive(float), group=ARRIVALS)
    input_tokens: Lengths = setting(
        "32:256", "prompt tokens, e.g. 128, 64:256, normal:200:50", type=_words(Lengths.parse), group=MIX
    )
    output_tokens: Lengths = setting("32:128", "output tokens", type=_words(Lengths.parse), group=MIX)
    priority_mix: dict[str, float] = setting(
        "normal=1",
        f"shares of the classes {', '.join(PRIORITIES)}, e.g. high=0.2,normal=0.8",
        type=_words(parse_mix),
        group=MIX,
    )
    long_share: float = setting(
        0.0,
        "share of long-context requests (in sessions: of turns whose message is long)",
        type=cli.share,
        group=MIX,
    )
    long_input_tokens: Lengths = setting(
        "2048:4096", "their prompt tokens", type=_words(Lengths.parse), group=MIX
    )
    tokenizer: Path | None = setting(
        None,
        "model folder with tokenizer.json, for exact prompt lengths (default: a word per token)",
        group=MIX,
    )
    seed: int = setting(0, "random seed of the workload", group=MIX)
    system_prompts: int = setting(
        0,
        "distinct system prompts the sessions take in turn (0: none)",
        type=non_negative(int),
        group=SESSIONS,
    )
    system_prompt_words: int = setting(
        1500, "words in each system prompt", type=cli.positive(int), group=SESSIONS
    )
    turns: int = setting(1, "questions per session", type=cli.positive(int), group=SESSIONS)
    max_concurrency: int | None = setting(
        None,
        "requests in flight at most, 1 or more (default: no limit)",
        type=cli.positive(int),
        group=CLIENT,
    )
    timeout: float = setting(300.0, "per-request timeout (s)", type=cli.positive(float), group=CLIENT)
    warmup: int = setting(
        0, "requests sent first, one at a time, not counted", type=non_negative(int), group=CLIENT
    )
    continuous_usage: bool = setting(
        True,
        "for servers that reject stream_options.continuous_usage_stats",
        flag="--no-continuous-usage",
        group=CLIENT,
    )
    ignore_eos: bool = setting(True, "do not send ignore_eos", flag="--respect-eos", group=CLIENT)
    slo: dict[str, float] | None = setting(
        None, "goodput SLOs in ms, e.g. ttft=200,tpot=50 (default: none)", type=_slo, group=CLIENT
    )
    priority_slo: tuple[tuple[str, dict[str, float]], ...] = setting(
        (),
        "one priority's goodput SLOs in ms, instead of --slo's (repeat), e.g. high:ttft=5000",
        type=_priority_slo,
        group=CLIENT,
    )
    out: Path | None = setting(
        None, "write OUT.json, OUT.csv and OUT.png (default: print only)", group=OUTPUT
    )
    label: str | None = setting(None, "name of this run in comparisons (default: OUT's name)", group=OUTPUT)
    bucket: float = setting(1.0, "time-series bucket (s)", type=cli.positive(float), group=OUTPUT)
    quiet: bool = setting(False, "no progress line", flag="--quiet", group=OUTPUT)


@dataclass(frozen=True, kw_only=True)
class CompareSettings:
    """``loadgen compare``: the result files (positional) and where to plot them."""

    files: tuple[Path, ...] = ()
    plot: Path | None = setting(None, "overlay their time series in one PNG (default: none)")
