"""The gateway benchmarks' stack: a private Redis, ``loadgen.fake_server`` engines (their own processes, TTFT 0)
behind the workers' real liveness code (heartbeat thread, launcher's ready key), the router (``--manual``) and one
gateway as real processes. Shared by ``gateway_hop.py`` and ``gateway_throughput.py``."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis

from devstack.redis_server import RedisServer
from flying.keys import Keys
from flying.procs import free_port, spawn, stop, wait_healthy
from loadgen.fake_server import start_process
from worker_ext import launch
from worker_ext.heartbeat import HeartbeatConfig, HeartbeatPublisher
from worker_ext.tinymodel import ensure


@dataclass
class GatewayStack:
    """The running stack; ``tmp`` holds its logs."""

    tmp: Path
    server: RedisServer
    router: subprocess.Popen
    gateway: subprocess.Popen
    port: int  # the gateway's
    engines: list[tuple[subprocess.Popen, str]] = field(default_factory=list)  # (process, base URL)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def gateway_stack(
    name: str,
    engines: int = 1,
    max_total_tokens: int = 65536,
    router_args: Sequence[str] = (),
    gateway_args: Sequence[str] = (),
    ttft_ms: float = 0,
) -> Iterator[GatewayStack]:
    """The stack, its gateway healthy, with ``engines`` fake engines of ``max_total_tokens`` KV each (a pool of
    that many engines) answering after ``ttft_ms``; logs in a fresh ``/tmp/{name}-*`` directory. Everything is
    stopped on exit."""
    tmp = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    model = ensure(Path(".flying/test-model"), seed=0)
    server = RedisServer(data_dir=tmp / "redis").start()
    keys, r = Keys("flying"), redis.Redis.from_url(server.url)
    procs: list[subprocess.Popen] = []
    beats: list[HeartbeatPublisher] = []
    try:
        fakes = []
        for e in range(engines):
            proc, url = start_process(tmp / f"engine{e}.log", ttft_ms=ttft_ms, itl_ms=0)
            procs.append(proc)
            fakes.append((proc, url))
            hb = HeartbeatPublisher(
                HeartbeatConfig(engine=e, url=url, model="tiny-llama", redis_url=server.url, launch_id="L")
            )
            hb.beat(
                context_len=4096,
                max_total_tokens=max_total_tokens,
                free_kv_tokens=max_total_tokens,
                num_engines=engines,
            )
            hb.start()
            beats.append(hb)
            threading.Thread(
                target=launch.keep_ready, args=(r, keys.ready(e), "L", proc), daemon=True
            ).start()
        common = ["--redis-url", server.url]
        router = spawn(
            [sys.executable, "-m", "router.main", *common, "--manual", *router_args], tmp / "router.log"
        )
        procs.insert(0, router)
        port = free_port()
        gw_cmd = [
            sys.executable,
            "-m",
            "gateway.main",
            *common,
            "--model-path",
            str(model),
            "--port",
            str(port),
            *gateway_args,
        ]
        gateway = spawn(gw_cmd, tmp / "gateway.log")
        procs.insert(0, gateway)
        stack = GatewayStack(tmp, server, router, gateway, port, fakes)
        wait_healthy(gateway, stack.url, 60)
        yield stack
    finally:
        for proc in procs:  # the gateway, the router, then the engines
            stop(proc)
        for hb in beats:
            hb.stop()
        server.stop()
