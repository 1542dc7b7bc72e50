"""Prefix cache (issue 16) on CPU workers: what keeping SGLang's radix cache costs a flying worker, and what
cache-aware DP dispatch buys over least-loaded.

(a) ``--part engine``: the shared-prefix workload (one system prompt of ``--system-prompt-words`` words, 64 short
    distinct questions, 8 output tokens, concurrency 4, greedy, chat), two rounds, sent straight to one engine: a
    bindable flying worker in DP mode (2-engine cluster, ``--comm-port``, cache on by default, manual
    router, engine 0 measured, engine 1 idle) and a stock tp=1 server (cache on), pinned to the same core. The two
    servers take turns round by round. Ratios are stock / flying (>= 1: flying as fast or faster).
(b)+(c) ``--part dispatch``: a 2-engine cluster through the gateway (router ``--manual``: DP only, no binds), once
    per ``--dispatch`` mode, each on a fresh cluster: (b) 8 system prompts, multi-turn sessions (hit rate, TTFT
    p50/p90, throughput); then (c) a workload without shared prefixes (throughput).

Every workload is ``loadgen run`` in its own process, as a user runs it.

    .venv/bin/python benchmarks/prefix_cache.py --part engine
    .venv/bin/python benchmarks/prefix_cache.py --part dispatch
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _loadgen import run_loadgen

from devstack.cluster import Cluster, ClusterConfig
from devstack.stock_server import StockServer
from worker_ext.tinymodel import ensure

KV_TOKENS = 16384


def shared_prefix_args(model: Path, a: argparse.Namespace) -> tuple[str, ...]:
    return (
        "--api",
        "chat",
        "--tokenizer",
        str(model),
        "--model",
        "tiny-llama",
        "-n",
        str(a.questions),
        "--rate",
        "inf",
        "--max-concurrency",
        "4",
        "--system-prompts",
        "1",
        "--system-prompt-words",
        str(a.system_prompt_words),
        "--input-tokens",
        "16",
        "--output-tokens",
        "8",
    )


def row(s: dict) -> str:
    hit = s.get("cache_hit_rate")
    return (
        f"wall {s['duration_s']:6.2f} s  TTFT p50 {s['ttft_ms']['p50']:7.1f} ms  p90 {s['ttft_ms']['p90']:7.1f} ms  "
        f"output {s['output_throughput']:6.1f} tok/s  hit {'-' if hit is None else f'{hit:.1%}'}  "
        f"failed {s['failed']}"
    )


def engine_part(model: Path, tmp: Path, a: argparse.Namespace) -> None:
    cfg = ClusterConfig(
        model_path=model,
        num_engines=2,
        log_dir=tmp / "cluster",
        max_total_tokens=KV_TOKENS,
        router_args=("--manual",),
    )
    args = shared_prefix_args(model, a)
    runs: dict[str, list[dict]] = {"flying": [], "stock": []}
    with Cluster(cfg) as c:
        urls = {"flying": f"http://127.0.0.1:{c.config.worker_ports[0]}"}
        # cpu_bind "0": the same core as flying worker 0, which it is compared with
        stock = StockServer(model, tmp / "stock.log", max_total_tokens=KV_TOKENS, cpu_bind="0").start()
        urls["stock"] = stock.url
        try:
            for r in range(a.rounds):
                order = ("flying", "stock") if r % 2 == 0 else ("stock", "flying")
                for name in order:
                    runs[name].append(run_loadgen(urls[name], tmp / f"{name}-{r}", *args))
        finally:
            stock.stop()
    print(
        f"(a) one system prompt of {a.system_prompt_words} words, {a.questions} distinct questions of 16 tokens, "
        f"8 output tokens, concurrency 4, greedy, chat; {a.rounds} rounds on each server (cache on)"
    )
    for name, label in (("flying", "flying worker, DP mode"), ("stock", "stock tp=1")):
        for r, s in enumerate(runs[name]):
            print(f"  {label:<24} round {r + 1}: {row(s)}")
    wall = {k: sum(s["duration_s"] for s in v) for k, v in runs.items()}
    print(
        f"  wall time, all rounds: flying {wall['flying']:.2f} s, stock {wall['stock']:.2f} s, "
        f"ratio stock / flying {wall['stock'] / wall['flying']:.3f}"
    )
    for r in range(a.rounds):
        f, s = runs["flying"][r]["ttft_ms"]["p50"], runs["stock"][r]["ttft_ms"]["p50"]
        print(f"  TTFT p50 round {r + 1}: ratio stock / flying {s / f:.3f}")


def dispatch_part(model: Path, tmp: Path, a: argparse.Namespace) -> None:
    shared = (
        "--api",
        "chat",
        "--tokenizer",
        str(model),
        "--model",
        "tiny-llama",
        "-n",
        str(a.sessions),
        "--rate",
        "inf",
        "--max-concurrency",
        str(a.concurrency),
        "--system-prompts",
        "8",
        "--system-prompt-words",
        str(a.system_prompt_words),
        "--turns",
        str(a.turns),
        "--input-tokens",
        "16",
        "--output-tokens",
        "8",
    )
    plain = (
        "--api",
        "chat",
        "--tokenizer",
        str(model),
        "--model",
        "tiny-llama",
        "-n",
        str(a.plain_requests),
        "--rate",
        "inf",
        "--max-concurrency",
        str(a.concurrency),
        "--input-tokens",
        "256:1024",
        "--output-tokens",
        "16",
        "--seed",
        "1",
    )
    results: dict[str, dict[str, dict]] = {}
    for mode in a.dispatch:
        cfg = ClusterConfig(
            model_path=model,
            num_engines=2,
            log_dir=tmp / mode,
            max_total_tokens=KV_TOKENS,
            router_args=("--manual",),
            dispatch=mode,
        )
        with Cluster(cfg) as c:
            url = c.config.gateway_url
            results[mode] = {
                "shared": run_loadgen(url, tmp / f"{mode}-shared", *shared),
                "plain": run_loadgen(url, tmp / f"{mode}-plain", *plain),
            }
    print(
        f"(b) 2 engines through the gateway: {a.sessions} sessions x {a.turns} turns over 8 system prompts of "
        f"{a.system_prompt_words} words, 16-token questions, 8 output tokens, concurrency {a.concurrency}"
    )
    for mode, r in results.items():
        print(f"  {mode:<12} {row(r['shared'])}")
    print(
        f"(c) no shared prefix: {a.plain_requests} requests of 256-1024 tokens, 16 output tokens, "
        f"concurrency {a.concurrency}"
    )
    for mode, r in results.items():
        print(f"  {mode:<12} {row(r['plain'])}")
    if {"cache-aware", "least-loaded"} <= set(results):
        ca, ll = results["cache-aware"], results["least-loaded"]
        for part in ("shared", "plain"):
            print(
                f"  {part}: output throughput cache-aware / least-loaded "
                f"{ca[part]['output_throughput'] / ll[part]['output_throughput']:.3f}; TTFT p50 least-loaded / "
                f"cache-aware {ll[part]['ttft_ms']['p50'] / ca[part]['ttft_ms']['p50']:.3f}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("engine", "dispatch", "all"), default="all")
    p.add_argument("--system-prompt-words", type=int, default=1500)
    p.add_argument("--questions", type=int, default=64, help="(a) distinct questions per round")
    p.add_argument("--rounds", type=int, default=2, help="(a) rounds on each server")
    p.add_argument("--sessions", type=int, default=32, help="(b) sessions")
    p.add_argument("--turns", type=int, default=4, help="(b) turns per session")
    p.add_argument("--concurrency", type=int, default=8, help="(b), (c) client concurrency")
    p.add_argument("--plain-requests", type=int, default=96, help="(c) requests")
    p.add_argument("--dispatch", nargs="+", default=["cache-aware", "least-loaded"], help="(b), (c) modes")
    a = p.parse_args()
    model = ensure(Path(".flying/tiny-llama"), seed=0)
    tmp = Path(tempfile.mkdtemp(prefix="prefix-cache-"))
    print(f"logs and result files under {tmp}")
    if a.part in ("engine", "all"):
        engine_part(model, tmp, a)
    if a.part in ("dispatch", "all"):
        dispatch_part(model, tmp, a)


if __name__ == "__main__":
    main()
