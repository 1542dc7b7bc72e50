"""Engines' circuit breakers (flying.breaker) against a real Redis, transition by transition; and the router's side
(router.breakers): an open engine gets no dispatch, a due one one health probe, whose answer closes or reopens it."""

from __future__ import annotations

import asyncio
import time

import pytest

from flying.breaker import Breakers, BreakerSettings, BreakerState
from flying.queue import RequestQueue
from router.breakers import RouterBreakers
from tests.test_queue import mk
from tests.test_router import beat, dispatcher

T0 = 1_000_000.0
SETTINGS = BreakerSettings(failures=3, window_s=10, backoff_s=2, backoff_max_s=5, probe_timeout_s=1)


@pytest.fixture
def breakers(aredis, keys) -> Breakers:
    return Breakers(aredis, keys, SETTINGS)


async def state(b: Breakers, engine: int = 0):
    return (await b.read()).get(engine)


async def test_failures_within_the_window_open_the_breaker(breakers):
    assert await breakers.read() == {}
    assert not await breakers.failure(0, T0, "refused")
    assert not await breakers.failure(0, T0 + 1, "refused")
    assert (await state(breakers)).state is BreakerState.CLOSED
    assert await breakers.failure(0, T0 + 2, "reset")
    b = await state(breakers)
    assert (b.state, b.until, b.trips, b.reason) == (BreakerState.OPEN, T0 + 2 + 2, 1, "reset")
    assert not b.dispatchable and not b.probe_due(T0 + 3.9) and b.probe_due(T0 + 4)
    assert not await breakers.failure(0, T0 + 3, "late"), "failures while open change nothing"
    assert (await state(breakers)).until == T0 + 4


async def test_failures_spread_beyond_the_window_do_not(breakers):
    for i in range(6):
        assert not await breakers.failure(0, T0 + 6 * i)
    assert (await state(breakers)).state is BreakerState.CLOSED
    assert (await breakers.read()).keys() == {0}, "one engine's record only"


async def test_a_due_probe_is_claimed_once_and_its_success_closes(breakers):
    for i in range(3):
        await breakers.failure(0, T0 + i)
    assert not await breakers.claim_probe(0, T0 + 3), "the back-off is not over"
    assert await breakers.claim_probe(0, T0 + 4.5)
    assert not await breakers.claim_probe(0, T0 + 4.6), "one probe in flight"
    b = await state(breakers)
    assert b.state is BreakerState.HALF_OPEN and not b.dispatchable and not b.probe_due(T0 + 5)
    assert await breakers.claim_probe(0, T0 + 5.6), "a probe that did not answer in time is taken again"
    assert await breakers.success(0, T0 + 6)
    b = await state(breakers)
    assert (b.state, b.failures, b.trips) == (BreakerState.CLOSED, 0, 1)
    assert not await breakers.claim_probe(0, T0 + 7)
    assert await breakers.success(1, T0) and 1 not in await breakers.read(), "no record: closed, none written"


async def test_a_failed_probe_reopens_with_a_longer_backoff_capped(breakers):
    for i in range(3):
        await breakers.failure(0, T0 + i)
    for until, at in ((T0 + 4 + 4, T0 + 4), (T0 + 8 + 5, T0 + 8), (T0 + 13 + 5, T0 + 13)):
        assert await breakers.claim_probe(0, at)
        assert await breakers.failure(0, at, "probe: refused")
        b = await state(breakers)
        assert (b.state, b.until) == (BreakerState.OPEN, until), b
    assert (await state(breakers)).trips == 4


async def test_a_trip_soon_after_a_close_backs_off_longer_and_a_late_one_from_the_start(breakers):
    async def trip(at: float) -> float:
        for i in range(3):
            await breakers.failure(0, at + i * 0.1)
        b = await state(breakers)
        assert b.state is BreakerState.OPEN
        return b.until - (at + 0.2)

    assert await trip(T0) == 2
    await breakers.claim_probe(0, T0 + 3)
    await breakers.success(0, T0 + 3)
    assert await trip(T0 + 4) == 4, "it failed again right after the probe: the back-off doubles"
    await breakers.claim_probe(0, T0 + 10)
    await breakers.success(0, T0 + 10)
    assert await trip(T0 + 100) == 2, "closed longer than the longest back-off: from the start"


def test_settings_are_checked():
    with pytest.raises(ValueError, match="failures"):
        BreakerSettings(failures=0)
    with pytest.raises(ValueError, match="backoff_max_s"):
        BreakerSettings(backoff_s=5, backoff_max_s=1)
    with pytest.raises(ValueError, match="window_s"):
        BreakerSettings(window_s=0)


async def test_the_router_leaves_an_open_engine_out_and_probes_it_when_due(aredis, keys, monkeypatch):
    d = dispatcher(aredis, keys)
    q = RequestQueue(aredis, keys)
    b = Breakers(aredis, keys, BreakerSettings(failures=1, backoff_s=0.3, backoff_max_s=1))
    d.breakers = rb = RouterBreakers(b)
    asked: list[str] = []
    healthy = False

    async def ask(url: str) -> tuple[bool, str]:
        asked.append(url)
        return healthy, "" if healthy else "/health answered 500"

    monkeypatch.setattr(rb, "_ask", ask)
    for e in (0, 1):
        await beat(aredis, keys, e)
    await b.failure(1, time.time(), "refused")
    for i in range(4):
        await q.admit(mk(f"r{i}"))
    snap = await d.snapshot()
    assert [e.engine for e in snap.engines] == [0]
    await d.round()
    assert await aredis.scard(keys.inflight(1)) == 0 and await aredis.scard(keys.inflight(0)) == 4
    assert asked == [] and not rb.probes, "not due yet"

    await asyncio.sleep(0.35)
    await beat(aredis, keys, 0)
    await beat(aredis, keys, 1)
    assert [e.engine for e in (await d.snapshot()).engines] == [0], "due: probed, not dispatched to"
    await asyncio.gather(*rb.probes)
    assert asked == ["http://e1"]
    s = await state(b, 1)
    assert s.state is BreakerState.OPEN and s.trips == 2 and s.reason.startswith("probe:"), s

    healthy = True
    await asyncio.sleep(max(0.0, s.until - time.time()) + 0.02)
    await d.snapshot()
    await asyncio.gather(*rb.probes)
    assert (await state(b, 1)).state is BreakerState.CLOSED
    assert [e.engine for e in (await d.snapshot()).engines] == [0, 1]
    await d.close()


async def test_the_breakers_of_engines_gone_for_forget_s_are_dropped(breakers):
    from router.breakers import FORGET_S

    for e in (0, 1, 2):
        for i in range(3):
            await breakers.failure(e, T0 + i)
    rb = RouterBreakers(breakers)
    assert await rb.drop_stale(live={0}, now=T0 + FORGET_S / 2) == [], "changed too recently"
    assert await rb.drop_stale(live={0}, now=T0 + 2 * FORGET_S) == [1, 2]
    assert set(await breakers.read()) == {0}, "a live engine's breaker stays, however old"
