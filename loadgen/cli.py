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
from dataclasses import asdict
from pathlib import Path

import httpx

from flying.cli import HelpFormatter
from flying.config import add_flags, from_flags
from loadgen import metrics, plots, report, results, runner
from loadgen.arrivals import Arrivals
from loadgen.config import API_KEY_ENV, DEFAULT_REQUESTS, DESCRIPTIONS, CompareSettings, RunSettings
from loadgen.trace import parse_columns, read_trace
from loadgen.workload import PromptMaker, Sessions, Workload, plan

DESCRIPTION = " ".join(__doc__.split("\n\n")[0].replace("``", "").split())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loadgen", description=DESCRIPTION, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser(
        "run",
        help="run a workload against an endpoint",
        description="Run a workload against an OpenAI-style endpoint and report serving metrics.",
        formatter_class=HelpFormatter,
    )
    add_flags(r, RunSettings, DESCRIPTIONS)
    c = sub.add_parser(
        "compare",
        help="put result files side by side",
        description="Put the .json files of loadgen run --out side by side.",
        formatter_class=HelpFormatter,
    )
    c.add_argument("files", nargs="+", type=Path, help="result files (.json) of loadgen run --out")
    add_flags(c, CompareSettings)
    return p


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


def sessions(a: RunSettings) -> Sessions | None:
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


def cmd_run(a: RunSettings) -> int:
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
        continuous_usage=a.continuous_usage,
        ignore_eos=a.ignore_eos,
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


def _report(a: RunSettings, config: dict, records: list[metrics.RequestRecord], duration: float) -> dict:
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
    if written and series is not None and a.out is not None:
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


def cmd_compare(a: CompareSettings) -> int:
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
        if a.cmd == "run":
            return cmd_run(from_flags(RunSettings, a))
        return cmd_compare(from_flags(CompareSettings, a, files=tuple(a.files)))
    except (ValueError, OSError) as exc:
        print(f"loadgen: {exc}", file=sys.stderr)
        return 2


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
