"""Parking live: the 2-engine CPU stack (``devstack.cluster``: a private Redis, two CPU workers with the tiny model
and ``--kv-tokens`` each, the router with its defaults, the gateway). A request no engine holds alone runs on a
group of both engines; once it streams, a burst of short requests comes. The router parks the long request's
group (its KV head slices stay on the engines), the burst runs in DP, and when calm returns the same engines bind
again and the long request continues. Reported: the long request's answer against the same request sent alone
before (greedy: the same text), the longest pause in its stream, the burst's TTFT, and the router's decision log.
On this CPU both engines share two cores: this checks the mechanism end to end, not GPU latency.

    PYTHONPATH=. .venv/bin/python benchmarks/live_parking.py --out results/live-parking
    PYTHONPATH=. .venv/bin/python benchmarks/live_parking.py --no-park --out results/live-no-park  # the same, unparked
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from devstack import mode_track
from devstack.cluster import Cluster, ClusterConfig
from worker_ext.tinymodel import ensure


def stream_completion(
    url: str, body: dict, times: list[float] | None = None
) -> tuple[int, str, list[float], float]:
    """(status, text, each token's arrival time, the start) of a streamed /v1/completions request (``times``:
    filled as the tokens arrive)."""
    t0, text = time.time(), []
    times = [] if times is None else times
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=600) as resp:
        if resp.status_code != 200:
            return resp.status_code, resp.read().decode(), [], t0
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or ():
                if choice.get("text"):
                    text.append(choice["text"])
                    times.append(time.time())
    return 200, "".join(text), times, t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv-tokens", type=int, default=1024, help="KV tokens per engine")
    p.add_argument("--prompt", type=int, default=1300, help="the long request's prompt tokens")
    p.add_argument("--max-tokens", type=int, default=400, help="the long request's output tokens")
    p.add_argument("--burst", type=int, default=60, help="short requests in the burst")
    p.add_argument("--burst-rate", type=float, default=8.0, help="req/s of the burst")
    p.add_argument(
        "--no-park", action="store_true", help="the router with --off park: the burst meets the group"
    )
    p.add_argument("--out", type=Path, default=Path("results/live-parking"))
    a = p.parse_args()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    model = ensure(Path(".flying/tiny-llama"), seed=0)
    cfg = ClusterConfig(
        model_path=model,
        num_engines=2,
        max_total_tokens=a.kv_tokens,
        log_dir=a.out.parent / f"{a.out.name}-logs",
        router_args=("--off", "park") if a.no_park else (),
    )
    ids = [int(x) for x in np.random.default_rng(0).integers(10, 1000, a.prompt)]
    long_body = {
        "model": cfg.served_model_name,
        "prompt": ids,
        "max_tokens": a.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    with Cluster(cfg, progress=print) as cluster:
        url = cluster.config.gateway_url
        status, reference, ref_times, ref_t0 = stream_completion(url, long_body)
        if status != 200:
            raise SystemExit(f"the long request alone failed: {status} {reference}")
        time.sleep(15)  # calm again (the long request's group goes a second after its last request)
        started = time.time()
        got: dict[str, tuple[int, str, list[float], float]] = {}
        live: list[float] = []
        long_run = threading.Thread(target=lambda: got.update(long=stream_completion(url, long_body, live)))
        long_run.start()
        while len(live) < 5 and long_run.is_alive() and time.time() - started < 120:
            time.sleep(0.02)  # the burst must meet it decoding
        burst_at = time.time()
        burst: list[tuple[int, float]] = []
        threads = []
        for i in range(a.burst):
            body = {
                "model": cfg.served_model_name,
                "prompt": f"burst request {i}: tell me a story",
                "max_tokens": 32,
                "temperature": 0,
            }
            t = threading.Thread(target=lambda b=body: burst.append(ttft(url, b)))
            t.start()
            threads.append(t)
            time.sleep(1 / a.burst_rate)
        for t in threads:
            t.join(300)
        long_run.join(600)
        ended = time.time()
        events = mode_track.decision_log(cluster.client(), cluster.keys, started)
    status, text, times, t0 = got["long"]
    gaps = [b - a_ for a_, b in zip(times, times[1:])]
    ok = [s for s, _ in burst if s == 200]
    ttfts = sorted(x for s, x in burst if s == 200)
    report = {
        "long_status": status,
        "long_same_text_as_alone": text == reference,
        "long_tokens": len(times),
        "long_alone_s": round(ref_times[-1] - ref_t0, 2) if ref_times else None,
        "long_s": round(times[-1] - t0, 2) if times else None,
        "long_longest_pause_s": round(max(gaps), 2) if gaps else None,
        "burst_started_s": round(burst_at - started, 2),
        "burst_ok": f"{len(ok)}/{len(burst)}",
        "burst_ttft_p50_ms": round(1000 * statistics.median(ttfts), 1) if ttfts else None,
        "burst_ttft_p90_ms": round(1000 * ttfts[int(0.9 * (len(ttfts) - 1))], 1) if ttfts else None,
        "parks": sum(1 for e in events if e.kind == "release" and "parking" in e.text),
        "resumes": sum(1 for e in events if e.kind == "bind" and "resumes epoch" in e.text),
        "seconds": round(ended - started, 1),
    }
    track = [f"t={e.ts - started:7.1f}s  {e.text}" for e in events]
    a.out.with_name(a.out.name + "-track.txt").write_text("\n".join(track) + "\n")
    a.out.with_name(a.out.name + "-report.json").write_text(json.dumps(report, indent=1))
    print("\n".join(track))
    print(json.dumps(report, indent=1))


def ttft(url: str, body: dict) -> tuple[int, float]:
    t0 = time.time()
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=300) as resp:
        if resp.status_code != 200:
            return resp.status_code, 0.0
        first = 0.0
        for line in resp.iter_lines():
            if not first and line.startswith("data: ") and '"text"' in line:
                first = time.time() - t0
        return (200, first) if first else (0, 0.0)


if __name__ == "__main__":
    main()
