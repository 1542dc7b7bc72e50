"""The planner against static DP, static TP and Shift Parallelism on many workloads (the simulator, router defaults).

Each workload runs ``flying-sim --modes dp,tp,shift,dynamic``; for each one the table gives dynamic's P90 TTFT at
bursts, P90 TTFT at low load and mean TTFT over the best other system's (lower is better), and its peak throughput
over the best other's (higher is better), then the mean over workloads. Real traces are read from ``--traces DIR``
(the Azure LLM inference traces 2023: ``AzureLLMInferenceTrace_conv.csv`` and ``_code.csv``), as recorded and
compressed in time; the synthetic presets need no files.

    PYTHONPATH=. .venv/bin/python benchmarks/planner_workloads.py --traces /tmp/traces --jobs 2
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import subprocess
import sys
import tempfile
from pathlib import Path

METRICS = (
    ("burst P90", "ttft_p90_burst_ms", False),
    ("low P90", "ttft_p90_low_ms", False),
    ("mean TTFT", "ttft_mean_ms", False),
    ("peak", "peak_tokens_per_s", True),
)
TRACES = {"conv": "AzureLLMInferenceTrace_conv.csv", "code": "AzureLLMInferenceTrace_code.csv"}


def workloads(traces: Path | None, speeds: list[float]) -> list[tuple[str, list[str]]]:
    out = [(f"preset {p}", ["--preset", p]) for p in ("azure", "azure-code", "burstgpt")]
    for name, file in TRACES.items():
        path = traces / file if traces else None
        if path is None or not path.is_file():
            continue
        out += [
            (f"{name} x{k:g}", ["--trace", str(path), "--preset", "azure", "--trace-speed", str(k)])
            for k in speeds
        ]
    return out


def run(job: tuple[str, list[str]]) -> tuple[str, dict]:
    name, args = job
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            [sys.executable, "-m", "sim.cli", *args, "--modes", "dp,tp,shift,dynamic", "--out", out],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return name, json.loads((Path(out) / "summary.json").read_text())["summary"]


def ratios(summary: dict) -> dict[str, tuple[float, str]]:
    out = {}
    for what, key, higher in METRICS:
        others = {m: v[key] for m, v in summary.items() if m != "dynamic" and not math.isnan(v[key])}
        d = summary["dynamic"][key]
        if not others or math.isnan(d):
            continue
        best = (max if higher else min)(others, key=others.__getitem__)
        out[what] = (d / others[best], best)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", type=Path, help="folder with the Azure 2023 trace CSVs")
    p.add_argument("--speeds", default="1,2,3", help="trace speeds (1: as recorded)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated workload names to run (default: all)")
    a = p.parse_args()
    jobs = workloads(a.traces, [float(x) for x in a.speeds.split(",")])
    if a.only:
        jobs = [j for j in jobs if j[0] in a.only.split(",")]
    print("| workload | " + " | ".join(m[0] for m in METRICS) + " |")
    print("|---" * (len(METRICS) + 1) + "|", flush=True)
    sums: dict[str, list[float]] = {m[0]: [] for m in METRICS}
    with multiprocessing.Pool(a.jobs) as pool:
        for name, summary in pool.imap_unordered(run, jobs):
            r = ratios(summary)
            cells = []
            for what, _, _ in METRICS:
                if what in r:
                    sums[what].append(r[what][0])
                    cells.append(f"{r[what][0]:.2f} ({r[what][1]})")
                else:
                    cells.append("-")
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    print("| mean | " + " | ".join(f"{sum(v) / len(v):.2f}" if v else "-" for v in sums.values()) + " |")
    print(
        "| worst | "
        + " | ".join(f"{(min if m[2] else max)(sums[m[0]]):.2f}" if sums[m[0]] else "-" for m in METRICS)
        + " |"
    )


if __name__ == "__main__":
    main()
