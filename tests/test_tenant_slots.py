"""A tenant's max_concurrent across gateways (gateway.tenants.TenantSlots): the shared counts in a real Redis, a dead
gateway's counts dropped, and two real gateways (uvicorn) in front of one fake engine holding the limit together."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.tenants import Tenants, TenantSlots
from loadgen import fake_server
from tests.stack import CountWords, RouterThread, ServerThread, announce_engine


async def test_the_count_is_the_deployments_and_a_dead_gateways_share_goes(aredis, keys):
    one, two = TenantSlots(aredis, keys, "g1"), TenantSlots(aredis, keys, "g2")
    for gw in ("g1", "g2"):
        await aredis.set(keys.gateway(gw), "1", px=60_000)
    assert await one.enter("t", 2) and await two.enter("t", 2)
    assert not await one.enter("t", 2) and not await two.enter("t", 2), "2 in progress across both"
    assert await one.enter("other", 2), "per tenant"
    one.leave("t")
    await one.settle()
    assert await two.enter("t", 2)
    assert await aredis.hgetall(keys.tenant_inflight("t")) == {b"g2": b"2"}
    await aredis.delete(keys.gateway("g2"))  # g2 died: its requests are gone with it
    assert await one.enter("t", 2) and await one.enter("t", 2) and not await one.enter("t", 2)
    assert await aredis.hgetall(keys.tenant_inflight("t")) == {b"g1": b"2"}
    one.leave("t")
    one.leave("t")
    await one.settle()
    assert not await aredis.exists(keys.tenant_inflight("t")), "no count left behind"


KEYS = '[[tenant]]\nname = "solo"\nkey = "ks"\nmax_concurrent = 1\n'


async def chat(url: str, **kw) -> httpx.Response:
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "stream": True,
    }
    async with httpx.AsyncClient(timeout=30) as c:
        return await c.post(
            url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer ks"}, **kw
        )


async def two_at_once(a: str, b: str) -> tuple[httpx.Response, httpx.Response]:
    first = asyncio.create_task(chat(a))
    await asyncio.sleep(0.8)  # in progress on gateway a (the engine takes 2 s to answer)
    second = await chat(b)
    return await first, second


@pytest.mark.slow
def test_two_gateways_hold_a_tenants_max_concurrent_together(redis_server, sync_redis, keys, tmp_path):
    proc, engine_url = fake_server.start_process(tmp_path / "engine.log", ttft_ms=2000)
    f = tmp_path / "keys.toml"
    f.write_text(KEYS)
    announce_engine(sync_redis, keys, url=engine_url)

    def gateway() -> ServerThread:
        cfg = GatewayConfig(model_path="unused", redis_url=redis_server.url, key_prefix=keys.prefix)
        return ServerThread(create_app(cfg, count_tokens=CountWords(), tenants=Tenants(None, str(f))))

    try:
        with RouterThread(redis_server.url, keys.prefix), gateway() as a, gateway() as b:
            first, second = asyncio.run(two_at_once(a.url, b.url))
            assert first.status_code == 200
            assert second.status_code == 429 and second.headers["retry-after"] == "1", second.text
            assert "max_concurrent" in second.json()["error"]["message"]
            deadline = time.monotonic() + 5
            while sync_redis.exists(keys.tenant_inflight("solo")):
                assert time.monotonic() < deadline, "the finished request's count stays"
                time.sleep(0.05)
            assert asyncio.run(chat(b.url)).status_code == 200, "free again once the first ended"
    finally:
        proc.kill()
        proc.wait()
