"""The policy live: the 2-engine CPU stack with the router's defaults (``devstack.cluster``: a private Redis, two
CPU workers with the tiny model, the router, the gateway) under ``loadgen run --arrival two-level`` for about ten
minutes, ``flyctl watch`` sampled meanwhile; then the router's decision log (``flying:router:decisions``): the
answers by status, every bind and release with the admission rate that followed it (a bind should meet low load,
a release a burst), binds per minute and the shortest time between two switches (flapping shows there), and how
many requests ran in TP groups or in DP. On this CPU both engines share two cores, so the latency win of TP at low
load cannot show; this checks behaviour.

    PYTHONPATH=. .venv/bin/python benchmarks/live_modes.py --minutes 10 --out results/live-modes
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from benchmarks._loadgen import run_loadgen
from devstack import mode_track
from devstack.cluster import Cluster, ClusterConfig
from flying.messages import DecisionEvent
from worker_ext.tinymodel import ensure

WINDOW_S = 10.0  # the load a decision met: requests admitted in the WINDOW_S after it (per second)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0, help="about how long the load runs")
    p.add_argument("--low-rate", default="0.3:0.6", help="req/s of the low phases (two-level)")
    p.add_argument("--burst-rate", default="4:6", help="req/s of the bursts")
    p.add_argument("--low-s", type=float, default=60.0)
    p.add_argument("--burst-s", type=float, default=20.0)
    p.add_argument("--sample-s", type=float, default=10.0, help="flyctl watch's interval")
    p.add_argument("--out", type=Path, default=Path("results/live-modes"))
    a = p.parse_args()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    model = ensure(Path(".flying/tiny-llama"), seed=0)
    cfg = ClusterConfig(model_path=model, num_engines=2, log_dir=a.out.parent / f"{a.out.name}-logs")
    load = [
        "--arrival",
        "two-level",
        "--low-rate",
        a.low_rate,
        "--burst-rate",
        a.burst_rate,
        "--low-duration",
        str(a.low_s),
        "--burst-duration",
        str(a.burst_s),
        "-n",
        str(requests(a)),
        "--input-tokens",
        "32:256",
        "--output-tokens",
        "16:128",
        "--priority-mix",
        "high=0.2,normal=0.8",
        "--tokenizer",
        str(model),
        "--seed",
        "0",
    ]
    with Cluster(cfg, progress=print) as cluster:
        started = time.time()
        watch = watch_flyctl(cluster, a.out.with_name(a.out.name + "-flyctl.txt"), a.sample_s, a.minutes)
        try:
            run_loadgen(cluster.config.gateway_url, a.out, *load)
        finally:
            watch.terminate()
            watch.wait(10)
        ended = time.time()
        r = cluster.client()
        events = mode_track.decision_log(r, cluster.keys, started)
        admitted = admission_times(r, cluster)
        modes = mode_track.modes(r, cluster.keys, started, ended)
    records = json.loads(a.out.with_suffix(".json").read_text())["records"]
    report = summarize(records, events, admitted, modes, started, ended)
    a.out.with_name(a.out.name + "-report.json").write_text(json.dumps(report, indent=1))
    track = [
        f"t={e.ts - started:7.1f}s  then {rate_after(admitted, e.ts):4.1f} req/s  {e.text}" for e in events
    ]
    a.out.with_name(a.out.name + "-track.txt").write_text("\n".join(track) + "\n")
    print("\n".join(track))
    print(json.dumps(report, indent=1))


def requests(a: argparse.Namespace) -> int:
    """About as many requests as the two-level schedule sends in ``--minutes``."""
    mid = lambda spec: sum(float(x) for x in spec.split(":")) / 2  # noqa: E731
    cycle = a.low_s + a.burst_s
    return int(a.minutes * 60 / cycle * (mid(a.low_rate) * a.low_s + mid(a.burst_rate) * a.burst_s))


def watch_flyctl(cluster: Cluster, out: Path, interval: float, minutes: float) -> subprocess.Popen:
    """``flyctl watch`` writing to ``out`` (its screen clears stripped when read back)."""
    env = {**os.environ, "FLYING_REDIS_URL": cluster.redis_url}
    count = int(minutes * 60 / interval) + 30
    cmd = [
        sys.executable,
        "-m",
        "flyctl.cli",
        "--key-prefix",
        cluster.keys.prefix,
        "watch",
        "--interval",
        str(interval),
        "--count",
        str(count),
    ]
    return subprocess.Popen(cmd, stdout=out.open("w"), stderr=subprocess.STDOUT, env=env)


def admission_times(r, cluster: Cluster) -> list[float]:
    """When each request of the run was admitted (its record's ``enqueued_at``), sorted."""
    times = [r.hget(k, "enqueued_at") for k in r.scan_iter(match=cluster.keys.request("*"), count=500)]
    return sorted(float(t) for t in times if t is not None)


def rate_after(admitted: list[float], ts: float) -> float:
    return sum(1 for t in admitted if ts <= t <= ts + WINDOW_S) / WINDOW_S


def summarize(
    records: list[dict],
    events: list[DecisionEvent],
    admitted: list[float],
    modes: mode_track.PhaseModes,
    started: float,
    ended: float,
) -> dict:
    """The figures the live check reports."""
    recs = [r for r in records if not r["warmup"]]
    switches = [e for e in events if e.kind in ("bind", "release")]
    gaps = [b.ts - a.ts for a, b in zip(switches, switches[1:])]
    minutes = (ended - started) / 60
    return {
        "requests": len(recs),
        "statuses": dict(Counter(str(r["status"] or r["error"][:60]) for r in recs)),
        "minutes": minutes,
        "tp": modes.tp,
        "dp": modes.dp,
        "binds": sum(e.kind == "bind" for e in events),
        "releases": sum(e.kind == "release" for e in events),
        "binds_per_minute": mode_track.binds_per_minute(events, ended - started),
        "shortest_gap_between_switches_s": min(gaps) if gaps else None,
        "rate_after_binds": [round(rate_after(admitted, e.ts), 2) for e in events if e.kind == "bind"],
        "rate_after_releases": [round(rate_after(admitted, e.ts), 2) for e in events if e.kind == "release"],
        "release_causes": dict(Counter(e.cause for e in events if e.kind == "release")),
    }


if __name__ == "__main__":
    main()
