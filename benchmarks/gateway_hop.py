"""The gateway's hop: streaming TTFT through gateway + Redis queue + router, against the same request sent straight
to the engine, at light load (one request at a time, alternating).

The engine is ``loadgen.fake_server`` (its own process) behind the workers' real liveness code (heartbeat thread,
launcher's ready key); Redis, the router (``--manual``) and the gateway are real processes.

    .venv/bin/python benchmarks/gateway_hop.py --pairs 300 --rounds 5

"Added" is the via-gateway percentile minus the direct one, per round; the last line is the median over rounds (the
2-core machine is shared and one round in several is disturbed). The pairwise differences are printed too.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx
from _stack import gateway_stack

BODY = {
    "model": "tiny-llama",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
    "stream": True,
}


async def ttft_ms(c: httpx.AsyncClient, url: str) -> float:
    t0 = time.perf_counter()
    async with c.stream("POST", url + "/v1/chat/completions", json=BODY) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {(await r.aread())[:200]!r}")
        lines = r.aiter_lines()
        async for line in lines:
            if line.startswith("data:"):
                first = (time.perf_counter() - t0) * 1000
                break
        async for _ in lines:
            pass
    return first


async def measure(gateway: str, engine: str, pairs: int, warmup: int = 20) -> tuple[list[float], list[float]]:
    via, direct = [], []
    async with httpx.AsyncClient(timeout=30) as c:
        for i in range(warmup + pairs):
            a, b = await ttft_ms(c, gateway), await ttft_ms(c, engine)
            if i % 2:  # alternate which goes first
                b, a = await ttft_ms(c, engine), await ttft_ms(c, gateway)
            if i >= warmup:
                via.append(a)
                direct.append(b)
    return via, direct


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if q < 100 else max(xs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=300, help="pairs per round")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds on the same stack; the medians of their results are quoted",
    )
    a = p.parse_args()
    with gateway_stack("gateway-hop") as stack:
        engine_url = stack.engines[0][1]
        rounds = [asyncio.run(measure(stack.url, engine_url, a.pairs)) for _ in range(a.rounds)]
    tmp = stack.tmp
    print(
        f"{a.rounds} rounds of {a.pairs} alternating pairs, streaming, max_tokens 4, one at a time (logs in {tmp})"
    )
    added_p50, added_p99 = [], []
    for i, (via, direct) in enumerate(rounds, 1):
        added = [v - d for v, d in zip(via, direct)]
        print(f" round {i}")
        for name, xs in (("direct", direct), ("via gateway", via), ("added (pairwise)", added)):
            print(
                f"  {name:18s} TTFT p50 {pct(xs, 50):6.2f} ms  p90 {pct(xs, 90):6.2f} ms  p99 {pct(xs, 99):6.2f} ms"
            )
        added_p50.append(pct(via, 50) - pct(direct, 50))
        added_p99.append(pct(via, 99) - pct(direct, 99))
        print(f"  added p50 {added_p50[-1]:.2f} ms, p99 {added_p99[-1]:.2f} ms")
    print(
        f"median of {a.rounds} rounds: added p50 {statistics.median(added_p50):.2f} ms, "
        f"p99 {statistics.median(added_p99):.2f} ms (target: 2 ms, 5 ms)"
    )


if __name__ == "__main__":
    main()
