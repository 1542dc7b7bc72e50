"""The router's dispatch round against a real Redis with heartbeats written as a worker would."""

from __future__ import annotations

import asyncio
import time

import pytest

from flying import control
from flying.messages import (
    DecisionEvent,
    Group,
    Heartbeat,
    QueuedRequest,
    Release,
    RouterState,
    decode,
    decode_command,
    encode,
)
from flying.queue import RequestQueue
from router.config import MANUAL_OFF, Limits, RouterConfig
from router.dispatcher import Dispatcher
from router.policy import GroupLoad, PolicyConfig


async def beat(r, keys, engine: int, ready: bool = True, **kw) -> None:
    launch_id = kw.pop("launch_id", f"L{engine}")
    hb = Heartbeat(
        **kw,
        engine=engine,
        url=f"http://e{engine}",
        pid=1,
        model="m",
        launch_id=launch_id,
        free_kv_tokens=1000,
        max_total_tokens=1000,
        context_len=4096,
        ts=time.time(),
    )
    await r.set(keys.worker(engine), encode(hb), px=1000)
    await r.sadd(keys.workers, engine)
    if ready:
        await r.set(keys.ready(engine), launch_id)


def dispatcher(aredis, keys, **limits) -> Dispatcher:
    """The real dispatcher, no automatic groups, within ``limits`` (Limits fields)."""
    p, lim = PolicyConfig(off=MANUAL_OFF), Limits(**limits)
    return Dispatcher(RouterConfig(key_prefix=keys.prefix, policy=p, limits=lim), aredis)


async def admit(q: RequestQueue, n: int, priority: str = "normal") -> None:
    for i in range(n):
        await q.admit(
            QueuedRequest(
                id=f"{priority}{i}",
                priority=priority,
                model="m",
                prompt_tokens=10,
                max_tokens=10,
                gateway="g",
                enqueued_at=time.time(),
            )
        )


async def test_dispatches_only_to_live_ready_engines(aredis, keys):
    await beat(aredis, keys, 0)
    await beat(aredis, keys, 1, ready=False)  # heartbeating but its HTTP server is not up yet
    q = RequestQueue(aredis, keys)
    await admit(q, 3)
    assert await dispatcher(aredis, keys).round() == 3
    assert await aredis.scard(keys.inflight(0)) == 3
    assert await aredis.scard(keys.inflight(1)) == 0


async def test_holds_requests_in_redis_beyond_the_inflight_cap(aredis, keys):
    await beat(aredis, keys, 0)
    q = RequestQueue(aredis, keys)
    await admit(q, 5, "low")
    await admit(q, 1, "high")
    d = dispatcher(aredis, keys, max_inflight_per_worker=2)
    assert await d.round() == 2
    assert (await q.get("high0"))["state"] == "assigned", "high priority goes first"
    assert await q.depth() == 4


async def test_expired_heartbeat_means_no_dispatch(aredis, keys):
    await beat(aredis, keys, 0)
    await aredis.delete(keys.worker(0))  # as if it expired
    q = RequestQueue(aredis, keys)
    await admit(q, 1)
    assert await dispatcher(aredis, keys).round() == 0


async def test_only_one_router_holds_the_lease(aredis, keys):
    a, b = dispatcher(aredis, keys), dispatcher(aredis, keys)
    assert await a.hold_lease()
    assert not await b.hold_lease()
    assert await a.hold_lease(), "the holder renews"


async def test_run_loop_dispatches_new_arrivals_and_stops(aredis, keys):
    await beat(aredis, keys, 0)
    d = dispatcher(aredis, keys)
    stop = asyncio.Event()
    task = asyncio.create_task(d.run(stop))
    q = RequestQueue(aredis, keys)
    await admit(q, 4)
    for _ in range(100):
        if d.dispatched == 4:
            break
        await asyncio.sleep(0.02)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert d.dispatched == 4
    assert await aredis.exists(keys.router_lease) == 0, "a clean stop gives the lease back"


async def test_a_round_that_raises_is_logged_and_the_router_goes_on(aredis, keys, monkeypatch, caplog):
    """An unforeseen state makes one round raise: every router reads the same state, so a crash would take the
    standby down with the leader. The error is logged and counted, and the next round dispatches."""
    await beat(aredis, keys, 0)
    d = dispatcher(aredis, keys)
    monkeypatch.setattr("router.dispatcher.ROUND_RETRY_S", 0.05)
    real, calls = d.round, []

    async def flaky() -> int:
        calls.append(1)
        if len(calls) == 1:
            raise ZeroDivisionError("float division by zero")
        return await real()

    monkeypatch.setattr(d, "round", flaky)
    stop = asyncio.Event()
    task = asyncio.create_task(d.run(stop))
    await admit(RequestQueue(aredis, keys), 2)
    for _ in range(200):
        if d.dispatched == 2:
            break
        await asyncio.sleep(0.02)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert d.dispatched == 2 and d.metrics.round_errors._value.get() == 1
    assert "router round failed" in caplog.text and "ZeroDivisionError" in caplog.text


async def test_a_groups_requests_go_to_its_members_in_turn_and_its_load_counts_every_member(aredis, keys):
    """A bound group whose members transform KV: the round sends its requests to both members (each owns and
    streams its own), and the next snapshot counts the group's requests in every member's inflight set (not a DP
    request a member holds)."""
    for e in (0, 1):
        await beat(aredis, keys, e, mode="tp", epoch=4, kv_transform=True)
    g = Group(epoch=4, members=(0, 1), reason="manual", state="bound", since=time.time())
    await aredis.hset(keys.groups, "4", encode(g))
    q = RequestQueue(aredis, keys)
    await admit(q, 4)
    d = dispatcher(aredis, keys)
    assert await d.round() == 4
    assert [await aredis.scard(keys.inflight(e)) for e in (0, 1)] == [2, 2]
    assert {(await q.get(f"normal{i}"))["url"] for i in range(4)} == {"http://e0", "http://e1"}
    dp = QueuedRequest(id="dp", priority="normal", model="m", prompt_tokens=10, max_tokens=10, gateway="g", enqueued_at=time.time())  # fmt: skip
    await q.admit(dp)
    await q.assign_many([(dp, 1, "http://e1", 0)])
    assert (await d.snapshot()).tp_load[4] == GroupLoad(inflight=4, kv_tokens=80, max_kv_tokens=20)


async def test_a_round_that_binds_writes_its_decisions_to_the_log(aredis, keys):
    """Light load binds the idle engines: the regime change and the bind (with its epoch) reach
    flying:router:decisions, as values and as the router's log lines."""
    for e in (0, 1):
        await beat(aredis, keys, e, num_engines=2)
    await aredis.set(
        keys.router_state, encode(RouterState(busy=False, widths={"0": 2}, planned_at=time.time()))
    )
    d = Dispatcher(RouterConfig(key_prefix=keys.prefix, policy=PolicyConfig()), aredis)
    await d.round()
    entries = [decode(fields[b"event"], DecisionEvent) for _, fields in await aredis.xrange(keys.decisions)]
    [bind] = [e for e in entries if e.kind == "bind"]
    [group] = control.decode_groups(await aredis.hgetall(keys.groups))
    assert (bind.epoch, bind.members, bind.reason) == (group.epoch, (0, 1), "load")
    assert bind.text.startswith("bind (0, 1) (load, hard preemption") and bind.ts > 0


async def test_snapshot_carries_kv_transform_and_the_admission_counter(aredis, keys):
    """The policy adopts/scatters only where heartbeats say kv_transform; the rate regime reads flying:stats."""
    await beat(aredis, keys, 0, kv_transform=True)
    await beat(aredis, keys, 1)
    await admit(RequestQueue(aredis, keys), 3)
    s = await dispatcher(aredis, keys).snapshot()
    assert {e.engine: e.kv_transform for e in s.engines} == {0: True, 1: False}
    assert s.admitted == 3


def test_router_flags_turn_mechanisms_off_and_set_the_planners_targets_and_limits():
    from router.main import parse_args

    assert parse_args([]).policy.on("kv-transform")
    c = parse_args(
        [
            "--off",
            "kv-transform,park",
            "--ttft-target-normal-ms",
            "500",
            "--max-width",
            "4",
            "--suspect-s",
            "3",
        ]
    )
    p = c.policy
    assert (p.off, p.ttft_target_normal_ms, p.max_width) == (frozenset({"kv-transform", "park"}), 500.0, 4)
    assert c.limits.suspect_s == 3.0
    assert parse_args(["--manual"]).policy.off == frozenset({"load", "priority", "long-context"})
    assert parse_args(["--off", "none"]).policy == parse_args([]).policy


def test_an_unknown_mechanism_is_a_usage_error_listing_the_known_ones(capsys):
    from router.main import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--off", "park,parking"])
    err = capsys.readouterr().err
    assert "--off: unknown mechanism parking (known: load, priority" in err


def test_an_out_of_range_setting_is_a_usage_error_naming_it(capsys):
    from router.main import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(["--max-width", "3"])
    assert (
        exit_.value.code == 2 and "--max-width must be a power of two >= 1, got 3" in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        parse_args(["--lease-ms", "100"])
    assert "--lease-ms must be >= 500, got 100" in capsys.readouterr().err
    with pytest.raises(ValueError, match="lease_ms must be >= 500, got 100"):
        RouterConfig(lease_ms=100)


async def test_a_lost_gateways_requests_are_ended_and_aborted(aredis, keys, monkeypatch):
    """Gateway "g" died (no liveness key): after the grace its queued and running requests are finished as
    cancelled, leave the queue and the inflight set, and the engine is asked to abort the running one; a live
    gateway's request is left alone, and nothing is ended before the grace."""
    import router.dispatcher as mod
    from flying.procs import free_port
    from loadgen import fake_server

    await beat(aredis, keys, 0)
    q = RequestQueue(aredis, keys)
    await admit(q, 2)  # gateway "g", no liveness key
    alive = QueuedRequest(id="kept", priority="normal", model="m", prompt_tokens=1, max_tokens=1, gateway="g2", enqueued_at=time.time())  # fmt: skip
    await q.admit(alive)
    await aredis.set(keys.gateway("g2"), "g2", px=10_000)
    engine, port = fake_server.EngineState(), free_port()
    async with await fake_server.serve(port, state=engine):
        await q.assign((await q.peek(1))[0], 0, f"http://127.0.0.1:{port}")
        d = dispatcher(aredis, keys)
        await d.maintenance()  # first sighting: within the grace
        assert await q.depth() == 2 and await aredis.scard(keys.inflight(0)) == 1
        monkeypatch.setattr(mod, "GATEWAY_GRACE_S", 0.0)
        d._last_reap = 0.0
        await d.maintenance()
        assert engine.aborted == ["normal0~0"]
    assert [r.id for r in await q.peek(10)] == ["kept"]
    assert await aredis.scard(keys.inflight(0)) == 0
    for rid in ("normal0", "normal1"):
        rec = await q.get(rid)
        assert rec["state"] == "cancelled" and rec["error"] == "gateway g lost"
    await d.close()


async def test_cache_aware_rounds_keep_a_cache_keys_requests_on_one_engine(aredis, keys):
    """Requests with the same ``prompt_cache_key`` (``keyed``, its hash heading the chain stored with the record)
    and prompts that share no block go where the key went first, though the other engine is less loaded; another
    key goes to the least loaded."""
    from flying.prefix import block_hashes, encode_chain

    await beat(aredis, keys, 0)
    await beat(aredis, keys, 1)
    q = RequestQueue(aredis, keys)
    d = dispatcher(aredis, keys)

    async def send(rid: str, key: str, token: int) -> int:
        chain = encode_chain(block_hashes([token] * 8 * 64, key=key))
        await q.admit(QueuedRequest(id=rid, model="m", prompt_tokens=512, max_tokens=8, gateway="g",
                                    enqueued_at=time.time(), prefix=chain, keyed=True))  # fmt: skip
        assert await d.round() == 1
        return int((await q.get(rid))["engine"])

    first = await send("a", "user-7", 1)
    assert await send("b", "user-7", 2) == first and await send("c", "user-7", 3) == first, "3 vs 0 in flight"
    assert await send("d", "user-8", 4) != first


async def test_cache_aware_rounds_follow_a_prefix_the_router_dispatched_before(aredis, keys):
    """The router records each round's DP dispatches in its prefix index, read from the chains stored with the
    records: a later request sharing the prompt's prefix follows it, though the other engine is less loaded; a
    restarted engine (new launch id) is forgotten."""
    from flying.prefix import block_hashes, encode_chain

    await beat(aredis, keys, 0)
    await beat(aredis, keys, 1)
    q = RequestQueue(aredis, keys)
    d = dispatcher(aredis, keys)
    system = list(range(10 * 64))

    async def send(rid: str, tail: int) -> int:
        chain = encode_chain(block_hashes(system + [tail] * 64))
        await q.admit(QueuedRequest(id=rid, model="m", prompt_tokens=704, max_tokens=8, gateway="g",
                                    enqueued_at=time.time(), prefix=chain))  # fmt: skip
        assert await d.round() == 1
        return int((await q.get(rid))["engine"])

    first = await send("a", 1)
    assert await send("b", 2) == first, "the shared system prompt is cached there (1 vs 0 in flight)"
    assert d.prefixes.blocks(first) == 12
    await beat(aredis, keys, first, launch_id="restarted")
    await d.snapshot()
    assert d.prefixes.blocks(first) == 0


async def test_a_parked_epochs_load_is_the_requests_it_parked_not_those_it_scattered(aredis, keys):
    """Epoch 3 was parked: its long request (1,510 KV tokens, more than one engine's 1,000) stays on the members,
    its short one was scattered to DP on its owner. The parked record's load is the long request only, and so is
    what the group resuming it carries beside its own requests; the short one is DP work (it counts in demand)."""
    for e in (0, 1):
        await beat(aredis, keys, e, parked=(3,))
    q = RequestQueue(aredis, keys)

    def req(rid: str, prompt: int) -> QueuedRequest:
        return QueuedRequest(id=rid, priority="normal", model="m", prompt_tokens=prompt, max_tokens=10, gateway="g",
                             enqueued_at=time.time())  # fmt: skip

    long, short, own = req("long", 1500), req("short", 10), req("own", 10)
    for r in (long, short, own):
        await q.admit(r)
    await q.assign_many([(long, 0, "http://e0", 3), (short, 1, "http://e1", 3)])
    parked = Group(epoch=3, members=(0, 1), reason="long", state="parked", since=time.time(), park=True)
    await aredis.hset(keys.groups, "3", encode(parked))
    d = dispatcher(aredis, keys)
    s = await d.snapshot()
    assert s.tp_load[3] == GroupLoad(inflight=1, kv_tokens=1510, max_kv_tokens=1510)
    assert s.demand == 2  # the short one in DP and the request still queued; not the parked one
    await aredis.hdel(keys.groups, "3")
    resuming = Group(epoch=5, members=(0, 1), reason="long", state="bound", since=time.time(), carries=(3,))
    await aredis.hset(keys.groups, "5", encode(resuming))
    await q.assign_many([(own, 1, "http://e1", 5)])
    assert (await d.snapshot()).tp_load[5] == GroupLoad(inflight=2, kv_tokens=1530, max_kv_tokens=1510)


async def test_a_parked_request_whose_client_left_ends_its_epoch_on_the_members(aredis, keys):
    """A parked epoch's long request is counted in a round; its client leaves (the gateway cancels it: gone from
    the inflight set); the next round releases the epoch on both members (their parked KV is freed) and deletes
    its record, with the reason in the decision log."""
    for e in (0, 1):
        await beat(aredis, keys, e, parked=(3,), park=True, kv_transform=True)
    q = RequestQueue(aredis, keys)
    long = QueuedRequest(id="long", priority="normal", model="m", prompt_tokens=1500, max_tokens=10, gateway="g",
                         enqueued_at=time.time())  # fmt: skip
    await q.admit(long)
    await q.assign_many([(long, 0, "http://e0", 3)])
    parked = Group(epoch=3, members=(0, 1), reason="long", state="parked", since=time.time(), park=True)
    await aredis.hset(keys.groups, "3", encode(parked))
    d = dispatcher(aredis, keys)
    await d.round()
    assert decode(await aredis.hget(keys.groups, "3"), Group).parked_requests == 1
    assert not await aredis.xlen(keys.commands(0))
    await q.finish("long", "cancelled", "client disconnected")
    await d.round()
    assert await aredis.hget(keys.groups, "3") is None
    for e in (0, 1):
        (_, fields), *_ = await aredis.xrange(keys.commands(e))
        assert decode_command(fields[b"msg"]) == Release(epoch=3)
    entries = [decode(f[b"event"], DecisionEvent) for _, f in await aredis.xrange(keys.decisions)]
    assert any(e.epoch == 3 and "its parked requests ended" in e.text for e in entries)


def test_the_planner_predicts_with_the_policys_sp_threshold_else_the_engines_own():
    from router.dispatcher import sp_threshold

    beats = [
        Heartbeat(engine=i, url="u", pid=1, model="m", sp_threshold=t) for i, t in enumerate((512, 512, 256))
    ]
    assert (
        sp_threshold(None, beats) == 512 and sp_threshold(0, beats) == 0 and sp_threshold(128, beats) == 128
    )
    assert sp_threshold(None, [Heartbeat(engine=0, url="u", pid=1, model="m")]) == 256, "none reported"
