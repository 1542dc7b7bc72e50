"""In-process pieces of a deployment for the gateway's tests: the real router and a real gateway (uvicorn) each in
a thread of their own, and a fake engine's heartbeat. Real Redis comes from the ``redis_server`` fixture."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import redis
import uvicorn

from flying import redis_conn
from flying.keys import Keys
from flying.messages import Heartbeat, encode
from flying.procs import free_port, spawn, stop, wait_healthy
from router.config import MANUAL_OFF, Limits, RouterConfig
from router.dispatcher import Dispatcher
from router.policy import PolicyConfig


class CountWords:
    """Prompt tokens without a tokenizer: words, plus 3 for the chat template."""

    def chat_ids(self, req):
        return [1] * (sum(len(m.text().split()) for m in req.messages) + 3)

    def completion(self, req):
        return len(req.prompt) if isinstance(req.prompt, list) else len(req.prompt.split())


def announce_engine(sync_redis, keys: Keys, engine: int = 0, url: str = "http://e0", **load) -> None:
    """A live engine as the router and gateways see it: heartbeat (10 min TTL), registry, ready key."""
    fields = dict(context_len=2048, max_total_tokens=4096, free_kv_tokens=4096) | load
    hb = Heartbeat(engine=engine, url=url, pid=1, model="tiny-llama", launch_id="L", ts=time.time(), **fields)
    sync_redis.set(keys.worker(engine), encode(hb), px=600_000)
    sync_redis.sadd(keys.workers, engine)
    sync_redis.set(keys.ready(engine), "L")


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """One HTTP/1.1 request from a scripted test engine's connection: (head, body), None once the client is gone."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    n = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
    return head, await reader.readexactly(n)


class RouterThread:
    """The real router's loop in a thread of its own (TestClient and uvicorn run the app in other threads)."""

    def __init__(self, redis_url: str, prefix: str, **settings) -> None:
        """``settings``: PolicyConfig or Limits fields (no automatic groups unless ``off`` says otherwise)."""
        self.redis_url, self.prefix = redis_url, prefix
        limit_names = {f.name for f in dataclasses.fields(Limits)}
        limits = {k: v for k, v in settings.items() if k in limit_names}
        policy = {"off": MANUAL_OFF} | {k: v for k, v in settings.items() if k not in limit_names}
        self.policy, self.limits = PolicyConfig(**policy), Limits(**limits)
        self.ready = threading.Event()
        self.thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)

    async def _main(self) -> None:
        client = redis_conn.async_client(self.redis_url)
        self.loop, self.stop_event = asyncio.get_running_loop(), asyncio.Event()
        self.ready.set()
        try:
            await Dispatcher(
                RouterConfig(key_prefix=self.prefix, policy=self.policy, limits=self.limits), client
            ).run(self.stop_event)
        finally:
            await client.aclose()

    def __enter__(self) -> RouterThread:
        self.thread.start()
        self.ready.wait(5)
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(5)


class ServerThread:
    """An ASGI app served by uvicorn on a free port, in a thread; ``url`` once it answers ``health_path``."""

    def __init__(self, app, health_path: str = "/health", make_server=uvicorn.Server) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = make_server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.health_path = health_path

    def __enter__(self) -> ServerThread:
        self.thread.start()
        wait_healthy(None, self.url, 30, path=self.health_path)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def gateway_on_port(port: str) -> psutil.Process:
    """The gateway process serving ``port`` among this test run's descendants (a full run has other gateways
    alive; a child another test left unreaped is a zombie, without a command line, and is skipped)."""
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except (psutil.ZombieProcess, psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "gateway.main" in cmd and f"--port {port} " in f"{cmd} ":
            return p
    raise LookupError(f"no gateway process serves port {port}")


@contextlib.contextmanager
def gateway_process(
    redis_url: str,
    keys: Keys,
    model: Path,
    logs: Path,
    env: dict[str, str] | None = None,
    args: tuple = (),
    engine_url: str | None = None,
) -> Iterator[str]:
    """A real ``flying-gateway`` process (its log: ``logs/gateway.log``), the real router in a thread and a fake
    engine process (or the engine at ``engine_url``) announced as engine 0; yields the gateway's URL."""
    from loadgen import fake_server

    engine_proc = None
    if engine_url is None:
        engine_proc, engine_url = fake_server.start_process(logs / "engine.log")
    announce_engine(redis.Redis.from_url(redis_url), keys, url=engine_url)
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.main", "--model-path", str(model), "--port", str(port),
           "--redis-url", redis_url, "--key-prefix", keys.prefix, *args]  # fmt: skip
    with RouterThread(redis_url, keys.prefix):
        gw = spawn(cmd, logs / "gateway.log", env=os.environ | (env or {}))
        try:
            wait_healthy(gw, f"http://127.0.0.1:{port}", 60)
            yield f"http://127.0.0.1:{port}"
        finally:
            stop(gw)
            stop(engine_proc)
