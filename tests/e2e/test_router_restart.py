"""kill -9 of the router in the middle of 50 requests loses none of them."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

pytestmark = pytest.mark.e2e


async def burst(url: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=180) as client:
        body = {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "count with me"}],
            "max_tokens": 16,
            "ignore_eos": True,
        }
        return await asyncio.gather(
            *(client.post(url + "/v1/chat/completions", json=body) for _ in range(50))
        )


def test_router_kill_and_restart_loses_nothing(cluster):
    r = cluster.client()
    before = {k: int(v) for k, v in r.hgetall("flying:stats").items()}

    async def scenario():
        task = asyncio.create_task(burst(cluster.config.gateway_url, 50))
        await asyncio.sleep(0.7)  # some requests assigned, most waiting in Redis (4 per worker at most)
        cluster.kill_router()
        killed_with_waiting = r.zcard("flying:queue")
        await asyncio.sleep(1.0)
        cluster.start_router()
        return killed_with_waiting, await task

    t0 = time.monotonic()
    waiting_at_kill, responses = asyncio.run(scenario())
    assert waiting_at_kill > 0, "the kill must hit while requests wait in the queue"
    assert [x.status_code for x in responses] == [200] * 50
    assert all(x.json()["usage"]["completion_tokens"] == 16 for x in responses)
    after = {k: int(v) for k, v in r.hgetall("flying:stats").items()}
    assert after[b"assigned"] - before.get(b"assigned", 0) == 50, "each request assigned exactly once"
    assert r.zcard("flying:queue") == 0
    print(f"50 requests across a router kill -9 in {time.monotonic() - t0:.1f} s")
