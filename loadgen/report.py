"""Human-readable summary table of :func:`loadgen.metrics.summarize` output."""

from __future__ import annotations


def _row(name: str, lat: dict) -> str:
    t, p, q = lat["ttft_ms"], lat["tpot_ms"], lat["queue_ms"]
    return (
        f"{name:<8} {t['n']:>5} {t['p50']:>9.1f} {t['p90']:>9.1f} {p['p50']:>9.1f} {p['p90']:>9.1f} "
        f"{q['p50']:>9.1f} {q['p90']:>9.1f}"
    )


def table(summary: dict) -> str:
    head = (
        f"{'class':<8} {'n':>5} {'TTFT p50':>9} {'TTFT p90':>9} {'TPOT p50':>9} {'TPOT p90':>9} "
        f"{'queue p50':>9} {'queue p90':>9}   (ms)"
    )
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
    lines.append(f"client dispatch lag p50 {lag['p50']:.1f} ms  p99 {lag['p99']:.1f} ms")
    if summary["errors"]:
        lines.append("errors: " + ", ".join(f"{k} x{v}" for k, v in summary["errors"].items()))
    return "\n".join(lines)
