"""Waiting does not scale with the queue: a gateway holding 10,000 waiting requests uses a bounded number of Redis
connections, its event loop stays responsive, and assignments still arrive by message or by reconciliation."""

from __future__ import annotations

import asyncio
import statistics
import time

import msgspec
import pytest

from flying.queue import RequestQueue
from flying.redis_conn import waiting_pool_client
from gateway.api.schemas import ChatCompletionRequest, Message
from gateway.config import GatewayConfig
from gateway.service import Gateway
from tests.stack import CountWords, announce_engine

N = 10_000


async def loop_lag(seconds: float, tick_s: float = 0.01) -> list[float]:
    """How late each of many short sleeps wakes up, over ``seconds``."""
    lags, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.monotonic()
        await asyncio.sleep(tick_s)
        lags.append(time.monotonic() - t - tick_s)
    return lags


def connections(sync_redis, name: str) -> int:
    return sum(1 for c in sync_redis.client_list() if c.get("name") == name)


@pytest.mark.slow
async def test_ten_thousand_waiting_requests(redis_server, sync_redis, aredis, keys):
    announce_engine(sync_redis, keys)
    sync_redis.set(keys.router_lease, "absent-router", px=600_000)  # not degraded: admission stays open
    cfg = GatewayConfig(
        model_path="unused", redis_url=redis_server.url, key_prefix=keys.prefix, max_queue=2 * N,
        queue_timeout_s=300, wait_budget_normal_s=300, max_wait_s=300, reconcile_s=0.5,
    )  # fmt: skip
    gw = Gateway(cfg, waiting_pool_client(cfg.redis_url, cfg.redis_max_connections, "test"), CountWords())
    await gw.start()
    req = ChatCompletionRequest(model="tiny-llama", messages=[Message(role="user", content="hi")])
    connected = asyncio.create_task(asyncio.Event().wait())

    async def one():
        adm = await gw.admit(req, "normal")
        return await gw.wait_assignment(adm, await gw.enqueue(adm), connected)

    try:
        idle = await loop_lag(1.0)
        t0 = time.monotonic()
        tasks = [asyncio.create_task(one()) for _ in range(N)]
        while len(gw.waiter.admitted) < N:
            await asyncio.sleep(0.1)
            assert time.monotonic() - t0 < 120, f"only {len(gw.waiter.admitted)} admitted"
        admit_s = time.monotonic() - t0
        busy = await loop_lag(3.0)  # six reconciliation rounds over all 10,000
        used = connections(sync_redis, f"flying-gw-{cfg.gateway_id}")
        print(
            f"\nadmitted {N} in {admit_s:.1f} s; {used} Redis connections; loop lag p50/max "
            f"idle {statistics.median(idle) * 1e3:.1f}/{max(idle) * 1e3:.1f} ms, "
            f"with {N} waiting {statistics.median(busy) * 1e3:.1f}/{max(busy) * 1e3:.1f} ms"
        )
        assert used <= cfg.redis_max_connections + 1 < 50
        assert statistics.median(busy) < 0.02 and max(busy) < 0.3, "the event loop stays responsive"
        assert all(not t.done() for t in tasks), "nobody was assigned, nobody gave up"

        q = RequestQueue(aredis, keys)
        heads = await q.peek(20)
        for r in heads[:10]:  # the message goes to another gateway's channel: only reconciliation finds these
            await q.assign(msgspec.structs.replace(r, gateway="elsewhere"), 0, "http://e0")
        for r in heads[10:]:
            await q.assign(r, 0, "http://e0")
        await asyncio.sleep(1.2)
        done = [t.result() for t in tasks if t.done()]
        assert sorted(a.id for a in done) == sorted(r.id for r in heads)
        assert gw.waiter.reconciled == 10
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        connected.cancel()
        await gw.stop()
        await gw.r.aclose()


async def test_a_long_prompt_is_tokenized_off_the_event_loop(redis_server, sync_redis, keys):
    import threading

    from gateway.admission import HUGE_PROMPT_CHARS, OFF_LOOP_CHARS

    class Where(CountWords):
        threads: list[str] = []
        now = peak = 0

        def chat_ids(self, req):
            self.threads.append(threading.current_thread().name)
            Where.now += 1
            Where.peak = max(Where.peak, Where.now)
            time.sleep(0.05)
            Where.now -= 1
            return super().chat_ids(req)

    announce_engine(sync_redis, keys, context_len=10**6, max_total_tokens=10**6, free_kv_tokens=10**6)
    sync_redis.set(keys.router_lease, "absent-router", px=600_000)
    cfg = GatewayConfig(model_path="unused", redis_url=redis_server.url, key_prefix=keys.prefix)
    gw = Gateway(cfg, waiting_pool_client(cfg.redis_url, cfg.redis_max_connections, "test"), Where())
    await gw.start()
    try:
        short = ChatCompletionRequest(model="tiny-llama", messages=[Message(role="user", content="hi")])
        long = ChatCompletionRequest(
            model="tiny-llama", messages=[Message(role="user", content="w " * OFF_LOOP_CHARS)]
        )
        await gw.admit(short, "normal")
        adm = await gw.admit(long, "normal")
        assert adm.record.prompt_tokens == OFF_LOOP_CHARS + 3
        main = threading.current_thread().name
        assert Where.threads[0] == main and Where.threads[1] != main
        await asyncio.gather(*(gw.admit(long, "normal") for _ in range(4)))
        assert Where.peak > 1, "long prompts are tokenized side by side (the tokenizer releases the GIL)"
        Where.peak = 0
        huge = ChatCompletionRequest(
            model="tiny-llama", messages=[Message(role="user", content="w " * (HUGE_PROMPT_CHARS // 2 + 1))]
        )
        await asyncio.gather(*(gw.admit(huge, "normal") for _ in range(4)))
        assert Where.peak == 1, "huge prompts are tokenized one at a time (each takes a core for seconds)"
    finally:
        await gw.stop()
        await gw.r.aclose()
