"""Riding out a Redis restart that loses every key (no persistence): the real router, a real gateway (uvicorn),
and the workers' real liveness code (heartbeat thread, launcher's ready key) in front of a fake engine process.
Every request accepted before the outage is served; requests during it get 503 with Retry-After."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import httpx
import pytest
import redis

from devstack.redis_server import RedisServer
from flying.keys import Keys
from gateway.app import create_app
from gateway.config import GatewayConfig
from loadgen import fake_server
from tests.stack import CountWords, RouterThread, ServerThread
from worker_ext import launch
from worker_ext.heartbeat import HeartbeatConfig, HeartbeatPublisher


@pytest.fixture
def engine(tmp_path):
    proc, url = fake_server.start_process(tmp_path / "engine.log", ttft_ms=150, itl_ms=5)
    yield proc, url
    proc.kill()
    proc.wait()


class Worker:
    """What flying-worker and the plugin do for liveness, in threads: heartbeats and the launcher's ready key."""

    def __init__(self, redis_url: str, keys: Keys, url: str, proc) -> None:
        cfg = HeartbeatConfig(engine=0, url=url, model="tiny-llama", redis_url=redis_url, launch_id="L", key_prefix=keys.prefix)  # fmt: skip
        self.hb = HeartbeatPublisher(cfg)
        self.hb.beat(context_len=2048, max_total_tokens=4096, free_kv_tokens=4096)
        r = redis.Redis.from_url(redis_url, socket_timeout=1, socket_connect_timeout=1)
        import threading

        self.ready = threading.Thread(
            target=launch.keep_ready, args=(r, keys.ready(0), "L", proc), daemon=True
        )

    def __enter__(self):
        self.hb.start()
        self.ready.start()
        return self

    def __exit__(self, *exc):
        self.hb.stop()


async def stream(c: httpx.AsyncClient, i: int) -> tuple[int, str, str]:
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": f"q{i}"}],
        "max_tokens": 3,
        "stream": True,
    }
    r = await c.post("/v1/chat/completions", json=body)
    return r.status_code, r.headers.get("retry-after", ""), r.text


async def load_with_outage(url: str, server: RedisServer, tmp_path) -> tuple[list, list, RedisServer]:
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=100)) as c:
        before = [asyncio.create_task(stream(c, i)) for i in range(30)]
        await asyncio.sleep(0.6)
        await asyncio.to_thread(server.stop)
        await asyncio.sleep(0.3)
        during = [await stream(c, 100 + i) for i in range(3)]
        await asyncio.sleep(1.0)
        server = await asyncio.to_thread(RedisServer(port=server.port, data_dir=tmp_path).start)
        return await asyncio.gather(*before), during, server


@pytest.mark.slow
def test_a_redis_restart_that_loses_everything_fails_no_accepted_request(tmp_path, engine, keys):
    server = RedisServer(data_dir=tmp_path).start()
    proc, engine_url = engine
    cfg = GatewayConfig(model_path="unused", redis_url=server.url, key_prefix=keys.prefix, reconcile_s=0.5)
    app = create_app(cfg, count_tokens=CountWords())
    try:
        with (
            Worker(server.url, keys, engine_url, proc),
            RouterThread(server.url, keys.prefix, max_inflight_per_worker=2),
            ServerThread(app) as gw,
        ):
            t0 = time.monotonic()
            before, during, server = asyncio.run(load_with_outage(gw.url, server, tmp_path))
            took = time.monotonic() - t0
            readmitted = app.state.gateway.readmitted
            health = httpx.get(gw.url + "/health").json()
            metrics = httpx.get(gw.url + "/metrics").text
    finally:
        server.stop()
    statuses = [s for s, _, _ in before]
    assert statuses == [200] * 30, statuses
    assert all(text.rstrip().endswith("data: [DONE]") for _, _, text in before)
    assert readmitted > 0, "some requests were waiting when Redis lost them"
    for status, retry_after, text in during:
        assert status == 503 and int(retry_after) >= 1, text
    assert health["status"] == "ok" and health["live_workers"] == [0]
    counted = dict(re.findall(r'flying_gateway_requests_total\{[^}]*status="(\d+)"[^}]*\} (\S+)', metrics))
    assert "500" not in counted and float(counted["503"]) >= 3, f"a 503 answered is a 503 counted: {counted}"
    print(f"\n30 requests through a Redis restart in {took:.1f} s; {readmitted} re-admitted")


async def test_with_aof_a_restart_keeps_the_queue(tmp_path, keys):
    from flying.queue import RequestQueue
    from tests.test_queue import mk

    server = RedisServer(data_dir=tmp_path, aof=True).start()
    try:
        import redis.asyncio as aioredis

        r = aioredis.Redis.from_url(server.url)
        await RequestQueue(r, keys).admit(mk("kept"))
        await asyncio.sleep(1.2)  # appendfsync everysec
        await r.aclose()
        server.stop()
        server = RedisServer(port=server.port, data_dir=tmp_path, aof=True).start()
        r = aioredis.Redis.from_url(server.url)
        assert [q.id for q in await RequestQueue(r, keys).peek(10)] == ["kept"]
        await r.aclose()
    finally:
        server.stop()


async def test_a_stopped_router_hands_its_lease_over_at_once(aredis, keys, caplog):
    from router.config import RouterConfig
    from router.dispatcher import Dispatcher

    caplog.set_level(logging.INFO, logger="flying.router")
    first, second = (
        Dispatcher(RouterConfig(key_prefix=keys.prefix, lease_ms=10_000), aredis) for _ in range(2)
    )
    stop = asyncio.Event()
    task = asyncio.create_task(first.run(stop))
    while not first.leader:
        await asyncio.sleep(0.01)
    assert not await second.hold_lease()
    stop.set()
    await asyncio.wait_for(task, 5)
    assert await second.hold_lease(), "no 10 s wait for the lease to expire"
    assert f"router {first.router_id} stopped; lease released" in caplog.text, "a stop is logged"
    await second.release_lease()
    assert not await aredis.exists(keys.router_lease)


async def test_a_finish_during_an_outage_lands_when_redis_is_back(tmp_path, keys):
    """The end of a request whose stream ended while Redis was down is retried: its record does not stay
    ``assigned`` with its engine's inflight slot taken."""
    import redis.asyncio as aioredis

    from flying.queue import RequestQueue
    from flying.redis_conn import waiting_pool_client
    from gateway.config import GatewayConfig
    from gateway.service import Gateway
    from tests.stack import CountWords
    from tests.test_queue import mk

    server = RedisServer(data_dir=tmp_path, aof=True).start()
    cfg = GatewayConfig(model_path="unused", redis_url=server.url, key_prefix=keys.prefix)
    gw = Gateway(cfg, waiting_pool_client(cfg.redis_url, cfg.redis_max_connections, "test"), CountWords())
    try:
        r = aioredis.Redis.from_url(server.url)
        q = RequestQueue(r, keys)
        await q.admit(mk("x"))
        [x] = await q.peek(1)
        await q.assign(x, 0, "http://e0")
        await asyncio.sleep(1.2)  # appendfsync everysec
        await r.aclose()
        server.stop()
        ending = asyncio.ensure_future(gw.finish_surely("x", "done"))
        await asyncio.sleep(0.5)
        assert not ending.done(), "Redis is down: still retrying"
        server = RedisServer(port=server.port, data_dir=tmp_path, aof=True).start()
        await asyncio.wait_for(ending, 10)
        r = aioredis.Redis.from_url(server.url)
        q = RequestQueue(r, keys)
        assert (await q.get("x"))["state"] == "done"
        assert await r.scard(keys.inflight(0)) == 0
        await r.aclose()
    finally:
        await gw.r.aclose()
        server.stop()
