"""WaitingRoom alone, against a real Redis and no router: admission within the backpressure limits, the wait's
ends (timeout, client gone), re-queueing within ``max_attempts``, and re-admission of what Redis lost."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from flying.messages import Assignment, QueuedRequest
from gateway.admission import Admitted
from gateway.api.errors import QueueFullError, QueueTimeout, WorkerFailed
from gateway.background import Background
from gateway.config import GatewayConfig
from gateway.http.disconnect import ClientGone
from gateway.metrics import GatewayMetrics
from gateway.waiting import WaitingRoom


@pytest.fixture
async def room(aredis, keys):
    def make(**config) -> WaitingRoom:
        cfg = GatewayConfig(model_path="unused", key_prefix=keys.prefix, gateway_id="g1", **config)
        made = WaitingRoom(cfg, aredis, keys, GatewayMetrics(), Background())
        rooms.append(made)
        return made

    rooms: list[WaitingRoom] = []
    yield make
    for made in rooms:
        if made.queue.pipe is not None:
            made.queue.pipe.close()


def admitted(rid: str, priority: str = "normal") -> Admitted:
    rec = QueuedRequest(id=rid, priority=priority, model="m", prompt_tokens=4, max_tokens=4, gateway="g1", enqueued_at=time.time())  # fmt: skip
    return Admitted(rec, "/v1/chat/completions", {"rid": rid}, stream=False)


def never() -> asyncio.Future[None]:
    return asyncio.get_running_loop().create_future()


async def state(aredis, keys, rid: str) -> bytes | None:
    return await aredis.hget(keys.request(rid), "state")


async def test_an_admitted_request_waits_held_and_a_full_queue_is_a_429_with_retry_after(room, aredis, keys):
    r = room(max_queue=1)
    fut = await r.enqueue(admitted("a", "high"))
    assert not fut.done() and set(r.holding) == {"a"} and "a" in r.waiter.admitted
    with pytest.raises(
        QueueFullError, match=r"queue is full for high priority \(1 waiting\); retry after"
    ) as full:
        await r.enqueue(admitted("b", "high"))
    assert full.value.retry_after_s >= 1
    assert "b" not in r.waiter.pending and "b" not in r.holding
    assert await aredis.zcard(keys.queue) == 1


async def test_a_wait_that_times_out_is_a_504_and_its_record_is_cancelled(room, aredis, keys):
    r = room(queue_timeout_s=0.1)
    adm = admitted("a")
    fut = await r.enqueue(adm)
    with pytest.raises(QueueTimeout):
        await r.wait_assignment(adm, fut, never())
    assert await state(aredis, keys, "a") == b"cancelled"
    assert not r.holding and "a" not in r.waiter.pending and await aredis.zcard(keys.queue) == 0


def measured(r: WaitingRoom, per_s: float, seconds: int = 5) -> None:
    """Give the room's backpressure ``per_s`` of measured service (nothing admitted above any class)."""
    for t in range(seconds):
        r.backpressure.rate.sample(float(t), int(per_s * t))
        r.backpressure.arrivals.sample(float(t), (0, 0, 0))


async def test_admission_counts_each_class_in_the_shared_stats(room, aredis, keys):
    r = room()
    for rid, prio in (("h", "high"), ("n1", "normal"), ("n2", "normal")):
        await r.enqueue(admitted(rid, prio))
    stats = await aredis.hgetall(keys.stats)
    assert (stats[b"admitted"], stats[b"admitted_high"], stats[b"admitted_normal"]) == (b"3", b"1", b"2")


async def test_a_predicted_wait_beyond_the_class_budget_is_a_429_at_once(room, aredis, keys):
    """At 2 requests/s a normal request's budget of 2 s holds 3 ahead and itself: the fifth is refused with the predicted
    wait and the budget in its message, and a Retry-After for the excess; high priority is not behind them."""
    r = room(wait_budget_normal_s=2.0, wait_budget_high_s=1.0)
    measured(r, 2.0)
    for i in range(4):
        await r.enqueue(admitted(f"n{i}"))
    t0 = time.monotonic()
    with pytest.raises(QueueFullError, match=r"predicted queue wait \(2.5 s, 4 requests ahead\) exceeds normal "
                       r"priority's budget of 2 s; retry after 1 s") as refused:  # fmt: skip
        await r.enqueue(admitted("n4"))
    assert time.monotonic() - t0 < 0.5 and refused.value.retry_after_s == 1
    assert "n4" not in r.waiter.pending and await state(aredis, keys, "n4") is None
    await r.enqueue(admitted("h0", "high"))  # nothing of high priority waits ahead of it
    assert r.metrics.refused.labels("normal", "wait")._value.get() == 1


async def test_the_engines_backlog_past_the_budget_is_a_429_before_the_queue_is_asked(room, aredis, keys):
    """50 requests wait inside the engines, served at 2/s: a normal request would wait 25.5 s for its first token,
    past its budget of 20 s, with nothing in the queue; a high one is not behind them."""
    r = room()
    measured(r, 2.0)
    r.backpressure.engine_waiting = 50
    with pytest.raises(
        QueueFullError, match=r"predicted queue wait \(25.5 s, 50 requests ahead\) exceeds normal"
    ):
        await r.enqueue(admitted("n0"))
    assert await state(aredis, keys, "n0") is None and "n0" not in r.waiter.pending
    await r.enqueue(admitted("h0", "high"))
    assert r.metrics.refused.labels("normal", "wait")._value.get() == 1


async def test_an_admitted_request_whose_budget_runs_out_is_a_504_not_scheduled_in_time(room, aredis, keys):
    r = room(wait_budget_low_s=0.2, queue_timeout_s=60)
    adm = admitted("a", "low")
    fut = await r.enqueue(adm)
    t0 = time.monotonic()
    with pytest.raises(QueueTimeout, match=r"not scheduled within 0.2 s"):
        await r.wait_assignment(adm, fut, never())
    assert 0.15 < time.monotonic() - t0 < 1.0, "the budget, not queue_timeout_s, ends the wait"
    assert await state(aredis, keys, "a") == b"cancelled" and await aredis.zcard(keys.queue) == 0
    assert r.metrics.expired.labels("low")._value.get() == 1
    held = dataclasses.replace(admitted("long", "low"), patience_s=0.6)  # the router holds it for calm
    fut = await r.enqueue(held)
    t0 = time.monotonic()
    with pytest.raises(QueueTimeout, match=r"not scheduled within 0.6 s"):
        await r.wait_assignment(held, fut, never())
    assert time.monotonic() - t0 > 0.5, "its patience, not its class's budget, ends the wait"


async def test_without_budgets_only_the_count_and_the_queue_timeout_bound_the_wait(room):
    r = room(max_wait_s=0, queue_timeout_s=0.1)
    measured(r, 0.1)
    assert r.backpressure.limits("low").max_ahead == 0 and r.config.queue_wait_s("low") == 0.1
    for i in range(5):
        await r.enqueue(admitted(f"l{i}", "low"))


async def test_a_client_that_leaves_while_waiting_is_gone_and_its_record_cancelled(room, aredis, keys):
    r = room()
    adm = admitted("a")
    fut = await r.enqueue(adm)
    left = never()
    left.set_result(None)
    with pytest.raises(ClientGone):
        await r.wait_assignment(adm, fut, left)
    assert await state(aredis, keys, "a") == b"cancelled" and not r.holding


async def test_the_assignment_ends_the_wait(room):
    r = room()
    adm = admitted("a")
    fut = await r.enqueue(adm)
    a = Assignment(id="a", engine=0, url="http://e0", queue_ms=0.0)
    r.waiter.resolve(a)
    assert await r.wait_assignment(adm, fut, never()) == a
    assert not r.holding


async def test_a_failed_engine_sends_the_request_back_until_its_attempts_are_used_up(room, aredis, keys):
    r = room(max_attempts=2)
    adm = admitted("a")
    await r.enqueue(adm)
    assert await r.queue.assign(adm.record, 0, "http://e0")  # as the router would
    a = Assignment(id="a", engine=0, url="http://e0", queue_ms=0.0)
    fut = await r.retry_or_fail(adm, a, "connection refused")
    assert not fut.done() and "a" in r.holding and await aredis.zscore(keys.queue, "a") is not None
    assert adm.record.id == "a" and adm.body["rid"] == "a~1" and adm.engine_rids() == ["a~1"]
    assert r.metrics.redispatched.labels("before_first_event")._value.get() == 1
    assert await r.queue.assign(adm.record, 0, "http://e0")
    with pytest.raises(WorkerFailed, match="engine 0 failed and 2 attempts are used up: reset"):
        await r.retry_or_fail(adm, a, "reset")
    assert await state(aredis, keys, "a") == b"failed"


async def test_a_request_whose_group_parked_before_its_first_token_goes_back_without_using_an_attempt(
    room, aredis, keys
):
    r = room(max_attempts=2)
    adm = admitted("a")
    await r.enqueue(adm)
    a = Assignment(id="a", engine=0, url="http://e0", queue_ms=0.0)
    for attempt in (1, 2, 3):  # three bursts met in its prefill: more re-dispatches than max_attempts
        assert await r.queue.assign(adm.record, 0, "http://e0")
        await r.retry_or_fail(adm, a, "parked", engine_fault=False, counted=False)
        assert adm.body["rid"] == f"a~{attempt}"  # a new SGLang rid each time
    assert r.metrics.redispatched.labels("group_parked")._value.get() == 3
    assert await aredis.hget(keys.request("a"), "failed_on") == b"-1"  # engine 0 did not fail it
    assert await r.queue.assign(adm.record, 0, "http://e0")
    await r.retry_or_fail(adm, a, "connection refused")  # a failure: the first attempt it uses
    assert await r.queue.assign(adm.record, 0, "http://e0")
    with pytest.raises(WorkerFailed, match="engine 0 failed and 2 attempts are used up: reset"):
        await r.retry_or_fail(adm, a, "reset")


async def test_a_request_a_follower_refused_goes_back_leader_only_without_using_an_attempt(
    room, aredis, keys
):
    """A follower refuses a request with a grammar the gateway did not foresee: it is queued again uncounted, and
    its record says leader-only, so the router sends it to a leader or a DP engine next."""
    from flying.messages import GROUP_LEADER_ONLY, from_hash

    r = room(max_attempts=1)
    adm = admitted("a")
    await r.enqueue(adm)
    a = Assignment(id="a", engine=1, url="http://e1", queue_ms=0.0)
    assert await r.queue.assign(adm.record, 1, "http://e1")
    why = f'engine 1 answered 503: {{"message": "{GROUP_LEADER_ONLY.message}"}}'
    await r.retry_or_fail(adm, a, why, engine_fault=False, counted=False)
    fields = {k.decode(): v.decode() for k, v in (await aredis.hgetall(keys.request("a"))).items()}
    back = from_hash(fields, QueuedRequest)
    assert back.leader_only and fields["parked_attempts"] == "1" and back.failed_on == -1
    assert r.metrics.redispatched.labels("leader_only")._value.get() == 1


async def test_waiting_requests_redis_lost_are_admitted_again(room, aredis, keys):
    r = room(max_queue=1)
    await r.enqueue(admitted("a"))
    await aredis.delete(keys.request("a"), keys.queue)  # a Redis restart without persistence
    await r.readmit(["a", "unknown"])
    assert r.readmitted == 1 and await aredis.zscore(keys.queue, "a") is not None


async def test_an_id_that_waits_here_already_is_a_duplicate_and_the_first_keeps_its_wait(room):
    """A client's id reused while its first request still waits at this gateway: the second is refused as a
    duplicate before it touches the first's wait (which its assignment still ends)."""
    from flying.queue import DuplicateId

    r = room()
    first = await r.enqueue(admitted("same"))
    with pytest.raises(DuplicateId):
        await r.enqueue(admitted("same"))
    assert not first.done()
    r.waiter.resolve(Assignment(id="same", engine=0, url="http://e0", queue_ms=1.0))
    assert first.result().engine == 0
