"""KV transformation cost: bind by adoption and release by scatter over N busy requests.

Part 1 (exchange only, two gloo processes, one core each): the per-layer all-to-all that moves head slices, for
the tiny test model (4 layers, 4 KV heads x 32, fp32) and the 2048-hidden layer of the weight benchmark (4 KV
heads x 128, fp32; 16 layers for a 1B-class model): tokens moved, median ms, peak extra MB.

Part 2 (live, 2 SGLang CPU workers): adopt and scatter of requests that are decoding, timings from the engines'
heartbeats, then 50 adopt/scatter cycles under load with worker memory (RSS) and free KV checked before and after.

    .venv/bin/python benchmarks/kv_transform.py [--skip-live] [--cycles 50]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import statistics
import threading
import time
from pathlib import Path

import torch

from flying.procs import free_port
from worker_ext import kv_transform
from worker_ext.kv_layout import SubSlotAllocator, view
from worker_ext.kv_transform import Held

CONFIGS = {"tiny (4 layers, 4x32)": (4, 4, 32), "2048-hidden (16 layers, 4x128)": (16, 4, 128)}


class Allocator:
    def __init__(self, size: int) -> None:
        self.free_slots = list(range(1, size + 1))

    def alloc(self, n: int):
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, slots) -> None:
        self.free_slots += slots.tolist()

    def available_size(self) -> int:
        return len(self.free_slots)


def _member(rank: int, port: int, layers: int, heads: int, dim: int, reqs: int, tokens: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
    group = dist.ProcessGroupGloo(dist.PrefixStore("b", store), rank, 2, datetime.timedelta(seconds=60))
    size = 4 * reqs * tokens + 8
    k = [torch.randn(size + 1, heads, dim) for _ in range(layers)]
    v = [torch.randn(size + 1, heads, dim) for _ in range(layers)]
    kv, vv = [view(t, 2) for t in k], [view(t, 2) for t in v]
    adopt_ms, scatter_ms, peaks, moved = [], [], [], 0
    for _ in range(5):
        alloc = Allocator(size)
        own = {f"{rank}-{i}": alloc.alloc(tokens) for i in range(reqs)}
        held = [Held(f"{r}-{i}", r, tokens) for r in range(2) for i in range(reqs)]
        sub = SubSlotAllocator(alloc, 2)
        group.barrier().wait()
        ex, slots = kv_transform.plan_adopt(held, rank, 2, own, sub.take_over, sub.alloc)
        a = kv_transform.run_exchange(group, rank, ex, kv, vv)
        placed = kv_transform.scatter_placement(held, [alloc.available_size()] * 2)
        group.barrier().wait()
        ex, _ = kv_transform.plan_scatter(held, placed, rank, 2, slots, alloc.alloc)
        s = kv_transform.run_exchange(group, rank, ex, kv, vv)
        adopt_ms.append(a.ms)
        scatter_ms.append(s.ms)
        peaks.append(max(a.peak_bytes, s.peak_bytes))
        moved = a.tokens
    if rank == 0:
        out.put((moved, statistics.median(adopt_ms), statistics.median(scatter_ms), max(peaks)))


def exchange_table() -> list[str]:
    rows = [
        "| model | busy requests per engine x tokens | token slices sent per engine | adopt ms | scatter ms | "
        "peak extra MB | KV per engine MB |",
        "|---|---|---|---|---|---|---|",
    ]
    ctx = mp.get_context("spawn")
    for name, (layers, heads, dim) in CONFIGS.items():
        for reqs, tokens in ((1, 300), (8, 300), (32, 300)):
            q = ctx.Queue()
            port = free_port()
            procs = [
                ctx.Process(target=_member, args=(r, port, layers, heads, dim, reqs, tokens, q))
                for r in (0, 1)
            ]
            for p in procs:
                p.start()
            moved, a_ms, s_ms, peak = q.get(timeout=600)
            for p in procs:
                p.join()
            kv_mb = reqs * tokens * layers * 2 * heads * dim * 4 / 2**20
            rows.append(
                f"| {name} | {reqs} x {tokens} | {moved} | {a_ms:.1f} | {s_ms:.1f} | {peak / 2**20:.2f} | {kv_mb:.1f} |"
            )
            print(rows[-1], flush=True)
    return rows


def live(cycles: int) -> list[str]:
    import httpx
    import psutil

    from devstack.cluster import Cluster, ClusterConfig
    from flying import control
    from worker_ext.tinymodel import ensure

    model = ensure(Path(".flying/test-model"), seed=0)
    cfg = ClusterConfig(
        model_path=model,
        num_engines=2,
        log_dir=Path(".flying/bench-kv-transform"),
        max_total_tokens=8192,
        router_args=("--manual",),
    )
    rows = []
    with Cluster(cfg) as c:
        r, urls = c.client(), [f"http://127.0.0.1:{p}" for p in cfg.worker_ports]

        def wait(mode: str, members=(0, 1)) -> dict:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                beats = control.status(r, c.keys)
                if all(beats[e].mode == mode for e in members):
                    return beats
                time.sleep(0.01)
            raise RuntimeError(f"not {mode}: {control.status(r, c.keys)}")

        def load(per_engine: int, n: int) -> list[threading.Thread]:
            def one(url: str, seed: int) -> None:
                ids = [(seed * 31 + 7 * i) % 1000 + 5 for i in range(300)]
                body = {
                    "input_ids": ids,
                    "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
                }
                httpx.post(url + "/generate", json=body, timeout=600)

            ts = [
                threading.Thread(target=one, args=(urls[e], e * 100 + i))
                for e in (0, 1)
                for i in range(per_engine)
            ]
            for t in ts:
                t.start()
            return ts

        rows += [
            "| busy requests per engine | adopt: bind ms (leader) | exchange ms | token slices | "
            "scatter: exchange ms | token slices | peak extra MB |",
            "|---|---|---|---|---|---|---|",
        ]
        for per_engine in (1, 4, 8):
            ts = load(per_engine, 400)
            time.sleep(1.0 + 0.3 * per_engine)
            epoch = control.bind(r, c.keys, (0, 1), adopt=True)
            b = wait("tp")
            control.release(r, c.keys, (0, 1), epoch, scatter=True)
            s = wait("dp")
            alive = sum(t.is_alive() for t in ts)
            for t in ts:
                t.join()
            rows.append(
                f"| {per_engine} ({alive} still running at release) | {b[0].bind_ms:.1f} | {b[0].transform_ms:.1f} | "
                f"{b[0].transform_tokens} | {s[0].transform_ms:.1f} | {s[0].transform_tokens} | "
                f"{max(b[0].transform_peak_bytes, s[0].transform_peak_bytes) / 2**20:.2f} |"
            )
            print(rows[-1], flush=True)

        def rss() -> float:
            total = 0
            for p in c.workers.values():
                proc = psutil.Process(p.pid)
                total += sum(x.memory_info().rss for x in [proc, *proc.children(recursive=True)])
            return total / 2**20

        time.sleep(1.5)
        before, kv0 = rss(), control.status(r, c.keys)
        ts = load(2, 1500)
        t0, done = time.monotonic(), 0
        while done < cycles:
            if not any(t.is_alive() for t in ts):
                ts = load(2, 1500)
            epoch = control.bind(r, c.keys, (0, 1), adopt=True)
            wait("tp")
            control.release(r, c.keys, (0, 1), epoch, scatter=True)
            wait("dp")
            done += 1
        for t in ts:
            t.join()
        time.sleep(1.5)
        after, kv1 = rss(), control.status(r, c.keys)
        rows.append("")
        rows.append(
            f"{cycles} adopt/scatter cycles under load in {time.monotonic() - t0:.1f} s: worker RSS {before:.0f} -> "
            f"{after:.0f} MiB; idle free KV tokens {[kv0[e].free_kv_tokens for e in (0, 1)]} -> "
            f"{[kv1[e].free_kv_tokens for e in (0, 1)]} of {[kv1[e].max_total_tokens for e in (0, 1)]}; "
            f"param bytes {[kv0[e].param_bytes for e in (0, 1)]} -> {[kv1[e].param_bytes for e in (0, 1)]}"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--skip-live", action="store_true")
    p.add_argument("--cycles", type=int, default=50)
    a = p.parse_args()
    print("\n".join(exchange_table()))
    if not a.skip_live:
        print("\n".join(live(a.cycles)))


if __name__ == "__main__":
    main()
