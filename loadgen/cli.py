"""``loadgen``: drive an OpenAI-style endpoint (the flying-serving gateway, or any SGLang/vLLM server) with an
open-loop workload and report serving metrics; ``loadgen compare`` puts result files side by side.

    loadgen run --url http://localhost:8000 --arrival two-level --num-requests 4000 --priority-mix high=0.2,normal=0.8 --out results/dynamic
    loadgen run --url http://localhost:8000 --rate inf --max-concurrency 8 -n 32 --system-prompts 8 --turns 4 --out results/sessions
    loadgen compare results/static-dp.json results/dynamic.json --plot results/compare.png
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import urllib.parse
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TypeVar

import httpx

from flying import cli
from flying.cli import HelpFormatter, non_negative
from loadgen import metrics, plots, report, results, runner
from loadgen.arrivals import Arrivals
from loadgen.trace import PRIORITIES, parse_columns, read_trace
from loadgen.workload import Lengths, PromptMaker, Sessions, Workload, parse_mix, plan

T = TypeVar("T")

API_KEY_ENV = "OPENAI_API_KEY"  # as the openai client reads it
DEFAULT_REQUESTS = 100  # -n without a trace
DESCRIPTION = " ".join(__doc__.split("\n\n")[0].replace("``", "").split())


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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loadgen", description=DESCRIPTION, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser(
        "run",
        help="run a workload against an endpoint",
        description="Run a workload against an OpenAI-style endpoint and report serving metrics.",
        formatter_class=HelpFormatter,
    )
    r.add_argument(
        "--url",
        type=base_url,
        default="http://127.0.0.1:8000",
        help="the server's base URL (a trailing /v1 is taken off)",
    )
    r.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    r.add_argument(
        "--api-key",
        default=None,
        help=f"sent as Authorization: Bearer KEY, for a gateway with --api-key-file (default: env {API_KEY_ENV}, "
        "else none)",
    )
    r.add_argument("--api", choices=("chat", "completions"), default="chat", help="which endpoint")
    r.add_argument(
        "-n",
        "--num-requests",
        type=cli.positive(int),
        default=None,
        help=f"requests (or sessions) (default: {DEFAULT_REQUESTS}; with --trace, every row of the trace)",
    )
    a = r.add_argument_group("arrivals")
    a.add_argument(
        "--arrival", choices=("constant", "poisson", "gamma", "two-level"), default="poisson", help="process"
    )
    a.add_argument("--rate", type=float, default=10.0, help="req/s; inf sends all at once")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson, < 1 burstier)")
    a.add_argument("--low-rate", type=_range, default="2:5", help="two-level low phase rate range (req/s)")
    a.add_argument(
        "--burst-rate", type=_range, default="10:30", help="two-level burst phase rate range (req/s)"
    )
    a.add_argument("--low-duration", type=float, default=30.0, help="two-level low phase length (s)")
    a.add_argument("--burst-duration", type=float, default=10.0, help="two-level burst phase length (s)")
    a.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="CSV trace to replay, overriding arrivals and lengths (default: none)",
    )
    a.add_argument(
        "--trace-columns",
        default=None,
        help="the trace's columns: native | burstgpt | azure | timestamp=COL,input_tokens=COL,... (default: native)",
    )
    a.add_argument("--trace-time-unit", choices=("s", "ms"), default="s", help="the trace's timestamps' unit")
    a.add_argument("--trace-speed", type=cli.positive(float), default=1.0, help="replay speed-up factor")
    m = r.add_argument_group("request mix")
    m.add_argument(
        "--input-tokens",
        type=_words(Lengths.parse),
        default="32:256",
        help="prompt tokens, e.g. 128, 64:256, normal:200:50",
    )
    m.add_argument("--output-tokens", type=_words(Lengths.parse), default="32:128", help="output tokens")
    m.add_argument(
        "--priority-mix",
        type=_words(parse_mix),
        default="normal=1",
        help=f"shares of the classes {', '.join(PRIORITIES)}, e.g. high=0.2,normal=0.8",
    )
    m.add_argument(
        "--long-share",
        type=cli.share,
        default=0.0,
        help="share of long-context requests (in sessions: of turns whose message is long)",
    )
    m.add_argument(
        "--long-input-tokens", type=_words(Lengths.parse), default="2048:4096", help="their prompt tokens"
    )
    m.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="model folder with tokenizer.json, for exact prompt lengths (default: a word per token)",
    )
    m.add_argument("--seed", type=int, default=0, help="random seed of the workload")
    s = r.add_argument_group(
        "sessions",
        "shared-prefix, multi-turn sessions: each of the -n arrivals starts a session that asks --turns "
        "questions (of --input-tokens) one after another, each with the conversation so far",
    )
    s.add_argument(
        "--system-prompts",
        type=non_negative(int),
        default=0,
        help="distinct system prompts the sessions take in turn (0: none)",
    )
    s.add_argument(
        "--system-prompt-words", type=cli.positive(int), default=1500, help="words in each system prompt"
    )
    s.add_argument("--turns", type=cli.positive(int), default=1, help="questions per session")
    c = r.add_argument_group("client")
    c.add_argument(
        "--max-concurrency",
        type=cli.positive(int),
        default=None,
        help="requests in flight at most, 1 or more (default: no limit)",
    )
    c.add_argument("--timeout", type=cli.positive(float), default=300.0, help="per-request timeout (s)")
    c.add_argument(
        "--warmup", type=non_negative(int), default=0, help="requests sent first, one at a time, not counted"
    )
    c.add_argument(
        "--no-continuous-usage",
        action="store_true",
        help="for servers that reject stream_options.continuous_usage_stats",
    )
    c.add_argument("--respect-eos", action="store_true", help="do not send ignore_eos")
    c.add_argument(
        "--slo", type=_slo, default=None, help="goodput SLOs in ms, e.g. ttft=200,tpot=50 (default: none)"
    )
    c.add_argument(
        "--priority-slo",
        type=_priority_slo,
        action="append",
        default=[],
        help="one priority's goodput SLOs in ms, instead of --slo's (repeat), e.g. high:ttft=5000",
    )
    o = r.add_argument_group("output")
    o.add_argument(
        "--out", type=Path, default=None, help="write OUT.json, OUT.csv and OUT.png (default: print only)"
    )
    o.add_argument("--label", default=None, help="name of this run in comparisons (default: OUT's name)")
    o.add_argument("--bucket", type=cli.positive(float), default=1.0, help="time-series bucket (s)")
    o.add_argument("--quiet", action="store_true", help="no progress line")

    cmp_ = sub.add_parser(
        "compare",
        help="put result files side by side",
        description="Put the .json files of loadgen run --out side by side.",
        formatter_class=HelpFormatter,
    )
    cmp_.add_argument("files", nargs="+", type=Path, help="result files (.json) of loadgen run --out")
    cmp_.add_argument(
        "--plot", type=Path, default=None, help="overlay their time series in one PNG (default: none)"
    )
    return p


def base_url(url: str) -> str:
    """``--url`` (an ``argparse`` type): the server's base URL as given, or an OpenAI client's base URL (ending in
    ``/v1``) without it; an http(s) URL with a host."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"must be an http:// or https:// URL with a host, got {url!r}")
    return url.rstrip("/").removesuffix("/v1")


def discover_model(url: str, api_key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=10)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        why = "; pass --api-key or set " + API_KEY_ENV if _status(exc) == 401 else ""
        raise SystemExit(
            f"loadgen: cannot list models at {url}/v1/models ({exc}{why}); pass --model"
        ) from None


def _status(exc: Exception) -> int | None:
    return exc.response.status_code if isinstance(exc, httpx.HTTPStatusError) else None


def sessions(a: argparse.Namespace) -> Sessions | None:
    if not a.system_prompts and a.turns == 1:
        return None
    return Sessions(a.system_prompts, a.system_prompt_words, a.turns)


def _check_out(out: Path) -> None:
    """Before the run, not after it: its results would be lost."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SystemExit(f"loadgen: --out {out}: cannot write there ({exc.strerror})") from None
    if not os.access(out.parent, os.W_OK):
        raise SystemExit(f"loadgen: --out {out}: cannot write there (no permission)")


def _argv_shown(argv: list[str]) -> list[str]:
    """The command line as a result file keeps it: an API key given on it is left out."""
    out, hide = [], False
    for arg in argv:
        out.append("***" if hide else "--api-key=***" if arg.startswith("--api-key=") else arg)
        hide = arg == "--api-key"
    return out


def cmd_run(a: argparse.Namespace) -> int:
    if a.tokenizer is not None and not (Path(a.tokenizer) / "tokenizer.json").is_file():
        raise SystemExit(f"loadgen: --tokenizer {a.tokenizer}: no tokenizer.json there (a model directory)")
    if a.out is not None:
        _check_out(a.out)
    if a.trace_columns is not None and a.trace is None:
        raise SystemExit("loadgen: --trace-columns describes a --trace file; none was given")
    trace = None
    if a.trace:
        columns = parse_columns(a.trace_columns or "native")
        trace = read_trace(a.trace, columns, a.trace_time_unit, a.trace_speed, a.num_requests)
        if not trace:
            raise SystemExit(f"loadgen: {a.trace}: the trace has no rows")
    arrivals = Arrivals(
        a.arrival, a.rate, a.burstiness, a.low_rate, a.burst_rate, a.low_duration, a.burst_duration
    )
    workload = Workload(
        a.num_requests or (len(trace) if trace else DEFAULT_REQUESTS),
        arrivals,
        a.input_tokens,
        a.output_tokens,
        a.priority_mix,
        a.long_share,
        a.long_input_tokens,
        a.seed,
        sessions(a),
    )
    requests = plan(workload, PromptMaker(a.tokenizer), trace)
    api_key = a.api_key if a.api_key is not None else os.environ.get(API_KEY_ENV) or None
    cfg = runner.RunConfig(
        base_url=a.url,
        model=a.model or discover_model(a.url, api_key),
        api=a.api,
        timeout_s=a.timeout,
        max_concurrency=a.max_concurrency,
        warmup=a.warmup,
        continuous_usage=not a.no_continuous_usage,
        ignore_eos=not a.respect_eos,
        api_key=api_key,
    )
    span = requests[-1].at
    print(
        f"loadgen: {len(requests)} requests over {span:.1f} s to {cfg.base_url} ({cfg.model}, {cfg.api})",
        file=sys.stderr,
    )
    progress = report.Progress(len(requests), enabled=not a.quiet)
    records, duration = _run_loop(runner.run(cfg, requests, on_done=progress))
    config = {
        "label": a.label or (a.out.stem if a.out else None),
        "run": {**asdict(cfg), "api_key": "***" if api_key else None},
        "workload": {**asdict(workload), "trace": str(a.trace) if a.trace else None},
        "argv": _argv_shown(sys.argv[1:]),
    }
    summary = _report(a, config, records, duration)
    return 0 if summary["completed"] else 1


def _report(
    a: argparse.Namespace, config: dict, records: list[metrics.RequestRecord], duration: float
) -> dict:
    """The run's summary printed, and with --out its files: the records are written first, whatever fails after
    them (a summary or series that cannot be made is null in the .json; a plot that cannot be drawn is left out)."""
    summary = series = None
    try:
        summary = metrics.summarize(records, duration, a.slo, dict(a.priority_slo))
        series = metrics.timeseries(records, a.bucket) if a.out else None
    finally:
        written = results.write(a.out, config, summary, series, records) if a.out else None
    print(report.table(summary))
    for line in report.failures(records):
        print("  " + line)
    if written and series is not None:
        print(f"wrote {written[0]}, {written[1]}")
        png = a.out.with_suffix(".png")
        try:
            plots.timeline({config["label"]: series}, png)
        except Exception as exc:  # a plot is not worth the run, whose results are written
            print(f"loadgen: {png} not drawn ({exc!r}); the results are in {written[0]}", file=sys.stderr)
        else:
            print(f"wrote {png}")
    return summary


def _run_loop(coro):
    """uvloop when installed (it is, with SGLang): a cheaper event loop means a smaller dispatch lag."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def cmd_compare(a: argparse.Namespace) -> int:
    docs = {}
    for f in a.files:
        doc = results.read(f)
        label = doc["config"].get("label") or f.stem
        docs[label if label not in docs else f"{label} ({f})"] = doc
    print(report.compare({k: d["summary"] for k, d in docs.items()}))
    if a.plot:
        print(f"wrote {plots.timeline({k: d['series'] for k, d in docs.items()}, a.plot)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    a = _parser().parse_args(argv)
    try:
        return cmd_run(a) if a.cmd == "run" else cmd_compare(a)
    except (ValueError, OSError) as exc:
        print(f"loadgen: {exc}", file=sys.stderr)
        return 2


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
