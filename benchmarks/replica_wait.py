"""What the queue's replica wait costs: admissions plus finishes per second, and the latency of one, through the
gateway's auto-pipelined connection against a real primary with one replica (loopback), with the wait (``WAIT 1
100`` after each write, group-committed) and without, alternating, at concurrency 1 and 64.

    PYTHONPATH=. .venv/bin/python benchmarks/replica_wait.py --ops 3000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from devstack.redis_server import RedisServer
from flying import redis_conn
from flying.keys import Keys
from flying.messages import QueuedRequest
from flying.queue import RequestQueue


async def run(url: str, ops: int, concurrency: int) -> tuple[float, float, float]:
    """(admit+finish per second, p50 ms, p99 ms) for ``ops`` pairs at ``concurrency``."""
    client = redis_conn.async_pool_client(url, max_connections=20, timeout=None)
    q = RequestQueue(client, Keys("bench" + uuid.uuid4().hex[:6]), pipe=redis_conn.autopipeline(client))
    latencies: list[float] = []
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            rid = uuid.uuid4().hex
            req = QueuedRequest(
                id=rid, gateway="g", model="m", prompt_tokens=1, max_tokens=1, enqueued_at=time.time()
            )
            t = time.perf_counter()
            await q.admit(req)
            await q.finish(rid, "done")
            latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(ops)))
    elapsed = time.perf_counter() - t0
    latencies.sort()
    await client.aclose()
    return ops / elapsed, latencies[len(latencies) // 2] * 1000, latencies[int(len(latencies) * 0.99)] * 1000


async def main(ops: int, rounds: int) -> None:
    primary = RedisServer().start()
    replica = RedisServer(replica_of=primary.port).start()
    time.sleep(1.0)  # the replica's first sync
    base = f"redis://127.0.0.1:{primary.port}/0"
    modes = {"no wait": base, "WAIT 1": base + "?wait=1&wait_ms=100"}
    try:
        for concurrency in (1, 64):
            n = ops if concurrency > 1 else ops // 3
            results: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
            for _ in range(rounds):
                for mode, url in modes.items():
                    results[mode].append(await run(url, n, concurrency))
            for mode, rows in results.items():
                rate, p50, p99 = (statistics.median(r[i] for r in rows) for i in range(3))
                print(
                    f"concurrency {concurrency:3d}  {mode:8s} {rate:7.0f} admit+finish/s  p50 {p50:6.2f} ms  "
                    f"p99 {p99:6.2f} ms  (median of {rounds})"
                )
    finally:
        replica.stop()
        primary.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    asyncio.run(main(a.ops, a.rounds))
