"""DP<->TP switching on CPU workers: switch latency, merged-TP throughput against stock ``--tp 2``, and a
bound-capable worker in DP mode against stock tp=1.

One run, same machine: a 2-engine flying-serving cluster, a stock tp=1 and a stock --tp 2 server (all fp32 tiny
model, radix cache off everywhere for parity). Throughput: the same loadgen workload (completions, fixed
prompts, concurrency cap, ignore_eos) against each server in turn; the others idle.

    .venv/bin/python benchmarks/switching.py --switches 60
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from devstack.cluster import Cluster, ClusterConfig
from devstack.stock_server import StockServer
from flying import control
from loadgen import metrics, runner
from loadgen.arrivals import Arrivals
from loadgen.workload import Lengths, PromptMaker, Workload, plan
from worker_ext.tinymodel import ensure


def load(url: str, model: Path, n: int, conc: int, out_tokens: int) -> dict:
    w = Workload(
        n,
        Arrivals("poisson", float("inf")),
        Lengths("fixed", 64, 64),
        Lengths("fixed", out_tokens, out_tokens),
        {"normal": 1.0},
    )
    cfg = runner.RunConfig(url, "x", api="completions", max_concurrency=conc, warmup=2)
    records, duration = asyncio.run(runner.run(cfg, plan(w, PromptMaker(model))))
    s = metrics.summarize(records, duration)
    assert s["failed"] == 0, s["errors"]
    return {"tok_s": s["output_throughput"], "tpot": s["tpot_ms"]["p50"]}


def pct(xs: list[float]) -> str:
    return f"p50 {np.percentile(xs, 50):.2f} ms, p99 {np.percentile(xs, 99):.2f} ms (n={len(xs)})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--switches", type=int, default=60)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    model = ensure(Path(".flying/tiny-llama"), seed=0)
    tmp = Path(tempfile.mkdtemp(prefix="switching-"))
    cfg = ClusterConfig(model_path=model, num_engines=2, log_dir=tmp / "cluster", max_total_tokens=16384)
    with Cluster(cfg) as c:
        r, keys = c.client(), c.keys
        w0 = f"http://127.0.0.1:{cfg.worker_ports[0]}"
        bind_ms, release_ms, wall_bind, wall_release, params = [], [], [], [], set()

        def wait(mode: str) -> dict:
            while True:
                beats = control.status(r, keys)
                if all(beats.get(e) and beats[e].mode == mode for e in (0, 1)):
                    return beats
                time.sleep(0.002)

        for _ in range(a.switches):
            t0 = time.perf_counter()
            epoch = control.bind(r, keys, (0, 1))
            beats = wait("tp")
            wall_bind.append((time.perf_counter() - t0) * 1000)
            bind_ms.append(max(beats[e].bind_ms for e in (0, 1)))
            t0 = time.perf_counter()
            control.release(r, keys, (0, 1), epoch)
            beats = wait("dp")
            wall_release.append((time.perf_counter() - t0) * 1000)
            release_ms.append(max(beats[e].release_ms for e in (0, 1)))
            params |= {beats[e].param_bytes for e in (0, 1)}
        print(f"bind (command applied -> group ready for its first TP step): {pct(bind_ms)}")
        print(f"release (command applied -> DP layout restored, DP work resumed): {pct(release_ms)}")
        print(
            f"wall, XADD -> both heartbeats show the new mode: bind {pct(wall_bind)}; release {pct(wall_release)}"
        )
        print(f"parameter storage across {a.switches} cycles: {sorted(params)} bytes")

        # cpu_bind "0": the same core as flying worker 0, which it is compared with
        s1 = StockServer(
            model, tmp / "stock1.log", max_total_tokens=16384, disable_radix_cache=True, cpu_bind="0"
        )
        s2 = StockServer(model, tmp / "stock2.log", tp=2, max_total_tokens=16384, disable_radix_cache=True)
        url1, url2 = s1.url, s2.url
        try:
            for server in (s1.launch(), s2.launch()):  # start both, then wait for both
                server.wait()
            runs: dict[str, list[dict]] = {k: [] for k in ("dp", "stock1", "tp2", "stock2")}
            args = (model, a.requests, a.concurrency, a.output_tokens)
            for _ in range(a.rounds):
                runs["dp"].append(load(w0, *args))
                runs["stock1"].append(load(url1, *args))
                epoch = control.bind(r, keys, (0, 1))
                wait("tp")
                runs["tp2"].append(load(w0, *args))
                control.release(r, keys, (0, 1), epoch)
                wait("dp")
                runs["stock2"].append(load(url2, *args))
        finally:
            s1.stop()
            s2.stop()
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("tok_s", "tpot")} for k, v in runs.items()}
    print(
        f"\nthroughput: {a.requests} requests x 64 in / {a.output_tokens} out, concurrency {a.concurrency}, "
        f"median of {a.rounds} rounds"
    )
    for k, name in (
        ("dp", "flying worker, DP mode"),
        ("stock1", "stock tp=1"),
        ("tp2", "flying group, merged TP2"),
        ("stock2", "stock --tp 2"),
    ):
        print(f"  {name:<26} {med[k]['tok_s']:8.1f} tok/s   TPOT p50 {med[k]['tpot']:.2f} ms")
    print(f"  ratio DP mode / stock tp=1: {med['dp']['tok_s'] / med['stock1']['tok_s']:.3f}")
    print(f"  ratio merged TP2 / stock --tp 2: {med['tp2']['tok_s'] / med['stock2']['tok_s']:.3f}")


if __name__ == "__main__":
    main()
