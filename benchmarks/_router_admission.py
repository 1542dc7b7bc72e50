"""The admission rate one router sustains: a real ``flying-router`` process over a real ``redis-server``, fake engines
(heartbeats and ready keys written as workers write them, nodes of 8), requests admitted by the gateway's own
admission script, keeping a backlog in the queue. The rate is the router's ``assigned`` counter in ``flying:stats``
over the measured seconds (requests moved from the queue to an engine, one atomic script each), so it measures the
router's rounds: snapshot reads, the policy, the assignments. Engines never finish their requests: the slot cap
(``--max-inflight-per-worker``) is set high enough that no engine fills up, so every round dispatches a full
``--peek`` of requests.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import redis.asyncio as aioredis

from devstack.redis_server import RedisServer
from flying.autopipeline import AutoPipeline
from flying.keys import Keys
from flying.messages import Heartbeat, QueuedRequest, encode
from flying.queue import RequestQueue

PER_NODE = 8
BACKLOG = 3_000  # requests kept waiting
ENGINES = (8, 128, 1024)


async def beat(r: aioredis.Redis, keys: Keys, n: int) -> None:
    """Heartbeats and ready keys of ``n`` live engines, and the liveness key of the gateway that admits (no expiry:
    they stay live for the run)."""
    pipe = r.pipeline(transaction=False)
    for e in range(n):
        hb = Heartbeat(
            engine=e,
            url=f"http://10.0.{e // PER_NODE}.{e % PER_NODE}:30000",
            pid=1,
            model="m",
            launch_id=f"L{e}",
            free_kv_tokens=200_000,
            max_total_tokens=200_000,
            context_len=8192,
            num_engines=PER_NODE,
            ts=time.time(),
        )
        pipe.set(keys.worker(e), encode(hb))
        pipe.set(keys.ready(e), f"L{e}")
        pipe.sadd(keys.workers, e)
    pipe.set(keys.gateway("bench"), "1")  # the gateway that admits is live (no expiry: for the run)
    await pipe.execute()


async def keep_backlog(q: RequestQueue, r: aioredis.Redis, keys: Keys, stop: asyncio.Event) -> int:
    """Admit requests (the gateway's script) whenever fewer than :data:`BACKLOG` wait; returns how many."""
    n = 0
    while not stop.is_set():
        missing = BACKLOG - int(await r.zcard(keys.queue))
        batch = [
            QueuedRequest(
                id=f"r{n + i}",
                priority="normal",
                model="m",
                prompt_tokens=512,
                max_tokens=128,
                gateway="bench",
                enqueued_at=time.time(),
            )
            for i in range(max(0, min(missing, 500)))
        ]
        await asyncio.gather(*(q.admit(x) for x in batch))
        n += len(batch)
        if not batch:
            await asyncio.sleep(0.005)
    return n


async def one_size(server: RedisServer, n_engines: int, seconds: float) -> tuple[float, float, float, int]:
    """(assigned per second, the router's and Redis's CPU share, the smallest backlog seen) with ``n_engines``
    fake engines."""
    redis_url = server.url
    r = aioredis.from_url(redis_url)
    await r.flushall()
    keys = Keys("flying")
    await beat(r, keys, n_engines)
    pipe = AutoPipeline(port=server.port)  # the gateway's way: every admission of a loop turn in one write
    q = RequestQueue(r, keys, pipe)
    stop = asyncio.Event()
    producer = asyncio.create_task(keep_backlog(q, r, keys, stop))
    await asyncio.sleep(0.5)  # a backlog before the router starts
    cmd = [
        sys.executable,
        "-m",
        "router.main",
        "--redis-url",
        redis_url,
        "--metrics-port",
        "0",
        "--max-inflight-per-worker",
        "1000000",
    ]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    router = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await asyncio.sleep(2.0)  # lease, first rounds
        a0, c0, t0 = int(await r.hget(keys.stats, "assigned") or 0), cpu_s(router.pid), time.monotonic()
        s0 = cpu_s(server.proc.pid) if server.proc else 0.0
        depths = []
        for _ in range(int(seconds / 0.25)):
            await asyncio.sleep(0.25)
            depths.append(int(await r.zcard(keys.queue)))
        a1, c1, t1 = int(await r.hget(keys.stats, "assigned") or 0), cpu_s(router.pid), time.monotonic()
        s1 = cpu_s(server.proc.pid) if server.proc else 0.0
    finally:
        router.terminate()
        router.wait(10)
        stop.set()
        await producer
        pipe.close()
        await r.aclose()
    dt = t1 - t0
    return (a1 - a0) / dt, (c1 - c0) / dt, (s1 - s0) / dt, min(depths)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def admission_table(seconds: float) -> None:
    server = RedisServer().start()
    try:
        print(
            "\n| engines (nodes) | assigned per second | router CPU (cores) | Redis CPU (cores) | smallest backlog |"
        )
        print("|---|---|---|---|---|")
        for n in ENGINES:
            rate, cpu, rcpu, low = await one_size(server, n, seconds)
            print(f"| {n:,} ({n // PER_NODE}) | {rate:,.0f} | {cpu:.2f} | {rcpu:.2f} | {low:,} |")
            sys.stdout.flush()
    finally:
        server.stop()
