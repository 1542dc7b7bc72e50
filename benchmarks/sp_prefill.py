"""Sequence-parallel prefill inside a bound group against tensor-parallel, stock tp=1 and stock ``--tp 2``.

One run, same machine, fp32, radix cache off everywhere: a 2-engine flying-serving cluster bound into one group, a
stock tp=1 and a stock ``--tp 2`` SGLang server on the same generated model. For each prompt length, TTFT (the time
of a ``max_new_tokens=1`` request) on the group with every prefill step in SP (``sp_threshold`` 1), with every step
in TP (``sp_threshold`` 0), on stock tp=1 and on stock ``--tp 2``; the four are interleaved within each round and
the medians over rounds reported. Then the decode TPOT after an SP prefill and after a TP prefill (the decode runs
in TP either way), and the leader's time in the group's collectives per prefill (all-reduce in TP; all-to-all and
all-gather in SP) from its heartbeat: what limits SP on this machine.

    .venv/bin/python benchmarks/sp_prefill.py --lengths 512,2048,4096,8192 --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from devstack.cluster import Cluster, ClusterConfig
from devstack.stock_server import StockServer
from flying import control
from worker_ext.tinymodel import TinyLlamaSpec, ensure

ROOT = Path(__file__).resolve().parents[1]


def prompt(n: int, salt: int) -> list[int]:
    return [(7 * i + 13 * salt) % 900 + 50 for i in range(n)]


def timed(url: str, ids: list[int], max_new: int) -> float:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
    }
    t0 = time.perf_counter()
    resp = httpx.post(url + "/generate", json=body, timeout=900)
    if resp.status_code != 200:
        raise RuntimeError(f"{url}: {resp.status_code} {resp.text[:200]}")
    return (time.perf_counter() - t0) * 1000


class Group:
    """The cluster's engines 0 and 1, bound with a given SP threshold (rebinding when it changes)."""

    def __init__(self, c: Cluster) -> None:
        self.c, self.epoch, self.threshold = c, 0, -1
        self.url = f"http://127.0.0.1:{c.config.worker_ports[0]}"

    def bind(self, threshold: int) -> None:
        if threshold == self.threshold:
            return
        r = self.c.client()
        if self.epoch:
            control.release(r, self.c.keys, (0, 1), self.epoch)
            self._wait("dp")
        self.epoch = control.bind(r, self.c.keys, (0, 1), sp_threshold=threshold)
        self._wait("tp")
        self.threshold = threshold

    def _wait(self, mode: str) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            beats = control.status(self.c.client(), self.c.keys)
            if all(e in beats and beats[e].mode == mode for e in (0, 1)):
                return
            time.sleep(0.05)
        raise RuntimeError(f"engines not in {mode}")

    def comm_ms(self) -> dict[str, float]:
        time.sleep(0.3)  # the leader's next heartbeat (every 50 ms) carries the step's collectives
        return dict(control.status(self.c.client(), self.c.keys)[0].comm_ms)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="512,2048,4096,8192")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here too")
    a = p.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    longest = max(lengths)
    spec = dataclasses.replace(
        TinyLlamaSpec.sized(a.hidden, a.layers), max_position_embeddings=2 * longest + 256
    )
    model = ensure(ROOT / ".flying" / f"bench-sp-h{a.hidden}-l{a.layers}", seed=0, spec=spec)
    kv = 2 * longest + 512
    logs = Path(tempfile.mkdtemp(prefix="sp-prefill-"))
    config = ClusterConfig(
        model_path=model,
        num_engines=2,
        log_dir=logs,
        max_total_tokens=kv,
        router_args=("--manual",),
        worker_args=("--disable-radix-cache",),
    )
    tp1 = StockServer(model, logs / "tp1.log", max_total_tokens=2 * kv, disable_radix_cache=True).launch()
    tp2 = StockServer(
        model, logs / "tp2.log", tp=2, max_total_tokens=2 * kv, disable_radix_cache=True
    ).launch()
    results: dict = {"model": {"hidden": a.hidden, "layers": a.layers}, "ttft_ms": {}, "comm_ms": {}}
    with Cluster(config, progress=print) as c:
        tp1.wait(), tp2.wait()
        group = Group(c)
        systems = {
            "sp": lambda ids: (group.bind(1), timed(group.url, ids, 1))[1],
            "tp": lambda ids: (group.bind(0), timed(group.url, ids, 1))[1],
            "stock tp=1": lambda ids: timed(tp1.url, ids, 1),
            "stock --tp 2": lambda ids: timed(tp2.url, ids, 1),
        }
        for run in systems.values():  # warm-up: every code path once
            run(prompt(256, 0))
        for n in lengths:
            got: dict[str, list[float]] = {name: [] for name in systems}
            comm: dict[str, dict[str, float]] = {}
            for rnd in range(a.rounds):
                for name, run in systems.items():
                    if name in ("sp", "tp"):
                        group.bind(1 if name == "sp" else 0)
                        before = group.comm_ms()
                    got[name].append(run(prompt(n, rnd + 1)))
                    if name in ("sp", "tp"):
                        after = group.comm_ms()
                        comm[name] = {k: round(after.get(k, 0) - before.get(k, 0), 1) for k in after}
            med = {name: statistics.median(xs) for name, xs in got.items()}
            results["ttft_ms"][n] = med
            results["comm_ms"][n] = comm
            print(
                f"{n:>6} tokens: "
                + ", ".join(f"{k} {v:.0f} ms" for k, v in med.items())
                + f"; TP/SP {med['tp'] / med['sp']:.2f}; leader's collectives (last round) {comm}"
            )
        n, k = min(2048, longest), a.decode_tokens
        tpot = {}
        for name, threshold in (("after SP prefill", 1), ("after TP prefill", 0)):
            group.bind(threshold)
            one, many = [], []
            for rnd in range(a.rounds):
                ids = prompt(n, 100 + rnd)
                one.append(timed(group.url, ids, 1))
                many.append(timed(group.url, ids, k + 1))
            tpot[name] = (statistics.median(many) - statistics.median(one)) / k
        results["tpot_ms"] = tpot
        print(
            f"decode TPOT after a {n}-token prefill: " + ", ".join(f"{k} {v:.2f} ms" for k, v in tpot.items())
        )
    tp1.stop(), tp2.stop()
    if a.out:
        a.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
