"""Killing a worker mid-burst: requests it had not answered are re-dispatched, streams it was running continue on
the other engine from the tokens already sent (greedy text identical to an uninterrupted run), the gateway stays
up."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

pytestmark = pytest.mark.e2e
BODY = {
    "model": "tiny-llama",
    "messages": [{"role": "user", "content": "a long story please"}],
    "max_tokens": 400,
    "ignore_eos": True,
    "temperature": 0,
}


async def non_stream(client: httpx.AsyncClient, url: str) -> tuple[int, dict]:
    resp = await client.post(url + "/v1/chat/completions", json=BODY)
    return resp.status_code, resp.json()


async def stream(client: httpx.AsyncClient, url: str) -> tuple[int, list[dict]]:
    events = []
    async with client.stream(
        "POST",
        url + "/v1/chat/completions",
        json={**BODY, "stream": True, "stream_options": {"include_usage": True}},
    ) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                events.append(json.loads(line[5:]))
        return resp.status_code, events


def text(events: list[dict]) -> str:
    return "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices") or ())


def test_worker_kill_redispatches_and_streams_continue_unbroken(cluster):
    url = cluster.config.gateway_url
    r = cluster.client()
    requeued_before = int(r.hget("flying:stats", "requeued") or 0)

    async def scenario():
        async with httpx.AsyncClient(timeout=180) as client:
            reference = await stream(client, url)  # uninterrupted
            tasks = [asyncio.create_task(non_stream(client, url)) for _ in range(8)]
            tasks += [asyncio.create_task(stream(client, url)) for _ in range(4)]
            await asyncio.sleep(1.0)
            assert r.scard("flying:inflight:1") > 0, "engine 1 must hold requests when it dies"
            cluster.kill_worker(1, signal.SIGKILL)
            return reference, await asyncio.gather(*tasks)

    (_, reference), results = asyncio.run(scenario())
    for status, body in results[:8]:  # nothing was sent to these clients yet: re-dispatched to engine 0
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 400
    for status, events in results[8:]:  # every stream, the killed engine's too, ends whole and identical
        assert status == 200
        assert not [e for e in events if "error" in e], events[-3:]
        assert events[-1]["usage"]["completion_tokens"] == 400
        assert text(events) == text(reference)
    assert int(r.hget("flying:stats", "requeued") or 0) > requeued_before
    deadline = time.monotonic() + 5
    while (health := httpx.get(url + "/health", timeout=5).json())["live_workers"] != [0]:
        assert time.monotonic() < deadline, f"dead engine still listed: {health}"
        time.sleep(0.2)
    assert health["status"] == "ok"
    ok = httpx.post(url + "/v1/chat/completions", json={**BODY, "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200

    cluster.start_worker(1)  # restore the shared cluster
    cluster.wait_live([1], timeout_s=240)
