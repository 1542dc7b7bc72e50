"""Graceful drain of a gateway (uvicorn, the real router, a fake engine process): after SIGTERM it is not ready,
refuses new requests with 503 + Retry-After, finishes the stream in progress, then exits."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.drain import Drain, DrainingServer
from loadgen import fake_server
from tests.stack import CountWords, RouterThread, ServerThread, announce_engine

BODY = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.fixture
def engine_url(tmp_path):
    proc, url = fake_server.start_process(tmp_path / "engine.log", ttft_ms=50, itl_ms=60)
    yield url
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("grace_s", [30.0, 0.5], ids=["finishes", "cut-off"])
def test_sigterm_drains_then_exits(redis_server, sync_redis, keys, engine_url, grace_s):
    announce_engine(sync_redis, keys, url=engine_url)
    cfg = GatewayConfig(model_path="unused", redis_url=redis_server.url, key_prefix=keys.prefix)
    drain = Drain()
    app = create_app(cfg, count_tokens=CountWords(), drain=drain)

    async def scenario(gw: ServerThread) -> tuple[httpx.Response | Exception, list[httpx.Response], float]:
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
            stream = asyncio.create_task(c.post("/v1/chat/completions", json=BODY | {"max_tokens": 25}))
            while drain.active == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            gw.server.handle_exit(signal.SIGTERM, None)
            t0 = time.monotonic()
            refused = [await c.get("/health"), await c.post("/v1/chat/completions", json=BODY)]
            try:
                first = await stream
            except httpx.HTTPError as exc:
                first = exc
            await asyncio.to_thread(gw.thread.join, 15)
            return first, refused, time.monotonic() - t0

    with (
        RouterThread(redis_server.url, keys.prefix),
        ServerThread(app, make_server=lambda c: DrainingServer(c, drain, grace_s)) as gw,
    ):
        first, (health, new), took = asyncio.run(scenario(gw))
        assert not gw.thread.is_alive(), "the gateway exited"
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert new.status_code == 503 and new.json()["error"]["code"] == "draining" and new.headers["retry-after"]
    if grace_s > 1:
        assert isinstance(first, httpx.Response) and first.status_code == 200
        assert first.text.rstrip().endswith("data: [DONE]"), "the stream in progress finished whole"
        assert took < 5
    else:
        assert took < 0.5 + 6, "cut off after the grace (plus uvicorn's own 5 s at most)"
