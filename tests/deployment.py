"""A deployment of real processes for the end-to-end tests of Redis failover and of many gateways and routers: fake
engine processes (``loadgen.fake_server``) with the workers' real liveness code (heartbeat thread, launcher's ready
key) in threads, any number of ``flying-gateway`` and ``flying-router`` processes, all pointed at one Redis URL
(plain or ``redis+sentinel://``); and a steady load that records every request's outcome."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from flying import redis_conn
from flying.keys import Keys
from flying.procs import free_port, spawn, stop, wait_healthy
from loadgen import fake_server
from worker_ext import launch
from worker_ext.heartbeat import HeartbeatConfig, HeartbeatPublisher


@dataclass
class Engine:
    proc: subprocess.Popen
    url: str
    heartbeat: HeartbeatPublisher
    stop_ready: threading.Event


@dataclass
class Deployment:
    redis_url: str
    keys: Keys
    model: Path
    logs: Path
    engines: list[Engine] = field(default_factory=list)
    gateways: list[tuple[subprocess.Popen, str]] = field(default_factory=list)
    routers: list[subprocess.Popen] = field(default_factory=list)

    def start_engine(self, ttft_ms: float = 40, itl_ms: float = 4) -> Engine:
        """A fake engine process announced as the next engine index, its heartbeat and ready key kept by threads."""
        i = len(self.engines)
        proc, url = fake_server.start_process(self.logs / f"engine{i}.log", ttft_ms=ttft_ms, itl_ms=itl_ms)
        cfg = HeartbeatConfig(engine=i, url=url, model="tiny-llama", redis_url=self.redis_url, launch_id="L",
                              key_prefix=self.keys.prefix)  # fmt: skip
        hb = HeartbeatPublisher(cfg)
        hb.beat(context_len=2048, max_total_tokens=4096, free_kv_tokens=4096)
        hb.start()
        stop_ready = threading.Event()
        r = redis_conn.sync_client(self.redis_url, socket_timeout=1, socket_connect_timeout=1)
        args = (r, self.keys.ready(i), "L", proc, stop_ready.is_set)
        threading.Thread(target=launch.keep_ready, args=args, daemon=True).start()
        self.engines.append(Engine(proc, url, hb, stop_ready))
        return self.engines[-1]

    def start_gateways(self, n: int, *args: str) -> list[str]:
        """``n`` gateway processes started together (each loads its tokenizer for some seconds); their URLs."""
        started = []
        for _ in range(n):
            port = free_port()
            cmd = [sys.executable, "-m", "gateway.main", "--model-path", str(self.model), "--port", str(port),
                   "--redis-url", self.redis_url, "--key-prefix", self.keys.prefix, *args]  # fmt: skip
            proc = spawn(cmd, self.logs / f"gateway{len(self.gateways)}.log", env=dict(os.environ))
            self.gateways.append((proc, f"http://127.0.0.1:{port}"))
            started.append(self.gateways[-1])
        for proc, url in started:
            wait_healthy(proc, url, 90)
        return [url for _, url in started]

    def start_router(self, *args: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "router.main", "--redis-url", self.redis_url, "--key-prefix", self.keys.prefix,
               "--manual", *args]  # fmt: skip
        proc = spawn(cmd, self.logs / f"router{len(self.routers)}.log", env=dict(os.environ))
        self.routers.append(proc)
        return proc

    def stop(self) -> None:
        for proc, _ in self.gateways:
            stop(proc)
        for proc in self.routers:
            stop(proc)
        for e in self.engines:
            e.stop_ready.set()
            e.heartbeat.stop()
            stop(e.proc)

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class Outcome:
    """One request: which gateway, when it was sent and answered (monotonic seconds), its status and text."""

    gateway: str
    sent: float
    done: float
    status: int
    text: str


async def one(c: httpx.AsyncClient, url: str, i: int) -> Outcome:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 6}
    sent = time.monotonic()
    try:
        r = await c.post(url + "/v1/chat/completions", json=body)
        status, text = r.status_code, r.text[:300]
    except httpx.HTTPError as exc:
        status, text = 0, repr(exc)
    return Outcome(url, sent, time.monotonic(), status, text)


async def steady(
    urls: list[str], seconds: float, rate: float, events: dict[float, Callable[[], object]] | None = None
) -> list[Outcome]:
    """Open-loop load: ``rate`` requests per second to each gateway URL for ``seconds`` (each sent on time, however
    long the ones before take), then every answer awaited; ``events``: callables run (in a thread) at these
    offsets in seconds."""
    tasks: list[asyncio.Task[Outcome]] = []

    async def fire() -> None:
        t0 = time.monotonic()
        for at, action in sorted((events or {}).items()):
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            await asyncio.to_thread(action)

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=1000)) as c:
        events_done = asyncio.create_task(fire())
        t0, i = time.monotonic(), 0
        while (due := t0 + i / rate) < t0 + seconds:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tasks += [asyncio.create_task(one(c, url, i * len(urls) + k)) for k, url in enumerate(urls)]
            i += 1
        await events_done
        return list(await asyncio.gather(*tasks))
