"""The Redis queue against a real redis-server: ordering, atomic claims, requeue, finish."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError

from devstack.redis_server import RedisServer
from flying import redis_conn
from flying.autopipeline import AutoPipeline
from flying.messages import Assignment, QueuedRequest, decode
from flying.queue import DuplicateId, EarlyDeclined, QueueFull, RequestQueue, reap_stale_inflight


@pytest.fixture(params=["pool", "autopipeline"])
async def queue(request, aredis, keys, redis_server):
    """The queue as the router uses it (redis-py's pool) and as the gateway does (its per-request scripts on one
    auto-pipelined connection)."""
    pipe = AutoPipeline(port=redis_server.port) if request.param == "autopipeline" else None
    yield RequestQueue(aredis, keys, pipe=pipe)
    if pipe is not None:
        pipe.close()


def mk(i: str, priority: str = "normal", t: float = 0.0) -> QueuedRequest:
    return QueuedRequest(
        id=i, priority=priority, model="m", prompt_tokens=4, max_tokens=4, gateway="g", enqueued_at=t
    )


async def test_orders_by_priority_class_then_arrival(aredis, keys, queue):
    q = queue
    for i, p in [
        ("n1", "normal"),
        ("l1", "low"),
        ("h1", "high"),
        ("n2", "normal"),
        ("h2", "high"),
        ("l2", "low"),
    ]:
        await q.admit(mk(i, p))
    assert [r.id for r in await q.peek(10)] == ["h1", "h2", "n1", "n2", "l1", "l2"]


async def test_ties_in_time_keep_admission_order(aredis, keys, queue):
    q = queue
    ids = [f"r{i}" for i in range(20)]
    for i in ids:
        await q.admit(mk(i, "normal", t=1.0))  # identical timestamps: the sequence number breaks the tie
    assert [r.id for r in await q.peek(50)] == ids


async def test_queue_full_rejects_and_keeps_nothing(aredis, keys, queue):
    q = queue
    await q.admit(mk("a"), max_queue=1)
    with pytest.raises(QueueFull):
        await q.admit(mk("b"), max_queue=1)
    assert await q.depth() == 1
    assert await aredis.exists(keys.request("b")) == 0


async def test_an_id_with_a_record_is_refused_and_the_record_kept(aredis, keys, queue):
    q = queue
    await q.admit(mk("a", "high"))
    with pytest.raises(DuplicateId):
        await q.admit(mk("a", "low"))
    assert await q.depth() == 1
    assert await aredis.hget(keys.request("a"), "priority") == b"high"


async def test_assign_is_atomic_and_notifies_the_gateway(aredis, keys, queue):
    q = queue
    pubsub = aredis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(keys.gateway_channel("g"))
    await q.admit(mk("a"))
    [req] = await q.peek(1)
    results = await asyncio.gather(*(q.assign(req, e, f"http://e{e}") for e in range(5)))
    assert sum(results) == 1, "exactly one of five concurrent claims wins"
    engine = results.index(True)
    assert await q.depth() == 0
    assert await aredis.smembers(keys.inflight(engine)) == {b"a"}
    rec = await q.get("a")
    assert rec["state"] == "assigned" and rec["engine"] == str(engine) and float(rec["queue_ms"]) >= 0
    msg = None
    for _ in range(20):  # the subscribe confirmation is swallowed as a None first
        if msg := await pubsub.get_message(timeout=0.1):
            break
    assert msg is not None, "the gateway channel got no assignment message"
    assert decode(msg["data"], Assignment).engine == engine
    await pubsub.aclose()


async def test_requeue_restores_the_original_position(aredis, keys, queue):
    q = queue
    for i in ("a", "b", "c"):
        await q.admit(mk(i))
    [a] = await q.peek(1)
    assert await q.assign(a, 0, "http://e0")
    assert [r.id for r in await q.peek(5)] == ["b", "c"]
    assert await q.requeue(a, 0, "worker died")
    peeked = await q.peek(5)
    assert [r.id for r in peeked] == ["a", "b", "c"]
    assert peeked[0].failed_on == 0 and peeked[1].failed_on == -1, "the router learns where it failed"
    rec = await q.get("a")
    assert rec["attempts"] == "1" and "engine" not in rec and rec["state"] == "queued"
    assert await aredis.scard(keys.inflight(0)) == 0
    assert not await q.requeue(a, 0, "twice"), "only an assigned request can be requeued"


async def test_finish_clears_inflight_and_sets_a_ttl(aredis, keys, queue):
    q = queue
    await q.admit(mk("a"))
    [a] = await q.peek(1)
    await q.assign(a, 1, "http://e1")
    assert await q.finish("a", "done")
    assert await aredis.scard(keys.inflight(1)) == 0
    assert (await q.get("a"))["state"] == "done"
    assert 0 < await aredis.ttl(keys.request("a")) <= 3600
    stats = await aredis.hgetall(keys.stats)
    assert stats[b"admitted"] == b"1" and stats[b"assigned"] == b"1" and stats[b"completed"] == b"1"


async def test_a_request_ends_once_whoever_finishes_it_again(aredis, keys, queue):
    """The first end counts and stays (a poison request ended by the waiting room, then by its relay)."""
    await queue.admit(mk("a"))
    assert await queue.finish("a", "failed", "two engines died")
    assert not await queue.finish("a", "failed", "its stream broke")
    assert not await queue.finish("a", "done")
    rec = await queue.get("a")
    assert (rec["state"], rec["error"]) == ("failed", "two engines died")
    assert (await aredis.hgetall(keys.stats)).get(b"failed") == b"1"


async def test_an_engine_dying_with_a_request_makes_it_suspect(aredis, keys, queue):
    await queue.admit(mk("a"))
    assert await queue.mark_suspect("a") == 1 and await queue.mark_suspect("a") == 2
    assert (await queue.get("a"))["suspect"] == "2" and await aredis.smembers(keys.suspects) == {b"a"}
    [a] = await queue.peek(1)
    assert a.suspect == 2


async def test_finish_wakes_the_router_only_while_requests_wait(aredis, keys, queue):
    q = queue
    for rid in ("a", "b"):
        await q.admit(mk(rid))
    await aredis.delete(keys.wake)
    [a, _] = await q.peek(2)
    await q.assign(a, 0, "http://e0")
    assert await q.finish("a", "done")
    assert await aredis.lrange(keys.wake, 0, -1) == [b"1"], "b waits: a freed slot is news to the router"
    await aredis.delete(keys.wake)
    assert await q.finish("b", "cancelled")
    assert await aredis.llen(keys.wake) == 0, "nothing waits: no wake"


async def test_reap_drops_only_stale_inflight_entries(aredis, keys, queue):
    q = queue
    await q.admit(mk("live"))
    [live] = await q.peek(1)
    await q.assign(live, 0, "http://e0")
    await aredis.sadd(keys.inflight(0), "ghost")
    assert await reap_stale_inflight(q, 0) == 1
    assert await aredis.smembers(keys.inflight(0)) == {b"live"}


async def test_fast_path_assigns_at_admission_while_the_queue_is_empty(aredis, keys, queue):
    """With targets published, a normal or low request admitted to an empty queue is assigned at once to the
    least loaded target with a free slot and KV for it (the reply is the assignment: nothing is published on the
    gateway's channel); high priority (to DP targets), a non-empty queue, a full target or too much KV: queued for
    the router."""
    from flying.messages import FastTarget, encode

    q = queue
    targets = [FastTarget(engine=0, url="http://e0", cap=2, max_kv=100), FastTarget(engine=1, url="http://e1", cap=1, max_kv=100)]  # fmt: skip
    assert await q.admit(mk("none")) is None, "no targets published: queued"
    await q.finish("none", "cancelled")
    await aredis.set(keys.fast_path, encode(targets))
    pubsub = aredis.pubsub()
    await pubsub.subscribe(keys.gateway_channel("g"))
    a = await q.admit(mk("a"))
    assert (a.id, a.engine, a.url) == ("a", 0, "http://e0")
    assert (await q.get("a"))["state"] == "assigned" and await aredis.sismember(keys.inflight(0), "a")
    assert (await q.admit(mk("b", "low"))).engine == 1, "the least loaded target"
    assert (await q.admit(mk("c"))).engine == 0
    assert await q.admit(mk("d")) is None, "every target full: queued"
    assert await q.admit(mk("e")) is None, "the queue is not empty: behind d"
    await q.finish("d", "cancelled")
    await q.finish("e", "cancelled")
    await q.finish("a", "done")
    assert await q.admit(mk("h", "high")) is None, "high priority: the router may bind a group for it"
    await q.finish("h", "cancelled")
    big = QueuedRequest(id="big", priority="normal", model="m", prompt_tokens=90, max_tokens=20, gateway="g", enqueued_at=0)  # fmt: skip
    assert await q.admit(big) is None, "more KV than the target holds"
    await q.finish("big", "cancelled")
    assert (await q.admit(mk("f"))).engine == 0
    msgs = []
    for _ in range(10):
        m = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
        if m is not None:
            msgs.append(decode(m["data"], Assignment).id)
    assert msgs == [], "a fast-path assignment is the admission's reply, not a message"
    stats = await aredis.hgetall(keys.stats)
    assert stats[b"fast"] == b"4" and stats[b"assigned"] == b"4"
    await pubsub.aclose()


async def test_a_request_sent_early_is_assigned_to_its_engine_or_declined_with_nothing_written(
    aredis, keys, queue
):
    """Early dispatch: a request the gateway sent to an engine already is assigned there when that engine is a
    fast-path target for it (even if not the least loaded); otherwise (the queue not empty, the engine full or not
    listed, high priority, too much KV) the admission declines it and writes nothing, not even its counters."""
    from flying.messages import FastTarget, encode

    q = queue
    targets = [FastTarget(engine=0, url="http://e0", cap=2, max_kv=100), FastTarget(engine=1, url="http://e1", cap=1, max_kv=100)]  # fmt: skip
    await aredis.set(keys.fast_path, encode(targets))
    assert (await q.admit(mk("a"), sent_to=0)).engine == 0
    a = await q.admit(mk("b"), sent_to=0)
    assert (a.engine, a.url) == (0, "http://e0"), "its engine, not the least loaded (engine 1)"
    assert await aredis.smembers(keys.inflight(0)) == {b"a", b"b"}
    before = await aredis.hgetall(keys.stats)

    async def declined(req: QueuedRequest, engine: int) -> None:
        with pytest.raises(EarlyDeclined):
            await q.admit(req, sent_to=engine)
        assert await q.get(req.id) == {}, "nothing written"

    await declined(mk("full"), 0)  # engine 0 holds its cap
    await declined(mk("unlisted"), 7)
    await declined(mk("high", "high"), 1)
    big = QueuedRequest(id="big", priority="normal", model="m", prompt_tokens=90, max_tokens=20, gateway="g", enqueued_at=0)  # fmt: skip
    await declined(big, 1)
    assert await aredis.hgetall(keys.stats) == before
    assert await q.admit(mk("q")) == Assignment(id="q", engine=1, url="http://e1", queue_ms=0.0)
    assert await q.admit(mk("waits")) is None  # every target full: queued
    await q.finish("q", "done")
    await declined(mk("behind"), 1)  # engine 1 has room again, but a request waits
    assert await aredis.zcard(keys.queue) == 1


async def test_a_prefix_chain_round_trips_through_the_record(aredis, keys, queue):
    """The chain the gateway computed is stored with the request record and read back by the router's peek."""
    from flying.prefix import block_hashes, encode_chain

    q = queue
    chain = block_hashes(list(range(40 * 64)))
    req = msgspec.structs.replace(mk("p"), prefix=encode_chain(chain))
    await q.admit(req)
    (back,) = await q.peek(5)
    assert back.prefix == req.prefix and back.chain == tuple(chain)
    await q.admit(mk("none"))
    assert (await q.peek(5))[1].chain == ()


async def test_affinity_targets_take_only_requests_without_a_prefix_chain(aredis, keys, queue):
    """Cache-aware dispatch publishes DP targets with ``affinity``: a request with a prefix chain waits for the
    router's round (which places it by prefix); one without takes the fast path as before."""
    from flying.messages import FastTarget, encode

    q = queue
    await aredis.set(keys.fast_path, encode([FastTarget(engine=0, url="http://e0", cap=4, max_kv=100, affinity=True)]))  # fmt: skip
    assert await q.admit(msgspec.structs.replace(mk("c"), prefix="AAAAAAAAAAE=")) is None, "queued"
    await q.finish("c", "cancelled")
    assert (await q.admit(mk("plain"))).engine == 0


async def test_a_leader_only_request_takes_no_followers_fast_path(aredis, keys, queue):
    """A constrained request (a grammar) cannot run on a bound group's follower: the script assigns it to the
    leader, or queues it for the router's round when only followers have room."""
    from flying.messages import FastTarget, encode

    q = queue
    follower = FastTarget(engine=1, url="http://e1", epoch=4, cap=4, max_kv=100, follower=True)
    await aredis.set(keys.fast_path, encode([follower]))
    pinned = msgspec.structs.replace(mk("j"), leader_only=True)
    assert await q.admit(pinned) is None, "queued"
    (back,) = await q.peek(5)
    assert back.leader_only
    await q.finish("j", "cancelled")
    assert (await q.admit(mk("plain"))).engine == 1
    leader = FastTarget(engine=0, url="http://e0", epoch=4, cap=4, max_kv=100)
    await aredis.set(keys.fast_path, encode([follower, leader]))
    assert (await q.admit(msgspec.structs.replace(mk("j2"), leader_only=True))).engine == 0


async def test_a_high_priority_request_takes_the_fast_path_only_to_a_bound_group(aredis, keys, queue):
    """High priority goes to a bound group's member at once (where the round would place it: a group with room),
    never to a DP engine (the round may bind it a group of its own); early dispatch alike."""
    from flying.messages import FastTarget, encode

    q = queue
    await aredis.set(keys.fast_path, encode([FastTarget(engine=0, url="http://e0", cap=4, max_kv=100)]))
    assert await q.admit(mk("h", "high")) is None, "DP targets: queued for the round"
    with pytest.raises(EarlyDeclined):
        await q.admit(mk("h-early", "high"), sent_to=0)
    await q.finish("h", "cancelled")
    group = [FastTarget(engine=2, url="http://e2", epoch=7, cap=4, max_kv=100)]
    await aredis.set(keys.fast_path, encode(group))
    assert (await q.admit(mk("h2", "high"))).engine == 2
    assert (await q.get("h2"))["epoch"] == "7"
    assert (await q.admit(mk("h3", "high"), sent_to=2)).engine == 2


class LosesTheFirstReply(AutoPipeline):
    """Runs each script, but the first call's reply is lost with its connection (Redis died after running it)."""

    lost = 0

    async def script(self, source, keys, args, wait=None):
        reply = await super().script(source, keys, args, wait)
        if not self.lost:
            self.lost += 1
            raise RedisConnectionError("connection lost after the script ran")
        return reply


async def test_behind_sentinel_an_admission_whose_reply_was_lost_is_sent_again_and_counts_once(
    aredis, keys, redis_server
):
    q = RequestQueue(aredis, keys, pipe=LosesTheFirstReply(port=redis_server.port))
    q.retry_s = 2.0  # what a Sentinel URL sets
    assert await q.admit(mk("a")) is None, "queued: the retry found the record the first try wrote"
    assert [r.id for r in await q.peek(10)] == ["a"]
    with pytest.raises(DuplicateId):
        await q.admit(mk("a"))  # a real duplicate, not a retry
    plain = RequestQueue(aredis, keys, pipe=LosesTheFirstReply(port=redis_server.port))
    with pytest.raises(RedisConnectionError):
        await plain.admit(mk("b"))  # a plain URL: the outage is the caller's to handle, as before


@pytest.mark.slow
async def test_the_router_waits_for_a_replica_and_stops_waiting_while_none_answers(keys, tmp_path):
    primary = RedisServer(data_dir=tmp_path / "p").start()
    replica = RedisServer(data_dir=tmp_path / "r", replica_of=primary.port).start()
    client = redis_conn.async_client(f"redis://127.0.0.1:{primary.port}/0?wait=1&wait_ms=300")
    try:
        while redis.Redis(port=replica.port).info("replication")["master_link_status"] != "up":
            await asyncio.sleep(0.05)
        q = RequestQueue(client, keys)
        await q.admit(mk("a"))
        assert await q.assign(mk("a"), 0, "http://e0") and q.gate.wanted(), "the replica acknowledged"
        replica.stop()
        await asyncio.sleep(0.3)
        await q.admit(mk("b"))  # waits the 300 ms once, then not while the replica is away
        assert not q.gate.wanted()
        t0 = time.monotonic()
        assert await q.assign(mk("b"), 0, "http://e0")
        assert time.monotonic() - t0 < 0.2
    finally:
        await client.aclose()
        replica.stop()
        primary.stop()
