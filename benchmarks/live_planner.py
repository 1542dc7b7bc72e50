"""The live planner on the CPU stack: where a group is faster it binds, where it is not it keeps DP.

Two CPU workers with a generated Llama of hidden 512 (4 layers, random weights: compute outweighs a pair's
collectives for long prompts), the router with its defaults against the router keeping DP (``--max-width 1``, the
same for everything else), the two interleaved in each round. Each round sends, at low load, long prompts (3-4k
tokens) and then short ones (32-64 tokens), and the table gives the medians over rounds of each phase's TTFT p50,
and their ratio (defaults / DP only). The phases are :data:`PAUSE_S` apart: each measures its own mix at low
load, not the change between them (the planner's token mix averages the admissions over half its horizon, 5 s).
The routers are restarted between configurations; the fitted cost model carries over in Redis, as it would for a
restarted router.

    PYTHONPATH=. .venv/bin/python benchmarks/live_planner.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import statistics
import time
from pathlib import Path

from devstack import mode_track
from devstack.cluster import Cluster, ClusterConfig
from loadgen import runner
from loadgen.arrivals import Arrivals
from loadgen.metrics import stats
from loadgen.workload import Lengths, PromptMaker, Workload, plan
from worker_ext.tinymodel import TinyLlamaSpec, ensure

CONFIGS = {"defaults": (), "DP only": ("--max-width", "1")}
PAUSE_S = 12.0  # seconds between phases


def phase(
    cluster: Cluster, model: Path, name: str, n: int, rate: float, tokens: tuple[int, int], seed: int
) -> mode_track.Phase:
    """``n`` requests of ``tokens`` prompt tokens at ``rate`` req/s (Poisson), 8 tokens out."""
    w = Workload(
        num_requests=n,
        arrivals=Arrivals("poisson", rate),
        input_tokens=Lengths("uniform", *tokens),
        output_tokens=Lengths("uniform", 8, 8),
        priority_mix={"normal": 1.0},
        seed=seed,
    )
    t0 = time.time()
    records, duration = asyncio.run(
        runner.run(
            runner.RunConfig(cluster.config.gateway_url, cluster.config.served_model_name),
            plan(w, PromptMaker(model)),
        )
    )
    if not all(r.ok for r in records):
        raise RuntimeError(f"{sum(not r.ok for r in records)} of {n} requests failed")
    return mode_track.Phase(name, records, t0, time.time(), rate, duration)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--long", type=int, default=4, help="long prompts a phase")
    p.add_argument("--short", type=int, default=12, help="short prompts a phase")
    p.add_argument("--logs", type=Path, default=Path("results/live-planner-logs"))
    a = p.parse_args()
    model = ensure(Path(".flying/llama-512"), seed=0, spec=TinyLlamaSpec.sized(512, 4))
    cfg = ClusterConfig(model_path=model, num_engines=2, log_dir=a.logs)
    got: dict[tuple[str, str], list[float]] = {}
    with Cluster(cfg, progress=print) as cluster:
        for rnd in range(a.rounds):
            for name, args in CONFIGS.items():
                cluster.kill_router(signal.SIGTERM)
                cluster.start_router(args)
                phases = []
                for what, n, rate, tokens in (
                    ("long", a.long, 0.2, (3000, 4000)),
                    ("short", a.short, 1.0, (32, 64)),
                ):
                    time.sleep(PAUSE_S)
                    phases.append(phase(cluster, model, what, n, rate, tokens, seed=rnd))
                    ms = stats([r.ttft for r in phases[-1].records], 1000)["p50"]
                    got.setdefault((name, what), []).append(ms)
                    print(f"round {rnd}: {name}, {what} prompts: TTFT p50 {ms:.0f} ms", flush=True)
                if name == "defaults":  # what the planner predicted and did, and where each phase ran
                    r = cluster.client()
                    for ph in phases:
                        m = mode_track.modes(r, cluster.keys, ph.started, ph.ended)
                        print("  " + mode_track.phase_line(ph, m))
                    events = mode_track.decision_log(r, cluster.keys, phases[0].started - PAUSE_S)
                    for line in mode_track.track(events, phases):
                        print("  " + line)
    print("| prompts | defaults TTFT p50 (ms) | DP only TTFT p50 (ms) | defaults / DP only |")
    print("|---|---|---|---|")
    for what in ("long", "short"):
        d, dp = (statistics.median(got[(name, what)]) for name in CONFIGS)
        print(f"| {what} | {d:.0f} | {dp:.0f} | {d / dp if dp else math.nan:.2f} |")


if __name__ == "__main__":
    main()
