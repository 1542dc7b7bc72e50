"""DP<->TP switching on CPU workers: switch latency of the tiny and a larger model side by side, merged-TP
throughput against stock ``--tp 2``, and a bound-capable worker in DP mode against stock tp=1.

One run, same machine. Switch latency: a 2-engine flying-serving cluster per model (the tiny model, then the same
kind at ``--large-hidden``/``--large-layers``; ``--large-layers 0`` skips it), bind/release cycles on idle engines.
Throughput (tiny model): that cluster, a stock tp=1 and a stock --tp 2 server (all fp32, radix cache off everywhere
for parity), the same loadgen workload (completions, fixed prompts, concurrency cap, ignore_eos) against each
server in turn, the others idle; then the teacher-forced prompt log-probs of each mode against its stock server.

    .venv/bin/python benchmarks/switching.py --switches 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from devstack.cluster import Cluster, ClusterConfig
from devstack.stock_server import StockServer
from flying import control
from loadgen import metrics, runner
from loadgen.arrivals import Arrivals
from loadgen.workload import Lengths, PromptMaker, Workload, plan
from worker_ext.tinymodel import TinyLlamaSpec, ensure


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
    if s["failed"]:
        raise RuntimeError(f"{s['failed']} requests failed: {s['errors']}")
    return {"tok_s": s["output_throughput"], "tpot": s["tpot_ms"]["p50"]}


def pct(xs: list[float]) -> str:
    return f"p50 {np.percentile(xs, 50):.2f} ms, p99 {np.percentile(xs, 99):.2f} ms (n={len(xs)})"


MANUAL = ("--manual",)  # the router issues no binds of its own: the benchmark drives every bind and release


def wait(r, keys, mode: str) -> dict:
    while True:
        beats = control.status(r, keys)
        if all(beats.get(e) and beats[e].mode == mode for e in (0, 1)):
            return beats
        time.sleep(0.002)


def switch_latency(c: Cluster, switches: int) -> dict[str, list[float]]:
    """Bind/release cycles of engines (0, 1) on idle engines: the engines' own bind/release ms (heartbeats), the
    wall time from XADD until both heartbeats show the new mode, and the parameter bytes seen."""
    r, keys = c.client(), c.keys
    out: dict[str, list[float]] = {k: [] for k in ("bind", "release", "wall_bind", "wall_release", "params")}
    for _ in range(switches):
        t0 = time.perf_counter()
        epoch = control.bind(r, keys, (0, 1))
        beats = wait(r, keys, "tp")
        out["wall_bind"].append((time.perf_counter() - t0) * 1000)
        out["bind"].append(max(beats[e].bind_ms for e in (0, 1)))
        t0 = time.perf_counter()
        control.release(r, keys, (0, 1), epoch)
        beats = wait(r, keys, "dp")
        out["wall_release"].append((time.perf_counter() - t0) * 1000)
        out["release"].append(max(beats[e].release_ms for e in (0, 1)))
        out["params"] += [beats[e].param_bytes for e in (0, 1)]
    return out


def model_size(path: Path) -> str:
    spec = json.loads((path / "flying_tinymodel.json").read_text())
    nbytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return f"hidden {spec['hidden_size']}, {spec['num_hidden_layers']} layers, {nbytes / 1e6:.0f} MB fp32"


def prompt_logprobs(url: str, text: str) -> list[float]:
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    out = httpx.post(url + "/generate", json=body, timeout=120).json()
    return [x[0] for x in out["meta_info"]["input_token_logprobs"][1:]]


def max_diff(a: str, b: str) -> float:
    text = "Tell me a story about a dragon and a castle, and then another one about the river and the sea."
    x, y = prompt_logprobs(a, text), prompt_logprobs(b, text)
    if not len(x) == len(y) > 3:
        raise RuntimeError(f"the engines' prompt log-probabilities differ in number: {len(x)} and {len(y)}")
    return max(abs(p - q) for p, q in zip(x, y))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--switches", type=int, default=60)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--large-hidden", type=int, default=2048)
    p.add_argument("--large-layers", type=int, default=8)
    a = p.parse_args()
    model = ensure(Path(".flying/tiny-llama"), seed=0)
    tmp = Path(tempfile.mkdtemp(prefix="switching-"))
    latency = {}
    if a.large_layers:
        spec = TinyLlamaSpec.sized(a.large_hidden, a.large_layers)
        large = ensure(Path(f".flying/llama-h{a.large_hidden}-l{a.large_layers}"), seed=0, spec=spec)
        cfg = ClusterConfig(
            model_path=large, num_engines=2, log_dir=tmp / "large", max_total_tokens=4096, router_args=MANUAL
        )
        with Cluster(cfg) as c:
            latency[model_size(large)] = switch_latency(c, a.switches)
    cfg = ClusterConfig(
        model_path=model, num_engines=2, log_dir=tmp / "cluster", max_total_tokens=16384, router_args=MANUAL
    )
    with Cluster(cfg) as c:
        r, keys = c.client(), c.keys
        w0 = f"http://127.0.0.1:{cfg.worker_ports[0]}"
        latency = {model_size(model): switch_latency(c, a.switches), **latency}
        print(f"switch latency over {a.switches} bind/release cycles of engines (0, 1), idle:")
        for name, lat in latency.items():
            print(f"  {name}")
            print(f"    bind (command applied -> group ready for its first TP step): {pct(lat['bind'])}")
            print(
                f"    release (command applied -> DP layout restored, DP work resumed): {pct(lat['release'])}"
            )
            print(f"    wall, XADD -> both heartbeats show tp: {pct(lat['wall_bind'])}")
            print(f"    wall, XADD -> both heartbeats show dp: {pct(lat['wall_release'])}")
            print(f"    parameter storage across the cycles: {sorted(set(lat['params']))} bytes")
        if len(latency) == 2:
            (_, tiny), (_, big) = latency.items()
            ratio = np.percentile(big["bind"], 50) / np.percentile(tiny["bind"], 50)
            print(
                f"  bind p50 larger / tiny: {ratio:.2f}; release p50 larger / tiny: "
                f"{np.percentile(big['release'], 50) / np.percentile(tiny['release'], 50):.2f}"
            )

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
                wait(r, keys, "tp")
                runs["tp2"].append(load(w0, *args))
                control.release(r, keys, (0, 1), epoch)
                wait(r, keys, "dp")
                runs["stock2"].append(load(url2, *args))
            diff_dp = max_diff(w0, url1)
            epoch = control.bind(r, keys, (0, 1))
            wait(r, keys, "tp")
            diff_tp = max_diff(w0, url2)
            control.release(r, keys, (0, 1), epoch)
            wait(r, keys, "dp")
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
    print(
        f"prompt log-probs, max |difference|: DP mode vs stock tp=1 {diff_dp:.2e}; merged TP2 vs stock --tp 2 "
        f"{diff_tp:.2e}"
    )


if __name__ == "__main__":
    main()
