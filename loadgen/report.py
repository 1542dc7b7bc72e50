"""Terminal output: the summary table of :func:`loadgen.metrics.summarize`, the side-by-side comparison of
several result files, and the live progress line."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence

from loadgen.metrics import RequestRecord


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None or x != x else format(x, fmt)


def _row(name: str, lat: dict) -> str:
    t, p, q = lat["ttft_ms"], lat["tpot_ms"], lat["queue_ms"]
    cells = (
        t["p50"],
        t["p90"],
        t["p99"],
        p["p50"],
        p["p90"],
        lat["itl_per_token_ms"]["p50"],
        q["p50"],
        q["p90"],
    )
    return f"{name:<8} {t['n']:>5} " + " ".join(f"{_f(c):>9}" for c in cells)


def _span(span: list[float] | None) -> str:
    return f" (ended {span[0]:.1f}-{span[1]:.1f} s)" if span else ""


def table(summary: dict) -> str:
    names = ("TTFT p50", "TTFT p90", "TTFT p99", "TPOT p50", "TPOT p90", "ITL p50", "queue p50", "queue p90")
    head = f"{'class':<8} {'n':>5} " + " ".join(f"{n:>9}" for n in names) + "   (ms)"
    lines = [head, "-" * len(head), _row("all", summary)]
    lines += [_row(p, lat) for p, lat in summary["by_priority"].items()]
    lines.append("-" * len(head))
    lines.append(
        f"requests {summary['requests']}  completed {summary['completed']}  failed {summary['failed']}  "
        f"duration {summary['duration_s']:.1f} s"
    )
    lines.append(
        f"output throughput {summary['output_throughput']:.1f} tok/s  (peak {summary['peak_output_throughput']:.0f} "
        f"tok/s over 1 s)  total {summary['total_throughput']:.1f} tok/s"
    )
    lag = summary["dispatch_lag_ms"]
    lines.append(f"client dispatch lag p50 {_f(lag['p50'])} ms  p99 {_f(lag['p99'])} ms")
    if summary.get("cache_hit_rate") is not None:
        lines.append(
            f"prefix cache: {summary['cached_tokens']} of {summary['prompt_tokens']} prompt tokens cached "
            f"({summary['cache_hit_rate']:.1%})"
        )
    if "goodput" in summary:
        slos = {"": summary["slo_ms"], **summary.get("slo_ms_by_priority", {})}
        slo = "; ".join(
            f"{p + ': ' if p else ''}" + ", ".join(f"{k} <= {v:g} ms" for k, v in s.items())
            for p, s in slos.items()
            if s
        )
        per = ", ".join(f"{p} {g:.2f}" for p, g in summary.get("goodput_by_priority", {}).items())
        lines.append(f"goodput {summary['goodput']:.2f} req/s ({per})  ({slo})")
    if summary.get("tokens_counted_client_side"):
        lines.append(
            f"note: {summary['tokens_counted_client_side']} requests had no usage; tokens counted from events"
        )
    if summary["errors"]:
        spans = summary.get("errors_span_s", {})
        lines.append(
            "errors: " + ", ".join(f"{k} x{v}{_span(spans.get(k))}" for k, v in summary["errors"].items())
        )
    return "\n".join(lines)


COMPARE_ROWS = (
    ("completed", lambda s: s["completed"], "d"),
    ("failed", lambda s: s["failed"], "d"),
    ("TTFT p50 ms", lambda s: s["ttft_ms"]["p50"], ".1f"),
    ("TTFT p90 ms", lambda s: s["ttft_ms"]["p90"], ".1f"),
    ("TTFT p99 ms", lambda s: s["ttft_ms"]["p99"], ".1f"),
    ("TPOT p50 ms", lambda s: s["tpot_ms"]["p50"], ".2f"),
    ("TPOT p90 ms", lambda s: s["tpot_ms"]["p90"], ".2f"),
    ("ITL/token p50 ms", lambda s: s["itl_per_token_ms"]["p50"], ".2f"),
    ("E2EL p90 ms", lambda s: s["e2el_ms"]["p90"], ".1f"),
    ("queue p90 ms", lambda s: s["queue_ms"]["p90"], ".1f"),
    ("output tok/s", lambda s: s["output_throughput"], ".1f"),
    ("peak output tok/s", lambda s: s["peak_output_throughput"], ".0f"),
    ("goodput req/s", lambda s: s.get("goodput"), ".2f"),
    (
        "prefix cache hit %",
        lambda s: None if s.get("cache_hit_rate") is None else 100 * s["cache_hit_rate"],
        ".1f",
    ),
    ("dispatch lag p99 ms", lambda s: s["dispatch_lag_ms"]["p99"], ".1f"),
)


def _class_ttft_p90(cls: str) -> Callable[[dict], float | None]:
    return lambda s: s["by_priority"].get(cls, {}).get("ttft_ms", {}).get("p90")


def _failed(kind: str) -> Callable[[dict], int]:
    return lambda s: s.get("errors", {}).get(kind, 0)


def compare(summaries: dict[str, dict]) -> str:
    """Runs side by side, one column each; a high-priority TTFT row per run that has the class."""
    labels = list(summaries)
    w = max(12, *(len(x) for x in labels))
    rows = list(COMPARE_ROWS)
    for kind in sorted({k for s in summaries.values() for k in s.get("errors", {})}):
        rows.append((f"failed: {kind}"[:20], _failed(kind), "d"))
    for cls in ("high", "normal", "low"):
        if any(cls in s["by_priority"] for s in summaries.values()):
            rows.append((f"{cls} TTFT p90 ms", _class_ttft_p90(cls), ".1f"))
    lines = [f"{'metric':<20} " + " ".join(f"{x:>{w}}" for x in labels)]
    lines.append("-" * len(lines[0]))
    for name, get, fmt in rows:
        cells = []
        for s in summaries.values():
            v = get(s)
            cells.append(f"{_f(v, fmt) if fmt != 'd' else str(v):>{w}}")
        lines.append(f"{name:<20} " + " ".join(cells))
    return "\n".join(lines)


class Progress:
    """A live progress line on stderr, redrawn at most ``hz`` times a second (cheap at hundreds of req/s); where
    stderr is no terminal (a log file, a pipe), a line at each tenth of the run instead of redraws."""

    def __init__(self, total: int, stream=sys.stderr, hz: float = 8.0, enabled: bool = True) -> None:
        self.total, self.stream, self.period, self.enabled = total, stream, 1.0 / hz, enabled
        self.done = self.failed = 0
        self._last = 0.0
        self._tty = bool(getattr(stream, "isatty", lambda: False)())
        self._tenth = 0

    def __call__(self, rec: RequestRecord) -> None:
        if rec.warmup:
            return
        self.done += 1
        self.failed += not rec.ok
        if self.enabled and not self._tty:
            if (tenth := 10 * self.done // max(1, self.total)) > self._tenth:
                self._tenth = tenth
                self.stream.write(f"  {self.done}/{self.total} done, failed {self.failed}\n")
                self.stream.flush()
            return
        now = time.monotonic()
        if self.enabled and (now - self._last >= self.period or self.done == self.total):
            self._last = now
            bar = "#" * (30 * self.done // self.total)
            self.stream.write(f"\r  [{bar:<30}] {self.done}/{self.total}  failed {self.failed}")
            if self.done == self.total:
                self.stream.write("\n")
            self.stream.flush()


def failures(records: Sequence[RequestRecord], limit: int = 3) -> list[str]:
    return [f"request {r.index}: {r.error or r.status}" for r in records if not r.ok and not r.warmup][:limit]
