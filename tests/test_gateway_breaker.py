"""An engine that drops every request: the real gateway (uvicorn) re-dispatches its requests to the healthy engine,
and after ``breaker_failures`` of them its circuit breaker opens, so the real router stops sending it any; once its
health endpoint answers again the router's probe closes the breaker. The healthy engine is the fake engine process;
the failing one a scripted server in a thread."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from flyctl.cli import render_status
from flying.breaker import Breaker, BreakerState, decode_all
from gateway.app import create_app
from gateway.config import GatewayConfig
from loadgen import fake_server
from router.metrics import ClusterCollector
from tests.stack import CountWords, RouterThread, ServerThread, announce_engine


class DroppingEngine:
    """Closes every completion request's connection before answering (what a crashed server's port does to a
    request in flight); ``/health`` answers 200 once ``healthy`` is set, else 503."""

    def __init__(self) -> None:
        self.healthy = threading.Event()
        self.dropped = self.probes = 0
        self.started = threading.Event()
        self.thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)

    async def _main(self) -> None:
        self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self.started.set()
        async with server:
            await self.stop.wait()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            if head.startswith(b"GET /health"):
                self.probes += 1
                status = b"200 OK" if self.healthy.is_set() else b"503 Service Unavailable"
                writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
                continue
            self.dropped += 1
            break
        writer.close()

    def __enter__(self) -> DroppingEngine:
        self.thread.start()
        self.started.wait(5)
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(5)


async def burst(url: str, n: int) -> list[int]:
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        out = []
        for _ in range(n // 4):  # a few at a time: the router spreads them over both engines
            rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=body) for _ in range(4)))
            out += [r.status_code for r in rs]
        return out


def breaker(sync_redis, keys) -> Breaker:
    return decode_all(sync_redis.hgetall(keys.breakers))[1]


def until(ok, what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


def breaker_gauge(sync_redis, keys) -> dict[str, float]:
    """The breaker gauge as the leading router exports it (a standby exports no cluster state)."""
    leader = (sync_redis.get(keys.router_lease) or b"").decode()
    fam = next(
        f
        for f in ClusterCollector(sync_redis, keys, leader).collect()
        if f.name == "flying_engine_breaker_state"
    )
    return {s.labels["engine"]: s.value for s in fam.samples}


@pytest.mark.slow
def test_a_failing_engine_is_left_out_until_its_probe_answers(redis_server, sync_redis, keys, tmp_path):
    proc, good_url = fake_server.start_process(tmp_path / "engine.log", ttft_ms=20, itl_ms=2)
    cfg = GatewayConfig(model_path="unused", redis_url=redis_server.url, key_prefix=keys.prefix,
                        breaker_failures=2, breaker_backoff_s=1.0, max_attempts=5)  # fmt: skip
    try:
        with DroppingEngine() as bad:
            announce_engine(sync_redis, keys, 0, good_url)
            announce_engine(sync_redis, keys, 1, bad.url)
            with (
                RouterThread(redis_server.url, keys.prefix, dispatch="least-loaded"),
                ServerThread(create_app(cfg, count_tokens=CountWords())) as gw,
            ):
                check(sync_redis, keys, bad, gw.url)
    finally:
        proc.kill()
        proc.wait()


def check(sync_redis, keys, bad: DroppingEngine, url: str) -> None:
    statuses = asyncio.run(burst(url, 24))
    assert statuses == [200] * 24, statuses
    b = breaker(sync_redis, keys)
    assert b.state in (BreakerState.OPEN, BreakerState.HALF_OPEN), b
    assert 2 <= bad.dropped <= 2 + 8, f"{bad.dropped} of 24 requests reached it: not left out once open"
    assert breaker_gauge(sync_redis, keys)["1"] >= 1
    assert " open " in render_status(sync_redis, keys) or "half_open" in render_status(sync_redis, keys)
    dropped = bad.dropped
    assert asyncio.run(burst(url, 8)) == [200] * 8
    assert bad.dropped == dropped, "open: no dispatch"

    until(lambda: bad.probes >= 1 and breaker(sync_redis, keys).trips == 2, "a failed probe reopens it")
    assert breaker(sync_redis, keys).state is BreakerState.OPEN
    bad.healthy.set()
    until(lambda: breaker(sync_redis, keys).state is BreakerState.CLOSED, "the probe closes the breaker")
    assert bad.probes >= 2, "probed while failing, then once healthy"
    assert breaker_gauge(sync_redis, keys) == {"1": 0.0}
    assert render_status(sync_redis, keys).count("closed") == 2
