"""Scale of the control plane: the router's decision round (router.policy.decide, the pure function the live router
and the simulator call) on simulated clusters of 8, 128 and 1,024 engines with 100, 1,000 and 10,000 queued
requests (p50 / p99 of one round), and the admission rate one router sustains against fake engines (real Redis,
the real Dispatcher, fake heartbeats, requests admitted by the gateway's own admission script).

PYTHONPATH=. .venv/bin/python benchmarks/router_scale.py [--part round|admission|all] [--scenario queue|burst|both]
    [--peek 256] [--rounds 30] [--profile ENGINES,QUEUED]

Clusters are built as nodes of 8 engines (``num_engines`` 8 in every heartbeat: each node its own communicator
pool). The round sees the whole queue unless ``--peek`` (the live router reads the queue's head, 256 by default:
without it the rows with 1,000 and 10,000 queued are what a larger ``--peek`` costs). Busy regime, cache-aware
dispatch (the defaults), half of the requests with a prefix chain drawn from 64 shared prompts, 5 % high priority;
engines with 0-2 free slots (``queue``: a queue builds only over full engines) or about half full (``burst``), their
loads in balance (so cache-aware dispatch follows prefixes).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import random
import statistics
import sys
import time

from flying.messages import QueuedRequest, RouterState
from flying.prefix import encode_chain
from router.config import Limits, PolicyConfig
from router.engine_view import EngineView
from router.main import tune_gc
from router.policy import decide
from router.prefix_index import PrefixIndex
from router.snapshot import Snapshot

PER_NODE = 8
SIZES = ((8, (100, 1_000, 10_000)), (128, (100, 1_000, 10_000)), (1024, (100, 1_000, 10_000)))
KV = 200_000  # tokens per engine (a Llama-8B on an H200)


def prompts(rng: random.Random, n: int = 64, blocks: int = 16) -> list[tuple[int, ...]]:
    """``n`` shared prompts' block-hash chains (their first ``blocks`` blocks)."""
    return [tuple(rng.getrandbits(63) for _ in range(blocks)) for _ in range(n)]


def engines(n: int, rng: random.Random, cap: int, burst: bool) -> list[EngineView]:
    """``n`` live DP engines: under a queue (``burst`` False) each has 0-2 free slots (a queue builds only once
    the engines are full); in a burst they are about half full, so the whole queue may dispatch at once."""
    return [
        EngineView(
            e,
            f"http://10.0.{e // PER_NODE}.{e % PER_NODE}:30000",
            inflight=(load := cap // 2 + rng.randrange(-4, 5) if burst else cap - rng.randrange(0, 3)),
            free_kv_tokens=KV - load * 500,
            max_total_tokens=KV,
            num_engines=PER_NODE,
            beat_ts=100.0,
            launch_id=f"l{e}",
        )
        for e in range(n)
    ]


def queue(n: int, rng: random.Random, chains: list[tuple[int, ...]]) -> list[QueuedRequest]:
    rows = []
    for i in range(n):
        priority = "high" if rng.random() < 0.05 else rng.choice(("normal", "normal", "low"))
        chain = rng.choice(chains)[: rng.randrange(4, 17)] if rng.random() < 0.5 else ()
        rows.append(
            QueuedRequest(
                id=f"r{i}",
                priority=priority,  # type: ignore[arg-type]
                model="m",
                prompt_tokens=rng.randrange(64, 2_048),
                max_tokens=rng.randrange(16, 512),
                gateway="g",
                enqueued_at=99.0,
                seq=i,
                prefix=encode_chain(chain),
            )
        )
    order = {"high": 0, "normal": 1, "low": 2}
    return sorted(rows, key=lambda r: (order[r.priority], r.seq))


def snapshot(
    n_engines: int, n_queued: int, seed: int, cfg: PolicyConfig, burst: bool, peek: int = 0
) -> Snapshot:
    """A busy cluster's snapshot: every engine live in DP, a prefix index that saw each engine's recent prompts."""
    rng = random.Random(seed)
    chains = prompts(rng)
    views = engines(n_engines, rng, Limits().max_inflight_per_worker, burst)
    index = PrefixIndex()
    index.sync(views)
    for e in views:
        for c in rng.sample(chains, 4):
            index.record(e.engine, c)
    return Snapshot(
        now=100.0,
        waiting=queue(n_queued, rng, chains)[: peek or None],
        queued=n_queued,
        engines=views,
        groups=[],
        state=RouterState(
            busy=True,
            rate_ts=99.9,
            rate=10.0 * n_engines,
            admitted=999_000,
            recent={e.engine: rng.random() * 2 for e in views},
        ),
        admitted=1_000_000,
        prefixes=index,
    )


def time_rounds(
    n_engines: int, n_queued: int, rounds: int, cfg: PolicyConfig, burst: bool, peek: int
) -> tuple[float, float, int]:
    """(p50, p99) milliseconds of one ``decide`` over ``rounds`` rounds on 3 snapshots, and the dispatches of one."""
    snaps = [snapshot(n_engines, n_queued, seed, cfg, burst, peek) for seed in range(3)]
    times, sent = [], 0
    for i in range(rounds):
        s = snaps[i % len(snaps)]
        t0 = time.perf_counter()
        d = decide(s, cfg)
        times.append((time.perf_counter() - t0) * 1000)
        sent = len(d.dispatches)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))], sent


def round_table(rounds: int, cfg: PolicyConfig, scenarios: list[str], peek: int) -> None:
    print("| engines (nodes) | queued | engines | dispatched per round | p50 (ms) | p99 (ms) |")
    print("|---|---|---|---|---|---|")
    for scenario in scenarios:
        for n_engines, queued in SIZES:
            for n in queued:
                burst = scenario == "burst"
                reps = rounds if not burst or n_engines * n <= 1_000_000 else max(5, rounds // 3)
                p50, p99, sent = time_rounds(n_engines, n, reps, cfg, burst, peek)
                where = "about half full" if burst else "0-2 free slots each"
                print(
                    f"| {n_engines:,} ({n_engines // PER_NODE}) | {n:,} | {where} | {sent:,} | {p50:.2f} | {p99:.2f} |"
                )
                sys.stdout.flush()


def profile(n_engines: int, n_queued: int, cfg: PolicyConfig, burst: bool) -> None:
    s = snapshot(n_engines, n_queued, 0, cfg, burst)
    prof = cProfile.Profile()
    prof.enable()
    decide(s, cfg)
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("round", "admission", "all"), default="all")
    p.add_argument("--rounds", type=int, default=30, help="rounds timed per cell (fewer for the largest)")
    p.add_argument("--profile", metavar="ENGINES,QUEUED", help="cProfile one round of that size and exit")
    p.add_argument(
        "--scenario",
        choices=("queue", "burst", "both"),
        default="both",
        help="engines full with a queue waiting, or half full with the whole queue dispatching",
    )
    p.add_argument(
        "--peek",
        type=int,
        default=0,
        help="the round sees the queue's head of this many requests, as flying-router --peek (0: all)",
    )
    p.add_argument("--seconds", type=float, default=5.0, help="admission: seconds of load per cluster size")
    a = p.parse_args()
    cfg = PolicyConfig()
    tune_gc()  # as flying-router runs
    if a.profile:
        n_engines, n_queued = (int(x) for x in a.profile.split(","))
        profile(n_engines, n_queued, cfg, a.scenario == "burst")
        return
    if a.part in ("round", "all"):
        scenarios = ["queue", "burst"] if a.scenario == "both" else [a.scenario]
        round_table(a.rounds, cfg, scenarios, a.peek)
    if a.part in ("admission", "all"):
        from benchmarks._router_admission import admission_table

        asyncio.run(admission_table(a.seconds))
    print(f"\nload average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
