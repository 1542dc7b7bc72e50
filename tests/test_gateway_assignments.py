"""AssignmentWaiter against a real Redis: assignments arrive by message, a missed one by reconciliation, and a
subscription lost without an error (Redis no longer counts it, or the listener ended) is noticed and made again,
so the waits do not fall back to one reconciliation every ``reconcile_s``."""

from __future__ import annotations

import asyncio

import pytest

from flying.messages import Assignment, encode
from gateway.assignments import AssignmentWaiter


@pytest.fixture
async def waiter(aredis, keys):
    made: list[AssignmentWaiter] = []

    async def make(reconcile_s: float = 1000.0) -> AssignmentWaiter:
        w = AssignmentWaiter(aredis, keys, "g1", reconcile_s)
        await w.start()
        made.append(w)
        return w

    yield make
    for w in made:
        await w.stop()


async def publish(aredis, keys, rid: str) -> None:
    msg = encode(Assignment(id=rid, engine=1, url="http://e1", queue_ms=2.0))
    await aredis.publish(keys.gateway_channel("g1"), msg)


async def arrives(fut: asyncio.Future[Assignment], timeout_s: float = 2.0) -> Assignment | None:
    try:
        return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
    except TimeoutError:
        return None


async def drop_server_side(w: AssignmentWaiter) -> None:
    """Unsubscribe on the server behind redis-py's back: the connection stays open and its listener waits on it,
    but Redis sends it nothing more (what a subscription lost without an error looks like)."""
    assert w._pubsub is not None and w._pubsub.connection is not None
    await w._pubsub.connection.send_command("UNSUBSCRIBE", w.channel)
    for _ in range(50):
        [(_, n)] = await w.r.pubsub_numsub(w.channel)
        if n == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("Redis still counts the subscriber")


async def test_a_published_assignment_resolves_the_wait(waiter, aredis, keys):
    w = await waiter()
    fut = w.expect("r1")
    await publish(aredis, keys, "r1")
    a = await arrives(fut)
    assert a is not None and a.engine == 1 and not w.pending
    assert await w.check_subscription() and w.resubscribed == 0


async def test_a_subscription_redis_dropped_silently_is_made_again_by_the_reconciliation(
    waiter, aredis, keys
):
    w = await waiter(reconcile_s=0.2)
    await drop_server_side(w)
    lost = w.expect("lost")
    await publish(aredis, keys, "lost")  # nobody hears it, and no record says it was assigned
    assert await arrives(lost, 0.3) is None
    for _ in range(40):  # a few reconciliation rounds
        if w.resubscribed:
            break
        await asyncio.sleep(0.05)
    assert w.resubscribed == 1
    fut = w.expect("later")
    for _ in range(40):  # the new subscription hears what is published from now on
        await publish(aredis, keys, "later")
        if await arrives(fut, 0.1) is not None:
            break
    assert fut.done() and fut.result().id == "later"
    assert w.reconciled == 0  # by message, not found by a reconciliation
    assert w.metrics.subscription_lost._value.get() == 1
    assert w.metrics.assignments.labels("message")._value.get() == 1


async def test_a_listener_that_ended_is_reported_and_started_again(waiter, aredis, keys):
    w = await waiter()
    assert w._listener is not None
    w._listener.cancel()
    await asyncio.sleep(0.05)
    assert not await w.check_subscription()
    assert await w.check_subscription() and w.resubscribed == 1
    fut = w.expect("r2")
    await publish(aredis, keys, "r2")
    assert await arrives(fut) is not None


async def test_a_message_that_is_not_an_assignment_is_skipped_and_the_next_one_arrives(waiter, aredis, keys):
    w = await waiter()
    fut = w.expect("r3")
    await aredis.publish(keys.gateway_channel("g1"), b"not msgpack \xff")
    await aredis.publish(
        keys.gateway_channel("g1"), encode(Assignment(id="r3", engine=0, url="u", queue_ms=0))
    )
    assert await arrives(fut) is not None
    assert w._listener is not None and not w._listener.done()


async def test_an_assignment_whose_message_was_missed_is_found_by_the_reconciliation(waiter, aredis, keys):
    w = await waiter()
    fut = w.expect("r4")
    await aredis.hset(
        keys.request("r4"), mapping={"state": "assigned", "engine": 0, "url": "http://e0", "queue_ms": 1}
    )
    w.mark_admitted("r4")
    assert await w.reconcile() == 1
    assert fut.done() and fut.result().url == "http://e0" and w.reconciled == 1
    assert w.metrics.assignments.labels("reconciliation")._value.get() == 1


async def test_messages_keep_arriving_while_a_reconciliation_hangs_on_a_lost_request(aredis, keys):
    """Re-admitting what Redis lost runs in the reconciliation, never in the listener: a re-admission that hangs
    (here forever) holds up no assignment that arrives by message after the subscription is made again."""
    hung = asyncio.Event()

    async def hang(rids: list[str]) -> None:
        hung.set()
        await asyncio.Event().wait()

    w = AssignmentWaiter(aredis, keys, "g1", reconcile_s=1000.0, on_missing=hang)
    await w.start()
    try:
        w.expect("gone")
        w.mark_admitted("gone")  # admitted, but Redis has no record of it: lost
        # the listener resubscribes, then the reconciliation runs
        await aredis.client_kill_filter(_type="pubsub")
        await asyncio.wait_for(hung.wait(), 5)
        fut = w.expect("next")
        for _ in range(40):
            await publish(aredis, keys, "next")
            if await arrives(fut, 0.1) is not None:
                break
        assert fut.done() and fut.result().id == "next"
    finally:
        await w.stop()
