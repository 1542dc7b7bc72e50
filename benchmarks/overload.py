"""Overload through the full stack: a private Redis, CPU workers with the tiny model, the router and the gateway
(``devstack.cluster``), then ``loadgen run`` with an open-loop Poisson load well beyond what the engines serve.
Reports when the first 429 came after the overload's onset (a watcher thread polls, every 0.1 s on one clock, the
engines' heartbeats and the queue's depth for the first moment requests wait anywhere, and the gateway's
``flying_gateway_refused`` counter for the first refusal; also, from loadgen's records, when the first 429 and the
first request that waited in the global queue were sent), each class's queue wait of the admitted requests
(P50/P99, against its wait budget), the answers by status, and goodput: requests finished with a TTFT within
their class's SLO.

    PYTHONPATH=. .venv/bin/python benchmarks/overload.py --out results/overload
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks._loadgen import run_loadgen
from devstack.cluster import Cluster, ClusterConfig
from flying.messages import Heartbeat, decode
from worker_ext.tinymodel import ensure

# the gateway's default wait budgets: the TTFT SLOs here
BUDGETS_S = {
    "high": 5.0,
    "normal": 20.0,
    "low": 60.0,
}
QUEUED_MS = 250.0  # a queue wait beyond a router round or two: the request waited for a free slot


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=40.0)
    p.add_argument("-n", "--num-requests", type=int, default=1500)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--priority-mix", default="high=0.2,normal=0.6,low=0.2")
    p.add_argument("--out", type=Path, default=Path("results/overload"))
    p.add_argument("--gateway-arg", action="append", default=[], help="extra flying-gateway flag (repeat)")
    p.add_argument("--router-arg", action="append", default=[], help="extra flying-router flag (repeat)")
    a = p.parse_args()
    model = ensure(Path(".flying/tiny-llama"), seed=0)
    cfg = ClusterConfig(
        model_path=model,
        num_engines=a.engines,
        log_dir=a.out.parent / f"{a.out.name}-logs",
        gateway_args=tuple(a.gateway_arg),
        router_args=tuple(a.router_arg),
    )
    load = [
        "--arrival",
        "poisson",
        "--rate",
        str(a.rate),
        "-n",
        str(a.num_requests),
        "--input-tokens",
        "32:256",
        "--output-tokens",
        "16:128",
        "--priority-mix",
        a.priority_mix,
        "--tokenizer",
        str(model),
    ]
    with Cluster(cfg, progress=print) as cluster:
        watch = Onset(cluster)
        watch.start()
        try:
            run_loadgen(cluster.config.gateway_url, a.out, *load)
        finally:
            watch.stop()
    records = json.loads(a.out.with_suffix(".json").read_text())["records"]
    report = summarize(records) | watch.report()
    a.out.with_name(a.out.name + "-report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


class Onset(threading.Thread):
    """Every 0.1 s: do requests wait anywhere (the engines' heartbeats report waiting ones, or the global queue
    holds some), and has the gateway refused any (its ``flying_gateway_refused`` counter)? The first time of
    each, on this thread's clock."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(daemon=True)
        self.cluster, self.done = cluster, threading.Event()
        self.waiting_at: float | None = None
        self.refused_at: float | None = None

    def run(self) -> None:
        r, keys = self.cluster.client(), self.cluster.keys
        engines = [keys.worker(i) for i in range(self.cluster.config.num_engines)]
        metrics = self.cluster.config.gateway_url + "/metrics"
        while not self.done.wait(0.1) and self.refused_at is None:
            now = time.monotonic()
            if self.waiting_at is None:
                beats = [decode(raw, Heartbeat) for raw in r.mget(engines) if raw]
                if any(hb.waiting for hb in beats) or r.zcard(keys.queue):
                    self.waiting_at = now
            try:
                text = urllib.request.urlopen(metrics, timeout=5).read().decode()
            except OSError:
                continue
            if any(
                line.startswith("flying_gateway_refused_total{") and float(line.split()[-1]) > 0
                for line in text.splitlines()
            ):
                self.refused_at = now

    def stop(self) -> None:
        self.done.set()
        self.join(10)

    def report(self) -> dict:
        gap = None
        if self.waiting_at is not None and self.refused_at is not None:
            gap = self.refused_at - self.waiting_at
        return {"first_refusal_after_onset_s": gap}


def summarize(records: list[dict]) -> dict:
    """The figures this benchmark reports, from loadgen's request records (run clock in s)."""
    recs = [r for r in records if not r["warmup"]]
    ok = [r for r in recs if r["status"] == 200 and not r["error"] and r["event_times"]]
    refused = sorted(r["sent_at"] for r in recs if r["status"] == 429)
    # the overload's onset: the first request that waited in the queue for an engine (the engines' slots full)
    queued = sorted(r["sent_at"] for r in ok if (r["queue_ms"] or 0) > QUEUED_MS)
    duration = max(_end(r) for r in recs) - min(r["sent_at"] for r in recs)
    good = [r for r in ok if r["event_times"][0] - r["sent_at"] <= BUDGETS_S[r["priority"]]]
    by_class = {}
    for prio, budget in BUDGETS_S.items():
        waits = [r["queue_ms"] / 1000 for r in ok if r["priority"] == prio and r["queue_ms"] is not None]
        ttfts = [r["event_times"][0] - r["sent_at"] for r in ok if r["priority"] == prio]
        by_class[prio] = {
            "budget_s": budget,
            "sent": sum(1 for r in recs if r["priority"] == prio),
            "served": len(ttfts),
            "queue_p50_s": _pct(waits, 50),
            "queue_p99_s": _pct(waits, 99),
            "queue_p99_over_budget": _pct(waits, 99) / budget if waits else None,
            "ttft_p50_s": _pct(ttfts, 50),
            "within_slo": sum(1 for r in good if r["priority"] == prio),
        }
    return {
        "requests": len(recs),
        "statuses": dict(Counter(str(r["status"] or r["error"][:40]) for r in recs)),
        "first_429_sent_at_s": refused[0] if refused else None,
        "first_queued_sent_at_s": queued[0] if queued else None,
        "duration_s": duration,
        "goodput_rps": len(good) / duration if duration else 0.0,
        "within_slo": len(good),
        "by_class": by_class,
    }


def _end(r: dict) -> float:
    if r.get("ended_at") is not None:
        return r["ended_at"]
    return r["event_times"][-1] if r["event_times"] else r["sent_at"]


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else math.nan


if __name__ == "__main__":
    main()
