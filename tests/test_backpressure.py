"""Backpressure: per-priority limits by count and by predicted wait, Retry-After, and a burst against a real
gateway (uvicorn), the real router and a fake engine process that ends in 200 or 429 only."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from flying.queue import QueueFull, RequestQueue
from gateway.app import create_app
from gateway.backpressure import Backpressure, ClassArrivals, Limits, ServiceRate
from gateway.config import GatewayConfig
from loadgen import fake_server
from tests.stack import CountWords, RouterThread, ServerThread, announce_engine
from tests.test_queue import mk

BUDGETS = {"high": 5.0, "normal": 20.0, "low": 60.0}


def test_service_rate_needs_history_then_follows_the_window():
    rate = ServiceRate(window_s=10, min_span_s=2)
    assert rate.per_s() is None
    rate.sample(0.0, 100)
    rate.sample(1.0, 110)
    assert rate.per_s() is None, "1 s of history is too little"
    for t in range(2, 30):
        rate.sample(float(t), 110 + 10 * (t - 1))
    assert rate.per_s() == pytest.approx(10)
    for t in range(30, 45):
        rate.sample(float(t), 390 + 2 * (t - 29))  # slows down: the old samples leave the window
    assert rate.per_s() == pytest.approx(2, rel=0.2)
    rate.sample(46.0, 5)  # counter reset (Redis lost it): no negative rate
    assert rate.per_s() is None


def test_service_rate_counts_only_backlogged_time():
    """At light load the dispatch rate is the arrival rate, not the capacity: a trickle of 0.1/s with an empty
    queue must not predict a long wait for the next burst (it would refuse what the engines take at once)."""
    rate = ServiceRate(window_s=30, min_span_s=2)
    for t in range(20):
        rate.sample(float(t), t // 10, backlogged=False)
    assert rate.per_s() is None
    bp = Backpressure(max_queue=100, budgets={"normal": 60}, rate=rate)
    assert bp.limits("normal").max_ahead == 0, "no bound by wait while the capacity is unknown"
    for t in range(20, 25):  # then a backlog: 10/s served while requests wait
        rate.sample(float(t), 1 + 10 * (t - 20), backlogged=True)
    assert rate.per_s() == pytest.approx(10)
    rate.sample(25.0, 45, backlogged=False)  # the interval that ends with an empty queue does not count
    assert rate.per_s() == pytest.approx(10)


def test_limits_shed_low_first_and_bound_the_wait_by_each_class_budget_once_the_rate_is_known():
    bp = Backpressure(max_queue=100, budgets=BUDGETS)
    assert (
        bp.limits("high") == Limits(100, 0)
        and bp.limits("low").max_depth < bp.limits("normal").max_depth < 100
    )
    assert bp.retry_after_s(50) == 1, "unknown rate: retry soon"
    for t in range(5):
        bp.rate.sample(float(t), 20 * t)  # 20 requests/s; no arrivals measured: nothing overtakes anyone
    assert bp.limits("high") == Limits(100, 100), "5 s at 20/s"
    assert bp.limits("normal").max_ahead == 400 and bp.limits("low").max_ahead == 1200
    assert bp.retry_after_s(50) == 3 and bp.retry_after_s(10**6) == 60


def test_the_classes_above_take_their_share_of_the_service_first():
    """At 20 requests/s served and 12/s of high priority admitted, a normal request is served at the 8/s left: 20
    s of budget hold 160 ahead; at 12 + 8 = 20/s admitted above it, low priority gets a twentieth (1/s) and its
    predicted wait is past its budget with 60 ahead."""
    bp = Backpressure(max_queue=10_000, budgets=BUDGETS)
    for t in range(5):
        bp.rate.sample(float(t), 20 * t)
        bp.arrivals.sample(float(t), (12 * t, 8 * t, 30 * t))
    assert bp.arrivals.above("high") == 0 and bp.arrivals.above("low") == pytest.approx(20)
    assert bp.limits("high").max_ahead == 100
    assert bp.limits("normal").max_ahead == 160
    assert bp.limits("low").max_ahead == 60
    assert bp.predicted_wait_s("normal", 159) == pytest.approx(20)
    assert bp.wait_retry_after_s("normal", 239) == 10, "30 s predicted, 20 s of budget"
    assert bp.wait_retry_after_s("low", 10**4) == 60


def test_class_arrivals_follow_the_window_and_start_over_after_a_reset():
    arrivals = ClassArrivals(window_s=5)
    assert arrivals.above("low") == 0
    for t in range(20):
        arrivals.sample(float(t), (t, 2 * t, 0) if t < 10 else (10 + 5 * (t - 10), 20, 0))
    assert arrivals.above("normal") == pytest.approx(5) and arrivals.above("low") == pytest.approx(5)
    arrivals.sample(20.0, (0, 0, 0))
    assert arrivals.above("low") == 0


async def test_admit_refuses_by_depth_and_by_requests_ahead(aredis, keys):
    q = RequestQueue(aredis, keys)
    for i in range(3):
        await q.admit(mk(f"n{i}"))
    await q.admit(mk("l0", "low"))
    with pytest.raises(QueueFull) as exc:
        await q.admit(mk("x"), max_queue=4)
    assert (exc.value.reason, exc.value.count) == ("depth", 4)
    with pytest.raises(QueueFull) as exc:
        await q.admit(
            mk("n9"), max_ahead=3
        )  # 3 normal requests wait ahead of it (the low one does not count)
    assert (exc.value.reason, exc.value.count) == ("wait", 3)
    await q.admit(mk("h0", "high"), max_ahead=1)  # nothing of high priority waits: admitted
    assert await q.depth() == 5


@pytest.fixture
def engine_url(tmp_path):
    proc, url = fake_server.start_process(tmp_path / "engine.log", ttft_ms=20, itl_ms=5)
    yield url
    proc.kill()
    proc.wait()


async def burst(url: str, n: int, priority: str) -> list[httpx.Response]:
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": True,
    }
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
        headers = {"X-Priority": priority}
        return await asyncio.gather(
            *(c.post("/v1/chat/completions", json=body, headers=headers) for _ in range(n))
        )


@pytest.mark.slow
def test_a_burst_gets_200_or_429_with_retry_after_only(redis_server, sync_redis, keys, engine_url):
    """300 requests at once, a queue of 100 and a Redis pool of 8 connections: every answer is 200 or a 429 with
    Retry-After and an OpenAI-shaped rate_limit_exceeded body; the pool makes callers wait, it never refuses."""
    announce_engine(sync_redis, keys, url=engine_url)
    cfg = GatewayConfig(
        model_path="unused", redis_url=redis_server.url, key_prefix=keys.prefix, max_queue=100,
        redis_max_connections=8, queue_timeout_s=60,
    )  # fmt: skip
    with (
        RouterThread(redis_server.url, keys.prefix, max_inflight_per_worker=8),
        ServerThread(create_app(cfg, count_tokens=CountWords())) as gw,
    ):
        answers = asyncio.run(burst(gw.url, 300, "normal"))
    statuses = [r.status_code for r in answers]
    assert set(statuses) <= {200, 429}, sorted(set(statuses))
    assert statuses.count(200) >= 85, (
        f"at least the queue's share for normal priority is served: {statuses.count(200)}"
    )
    refused = [r for r in answers if r.status_code == 429]
    assert refused, "a queue of 100 cannot take 300 at once"
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        assert (
            r.json()["error"]["code"] == "rate_limit_exceeded"
            and r.json()["error"]["type"] == "rate_limit_error"
        )
    for r in answers:
        if r.status_code == 200:
            assert r.text.rstrip().endswith("data: [DONE]")


async def test_low_priority_is_shed_before_high(redis_server, aredis, sync_redis, keys):
    """At the same queue depth a low-priority request is refused and a high-priority one admitted."""
    from gateway.api.errors import QueueFullError
    from gateway.api.schemas import ChatCompletionRequest, Message
    from gateway.service import Gateway

    announce_engine(sync_redis, keys)
    cfg = GatewayConfig(model_path="unused", redis_url=redis_server.url, key_prefix=keys.prefix, max_queue=10)
    gw = Gateway(cfg, aredis, CountWords())
    q = RequestQueue(aredis, keys)
    for i in range(7):  # 70% full: above low's share (60%), below normal's (85%)
        await q.admit(mk(f"n{i}"))
    req = ChatCompletionRequest(model="tiny-llama", messages=[Message(role="user", content="hi")])
    with pytest.raises(QueueFullError) as exc:
        await gw.enqueue(await gw.admit(req, "low"))
    assert exc.value.retry_after_s >= 1 and "low priority" in exc.value.message
    for p in ("normal", "high"):
        await gw.enqueue(await gw.admit(req, p))
    assert await q.depth() == 9
    assert not gw.waiter.pending.keys() - gw.waiter.admitted


def test_half_a_second_of_backlog_measures_the_capacity_unless_the_engines_stalled():
    """The default window: the capacity is known once the queue has been backlogged for 0.5 s (two of the
    monitor's samples) with at least 3 dispatches in it; a backlog that nothing leaves does not measure it (the
    rate stays unknown; see the next test for what a backlog is then bounded by)."""
    rate = ServiceRate()
    rate.sample(0.0, 0, backlogged=True)
    rate.sample(0.25, 2, backlogged=True)
    assert rate.per_s() is None, "0.25 s is too little"
    rate.sample(0.5, 4, backlogged=True)
    assert rate.per_s() == pytest.approx(8)
    stalled = ServiceRate()
    for i in range(8):
        stalled.sample(i * 0.25, 1 if i > 4 else 0, backlogged=True)
    assert stalled.per_s() is None
    assert Backpressure(100, BUDGETS, rate=stalled).limits("normal").max_ahead == 0


def test_the_engines_backlog_is_work_ahead_of_normal_and_low_priority():
    """Requests waiting inside the engines (handed to them beyond what they run at once) delay a normal or low
    request as much as the queue does; a high one SGLang runs first. Past the budget on their own: refused
    whatever the queue holds."""
    from gateway.cluster_view import Tick

    bp = Backpressure(max_queue=1000, budgets=BUDGETS)
    for t in range(5):  # saturated by the engines' own queues alone (the global queue is empty): 4 served/s
        bp.observe(
            Tick(float(t), assigned=0, depth=0, admitted=(0, 0, 0), completed=4 * t, engine_waiting=30)
        )
    assert bp.rate.per_s() == pytest.approx(4) and bp.behind("normal") == 30 and bp.behind("high") == 0
    assert bp.limits("high") == Limits(1000, 20)
    assert bp.limits("normal") == Limits(850, 50) and bp.limits("low") == Limits(600, 210)
    assert bp.predicted_wait_s("normal", 9) == pytest.approx(10)
    bp.engine_waiting = 100
    assert bp.limits("normal").full and not bp.limits("low").full and not bp.limits("high").full
    idle = Backpressure(max_queue=1000, budgets=BUDGETS)
    for t in range(5):  # light load: served as they come, nothing waits anywhere
        idle.observe(Tick(float(t), assigned=4 * t, depth=0, admitted=(0, 0, 0), completed=4 * t))
    assert idle.rate.per_s() is None and idle.limits("normal") == Limits(850, 0)


def test_a_backlog_too_new_to_measure_is_bounded_by_what_the_window_saw_served():
    """The onset of an overload: requests wait in the engines, but after 0.5 s too few have been served while
    they waited to measure the capacity. The wait is then predicted from what the last 10 s served (at least 3),
    over all 10 s: a capacity the deployment surely has, so the overload is refused within 0.5 s, not after the
    first measurement. With nothing waiting, as before, only the count bounds the queue."""
    from gateway.cluster_view import Tick

    bp = Backpressure(max_queue=1000, budgets=BUDGETS)
    for i in range(48):  # 12 s of light load: 5 served in the last 10 s, nothing waits
        bp.observe(Tick(i * 0.25, assigned=0, depth=0, completed=max(0, i - 40) * 5 // 7))
    assert bp.capacity() is None and bp.limits("normal") == Limits(850, 0)
    bp.observe(Tick(12.0, assigned=0, depth=0, completed=5, engine_waiting=4))  # the engines' slots are full
    assert bp.capacity() is None, "a backlog this new: engines that keep up measure their capacity first"
    bp.observe(Tick(12.25, assigned=0, depth=0, completed=5, engine_waiting=4))
    bp.observe(Tick(12.5, assigned=0, depth=0, completed=5, engine_waiting=4))  # 0.5 s and nothing served
    assert bp.rate.per_s() is None and bp.capacity() == pytest.approx(0.5), "5 served in 10 s"
    assert bp.limits("normal") == Limits(850, 6), "0.5/s x 20 s = 10, less the 4 in the engines"
    bp.observe(Tick(12.75, assigned=0, depth=0, completed=5, engine_waiting=10))
    assert bp.limits("normal").full and not bp.limits("high").full, "10 s x 0.5/s: normal's budget is used up"
    assert bp.wait_retry_after_s("normal", 0) == 2, "11 ahead at 0.5/s: 22 s, 2 s beyond the budget"


def test_requests_on_their_way_to_saturated_engines_count_as_their_backlog():
    """Once the engines report waiting requests, those assigned to them that they do not run yet (their inflight
    sets hold them before the engines report them) and those this gateway handed them since it looked are work
    ahead too; while nothing waits, requests on their way are not a backlog (light load stays unbounded)."""
    from gateway.cluster_view import Tick

    bp = Backpressure(max_queue=1000, budgets=BUDGETS)
    bp.observe(Tick(0.0, assigned=0, depth=0, engine_held=12, engine_running=10))
    bp.handed_to_engine()
    assert bp.behind("normal") == 0 and not bp.backlogged
    bp.observe(Tick(0.25, assigned=0, depth=0, engine_waiting=1, engine_held=30, engine_running=10))
    assert bp.behind("normal") == 20 and bp.behind("high") == 0
    bp.handed_to_engine()
    bp.handed_to_engine()
    assert bp.behind("low") == 22
    bp.observe(Tick(0.5, assigned=0, depth=0, engine_waiting=25, engine_held=30, engine_running=10))
    assert bp.behind("low") == 25, (
        "the heartbeats' count when it is the larger; the handed ones are in it now"
    )


def test_a_gateway_that_has_not_watched_a_whole_window_bounds_a_new_backlog_by_count_only():
    """Just started (or Redis lost the counters): a burst that fills the engines before anything has finished is
    not an overload yet. Nothing served in 2 s says nothing of the capacity, so only the count bounds the queue
    until the gateway has watched a whole window, or the backlog measures the capacity."""
    from gateway.cluster_view import Tick

    bp = Backpressure(max_queue=1000, budgets=BUDGETS)
    for i in range(8):  # a burst 2 s after start-up: nothing finished yet, everything waits
        bp.observe(Tick(i * 0.25, assigned=0, depth=28, completed=0, engine_waiting=2))
    assert bp.capacity() is None and bp.limits("normal") == Limits(850, 0)
    for i in range(8, 41):  # the engines stalled: 10 s watched and still nothing served
        bp.observe(Tick(i * 0.25, assigned=0, depth=28, completed=0, engine_waiting=2))
    assert bp.capacity() == pytest.approx(0.3) and bp.limits("normal") == Limits(850, 4)
    bp.rate.sample(10.5, -1)  # the counter went back (Redis lost it): a new start
    assert bp.rate.lower_bound_per_s() is None


def test_long_streams_at_light_load_do_not_starve_low_priority_on_a_lower_bound():
    """Light load with long streams: few requests finish in a window while higher classes arrive at 3/s, and the
    engines report a moment's waiting (SGLang queues what arrives within a step). The capacity is then only a lower
    bound (3 served in 10 s), which the arrivals above outrun: a low request with nothing ahead is admitted, not
    refused with a 66-s prediction (as when the arrivals above were taken off the bound)."""
    from gateway.cluster_view import Tick

    bp = Backpressure(max_queue=1000, budgets=BUDGETS)
    for i in range(49):  # 12 s: 3 high + normal admitted a second, 3 finished in the last 10 s
        t = i * 0.25
        waiting = 1 if t >= 11.5 else 0  # the last 0.5 s: a moment's waiting in an engine
        bp.observe(Tick(t, assigned=0, depth=0, admitted=(int(t), 2 * int(t), 0), completed=min(3, i // 16), engine_waiting=waiting))  # fmt: skip
    assert bp.rate.per_s() is None and bp.capacity() == pytest.approx(0.3)
    assert bp.free_rate("low") == pytest.approx(0.3), "the bound whole: the arrivals above outrun it"
    assert bp.limits("low") == Limits(600, 17) and not bp.limits("low").full
