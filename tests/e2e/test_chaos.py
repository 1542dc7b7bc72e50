"""Chaos on a live CPU stack (Redis with AOF, 2 SGLang CPU workers, router plus a standby, gateway): faults under
load, each with its losses counted and asserted. Bounded: each scenario is a few seconds to a minute of load."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import httpx
import pytest

from flying.cluster import Cluster, ClusterConfig
from flying.procs import spawn, stop

pytestmark = [pytest.mark.e2e, pytest.mark.chaos, pytest.mark.timeout(600)]
BODY = {
    "model": "tiny-llama",
    "messages": [{"role": "user", "content": "tell me"}],
    "max_tokens": 8,
    "stream": True,
}


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    config = ClusterConfig(
        model_path=tiny_model,
        num_engines=2,
        log_dir=tmp_path_factory.mktemp("chaos"),
        max_total_tokens=4096,
        bindable=False,
        router_args=("--manual", "--max-inflight-per-worker", "4"),
        gateway_args=("--max-queue", "100"),
    )
    with Cluster(config, progress=print) as c:
        yield c


async def one(c: httpx.AsyncClient, i: int) -> tuple[int, str, float]:
    """(status, Retry-After, when it was sent); a 200 counts only if its stream ended with [DONE]."""
    sent = time.monotonic()
    try:
        r = await c.post(
            "/v1/chat/completions", json=BODY | {"messages": [{"role": "user", "content": f"q {i}"}]}
        )
    except httpx.HTTPError:
        return -1, "", sent
    if r.status_code == 200 and not r.text.rstrip().endswith("data: [DONE]"):
        return -2, "", sent
    return r.status_code, r.headers.get("retry-after", ""), sent


async def paced(url: str, n: int, rate: float) -> list[tuple[int, str, float]]:
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=400)) as c:
        tasks = []
        for i in range(n):
            tasks.append(asyncio.create_task(one(c, i)))
            if rate != float("inf"):
                await asyncio.sleep(1 / rate)
        return await asyncio.gather(*tasks)


def counts(results) -> dict[int, int]:
    out: dict[int, int] = {}
    for status, _, _ in results:
        out[status] = out.get(status, 0) + 1
    return out


def test_300_at_once_get_200_or_429_with_retry_after(stack):
    results = asyncio.run(paced(stack.config.gateway_url, 300, float("inf")))
    print("burst of 300:", counts(results))
    assert set(counts(results)) <= {200, 429}, counts(results)
    assert all(int(ra) >= 1 for s, ra, _ in results if s == 429)
    assert counts(results).get(200, 0) >= 80


def test_overload_ends_every_request_with_200_429_or_a_deadline_504(stack):
    """40 requests/s for 30 s (about 4x what two CPU engines serve): nothing but 200, 429 with Retry-After, or
    504 queue_timeout."""
    t0 = time.monotonic()
    results = asyncio.run(paced(stack.config.gateway_url, 1200, 40))
    print(f"overload 40 req/s x 30 s: {counts(results)} in {time.monotonic() - t0:.0f} s")
    assert set(counts(results)) <= {200, 429, 504}, counts(results)
    assert all(int(ra) >= 1 for s, ra, _ in results if s == 429)
    assert counts(results).get(200, 0) >= 100


def test_redis_kill_and_restart_under_load_loses_no_accepted_request(stack):
    """SIGKILL Redis mid-load, restart after 1 s (AOF everysec): every request accepted before the kill is
    served; requests during the outage get 503 + Retry-After; a request 5 s after the restart is served."""

    async def scenario():
        load = asyncio.create_task(paced(stack.config.gateway_url, 40, 8))
        await asyncio.sleep(2.0)
        killed = time.monotonic()
        await asyncio.to_thread(stack.restart_redis, 1.0, signal.SIGKILL)
        back = time.monotonic()
        async with httpx.AsyncClient(base_url=stack.config.gateway_url, timeout=60) as c:
            first_ok = None
            while first_ok is None and time.monotonic() - back < 10:
                status, _, _ = await one(c, 999)
                if status == 200:
                    first_ok = time.monotonic() - back
                else:
                    await asyncio.sleep(0.25)
        return await load, killed, back, first_ok

    results, killed, back, first_ok = asyncio.run(scenario())
    print(f"redis restart: {counts(results)}; served again {first_ok:.1f} s after the restart")
    before = [r for r in results if r[2] < killed]
    assert all(s == 200 for s, _, _ in before), counts(before)
    assert set(counts(results)) <= {200, 503}, counts(results)
    assert all(int(ra) >= 1 for s, ra, _ in results if s == 503)
    assert first_ok is not None and first_ok < 5


def test_kill_9_of_the_router_with_a_standby_loses_nothing(stack):
    standby = spawn(
        [sys.executable, "-m", "router.main", "--redis-url", stack.redis_url, "--key-prefix", stack.config.key_prefix,
         "--manual", "--max-inflight-per-worker", "4"],
        stack.log("router-standby"),
    )  # fmt: skip
    try:

        async def scenario():
            load = asyncio.create_task(paced(stack.config.gateway_url, 40, 8))
            await asyncio.sleep(2.0)
            await asyncio.to_thread(stack.kill_router)
            return await load

        results = asyncio.run(scenario())
        print("router kill -9 with a standby:", counts(results))
        assert counts(results) == {200: 40}
    finally:
        stop(standby)
        stack.start_router()
