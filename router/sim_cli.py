"""``flying-sim``: replay a workload (the paper's, or a CSV trace) through static DP, static TP and dynamic binding
in the simulator, and write the paper-style table, a JSON summary and Figure-8-style plots.

flying-sim --requests 4000 --out sim-out               the paper's two-level workload on 8 simulated H200s
flying-sim --trace my.csv --preset burstgpt --out o    your own trace (loadgen's trace format)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

from loadgen.metrics import RequestRecord, peak_output_throughput, stats, timeseries
from loadgen.trace import PRESETS, read_trace
from router.cost_model import calibration
from router.simulator import SimConfig, SimRequest, Simulator, paper_workload, two_level_phase

MODES = ("dp", "tp", "dynamic")


def summarize(records: list[RequestRecord], phase) -> dict:
    ok = [r for r in records if r.ok]
    ms = lambda rs: [r.ttft * 1000 for r in rs]  # noqa: E731
    by_phase = {p: [r for r in ok if phase(r.sent_at) == p] for p in ("low", "burst")}
    tpots = [r.tpot * 1000 for r in ok if r.tpot is not None]
    cls = {p: [r for r in ok if r.priority == p] for p in ("high", "normal")}
    return {
        "served": len(ok),
        "rejected": sum(1 for r in records if r.status == 400),
        "ttft_p90_burst_ms": stats(ms(by_phase["burst"]))["p90"],
        "ttft_p90_low_ms": stats(ms(by_phase["low"]))["p90"],
        "ttft_mean_ms": stats(ms(ok))["mean"],
        "queue_mean_ms": stats([r.queue_ms for r in ok if r.queue_ms is not None])["mean"],
        "tpot_p50_ms": stats(tpots)["p50"],
        "peak_tokens_per_s": peak_output_throughput(ok, bucket_s=10.0),
        "high_ttft_mean_ms": stats(ms(cls["high"]))["mean"],
        "high_tpot_mean_ms": stats([r.tpot * 1000 for r in cls["high"] if r.tpot is not None])["mean"],
        "normal_ttft_mean_ms": stats(ms(cls["normal"]))["mean"],
        "long_served": sum(1 for r in ok if r.prompt_tokens > 100_000),
    }


ROWS = (
    ("P90 TTFT at burst (ms)", "ttft_p90_burst_ms"),
    ("P90 TTFT at low load (ms)", "ttft_p90_low_ms"),
    ("mean queue time (ms)", "queue_mean_ms"),
    ("median TPOT (ms)", "tpot_p50_ms"),
    ("peak throughput (tokens/s, 10 s)", "peak_tokens_per_s"),
    ("high priority: mean TTFT (ms)", "high_ttft_mean_ms"),
    ("high priority: mean TPOT (ms)", "high_tpot_mean_ms"),
    ("normal: mean TTFT (ms)", "normal_ttft_mean_ms"),
    ("served / rejected (400)", None),
    ("long-context requests served", "long_served"),
)


def table(summary: dict[str, dict]) -> str:
    modes = [m for m in MODES if m in summary]
    lines = [
        "| metric | "
        + " | ".join(f"static {m.upper()}" if m != "dynamic" else "dynamic" for m in modes)
        + " |"
    ]
    lines.append("|---" * (len(modes) + 1) + "|")
    for label, key in ROWS:
        if key is None:
            cells = [f"{summary[m]['served']} / {summary[m]['rejected']}" for m in modes]
        else:
            cells = ["-" if math.isnan(v := summary[m][key]) else f"{v:,.0f}" for m in modes]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(s: dict[str, dict]) -> list[tuple[str, float, float, bool]]:
    """(what, ratio, bound, met) for the issue's three simulation targets."""
    d, dp, tp = s["dynamic"], s["dp"], s["tp"]
    burst = d["ttft_p90_burst_ms"] / dp["ttft_p90_burst_ms"]
    low = d["ttft_p90_low_ms"] / tp["ttft_p90_low_ms"]
    peak = d["peak_tokens_per_s"] / dp["peak_tokens_per_s"]
    return [
        ("dynamic / static DP, P90 TTFT at burst", burst, 1.10, burst <= 1.10),
        ("dynamic / static TP, P90 TTFT at low load", low, 1.10, low <= 1.10),
        ("dynamic / static DP, peak throughput", peak, 0.95, peak >= 0.95),
    ]


def main(argv: list[str] | None = None) -> int:
    d = SimConfig()
    p = argparse.ArgumentParser(prog="flying-sim", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--engines", type=int, default=d.engines)
    p.add_argument(
        "--tp-width", type=int, default=d.tp_width, help="static TP width (dynamic's light width too)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--low-s", type=float, default=60.0)
    p.add_argument("--burst-s", type=float, default=30.0)
    p.add_argument(
        "--input",
        default="512:4096",
        help="prompt tokens lo:hi (uniform; see paper_workload for the default)",
    )
    p.add_argument("--output", default="64:512", help="output tokens lo:hi (uniform)")
    p.add_argument("--high-share", type=float, default=0.1)
    p.add_argument("--long-share", type=float, default=0.0025)
    p.add_argument("--trace", help="CSV trace instead of the synthetic workload")
    p.add_argument("--preset", choices=sorted(PRESETS), default="native")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", type=Path, default=Path("sim-out"))
    a = p.parse_args(argv)
    lo_in, hi_in = (int(x) for x in a.input.split(":"))
    lo_out, hi_out = (int(x) for x in a.output.split(":"))
    if a.trace:
        rows = read_trace(a.trace, PRESETS[a.preset], limit=a.requests)
        reqs = [SimRequest(r.at, r.priority or "normal", r.input_tokens, r.output_tokens) for r in rows]
        phase = lambda t: "all"  # noqa: E731
    else:
        reqs = paper_workload(
            a.requests, a.seed, low_s=a.low_s, burst_s=a.burst_s, input_tokens=(lo_in, hi_in),
            output_tokens=(lo_out, hi_out), high_share=a.high_share, long_share=a.long_share,
        )  # fmt: skip
        phase = lambda t: two_level_phase(t, a.low_s, a.burst_s)  # noqa: E731
    base = dataclasses.replace(d, engines=a.engines, tp_width=a.tp_width)
    base = dataclasses.replace(base, policy=dataclasses.replace(base.policy, light_width=a.tp_width))
    a.out.mkdir(parents=True, exist_ok=True)
    summary, series = {}, {}
    for mode in a.modes.split(","):
        t0 = time.perf_counter()
        sim = Simulator(dataclasses.replace(base, mode=mode), reqs)  # type: ignore[arg-type]
        records = sim.run()
        summary[mode] = summarize(records, phase)
        series["dynamic" if mode == "dynamic" else f"static {mode.upper()}"] = timeseries(records, 5.0)
        print(f"{mode}: {len(records)} requests simulated in {time.perf_counter() - t0:.1f} s "
              f"({len(sim.log)} policy notes)", flush=True)  # fmt: skip
        if mode == "dynamic":
            (a.out / "dynamic-policy.log").write_text("".join(f"{t:9.3f} {n}\n" for t, n in sim.log))
    report = [table(summary), ""]
    if not a.trace and {"dp", "tp", "dynamic"} <= set(summary):
        for what, ratio, bound, met in targets(summary):
            report.append(f"- {what}: {ratio:.3f} (target {'<=' if bound > 1 else '>='} {bound}): "
                          f"{'met' if met else 'NOT met'}")  # fmt: skip
    report += ["", "cost model calibration (model / published):"]
    report += [f"- {what}: {mine:.3f} / {pub:.3f}" for what, mine, pub in calibration(base.cost)]
    text = "\n".join(report)
    print(text)
    (a.out / "table.md").write_text(text + "\n")
    (a.out / "summary.json").write_text(json.dumps({"args": vars(a) | {"out": str(a.out)}, "summary": summary},
                                                   indent=1, default=float))  # fmt: skip
    try:
        from loadgen.plots import timeline

        timeline(series, a.out / "timeline.png", title=f"simulated, {a.engines} engines")
    except ImportError:  # matplotlib is a dependency; a trimmed install still gets the table
        pass
    return 0


def entry() -> None:
    raise SystemExit(main())


if __name__ == "__main__":
    entry()
