"""ClusterView: what the gateway knows of the cluster. The transitions (engines lost and back, the router's lease
seen and missed) and the context limit are driven without Redis; the heartbeat read and the monitor's round trip
against a real Redis."""

from __future__ import annotations

import asyncio
import time

import msgspec

from flying.keys import Keys
from flying.messages import Heartbeat, RouterState, encode
from gateway.cluster_view import GATEWAY_TTL_MS, ClusterView, Tick
from gateway.config import GatewayConfig


def view(client=None, **config) -> ClusterView:
    cfg = GatewayConfig(model_path="unused", key_prefix="t", gateway_id="g1", **config)
    return ClusterView(client, Keys(cfg.key_prefix), cfg)


def beat(engine: int, num_engines: int = 1, kv: int = 1000, context: int = 8192) -> Heartbeat:
    return Heartbeat(
        engine=engine, url=f"http://e{engine}", pid=1, model="m", num_engines=num_engines,
        max_total_tokens=kv, context_len=context, free_kv_tokens=kv, ts=time.time(),
    )  # fmt: skip


def test_a_new_view_is_not_degraded_the_router_gets_a_grace_period():
    v = view(no_router_grace_s=5.0)
    assert v.degraded() == [] and not v.router_missing()
    assert v.no_workers_for(time.monotonic()) == 0.0


def test_no_live_engine_is_noted_from_the_first_observation_that_saw_none_until_one_is_back():
    v = view()
    now = time.monotonic()
    v.update(now - 4.0, live=False, lease=True)
    v.update(now - 1.0, live=False, lease=True)
    assert v.no_workers_since == now - 4.0 and v.no_workers_for(now) == 4.0
    assert v.degraded() == ["no live engine"]
    v.update(now, live=True, lease=True)
    assert v.no_workers_since is None and v.no_workers_for(now + 1.0) == 0.0 and v.degraded() == []


def test_a_router_lease_unseen_for_longer_than_the_grace_is_degraded_and_seen_again_is_not():
    v = view(no_router_grace_s=1.0)
    now = time.monotonic()
    v.update(now - 3.0, live=True, lease=False)  # missing since this observation
    v.update(now - 1.5, live=True, lease=False)
    assert v.router_missing()
    assert v.degraded() == ["no router has held the lease for 3 s"]
    v.update(now, live=True, lease=True)
    assert not v.router_missing() and v.degraded() == []


def test_a_monitor_that_looked_late_does_not_read_as_a_missing_router():
    """A busy event loop delays the monitor: a lease held at the last look and missing at this one (a router
    starved for a moment) has been missing since this look, not since the last one."""
    v = view(no_router_grace_s=1.0)
    now = time.monotonic()
    v.update(now - 8.0, live=True, lease=True)
    v.update(now, live=True, lease=False)
    assert not v.router_missing() and v.degraded() == []


def test_context_limit_is_one_engines_context_capped_by_the_widest_live_groups_kv():
    lone = [beat(0, kv=1000)]
    assert ClusterView.context_limit(lone) == 1000
    four = [beat(e, num_engines=4, kv=1000) for e in range(4)]
    assert ClusterView.context_limit(four) == 4000  # the full set binds
    assert ClusterView.context_limit(four, pooled=False) == 1000  # the router does not pool for long requests
    three = [beat(e, num_engines=4, kv=1000) for e in (0, 1, 3)]
    assert ClusterView.context_limit(three) == 2000  # only {0, 1} is whole
    assert ClusterView.context_limit([beat(e, 4, 1000, context=1500) for e in range(4)]) == 1500


def test_limit_follows_the_routers_published_pooling():
    v = view()
    four = [beat(e, num_engines=4) for e in range(4)]
    assert v.limit(four) == 4000
    v.pooled_context = False
    assert v.limit(four) == 1000


async def test_workers_are_read_at_most_every_max_age_and_concurrent_callers_share_one_read(aredis, keys):
    v = ClusterView(aredis, keys, GatewayConfig(model_path="unused", key_prefix=keys.prefix))
    assert await v.workers() == []
    hb = beat(0)
    await aredis.set(keys.worker(0), encode(hb), px=60_000)
    await aredis.sadd(keys.workers, 0)
    await aredis.set(keys.ready(0), "")
    assert await v.workers(max_age_s=60) == [], "the read of a moment ago"
    reads = []
    read = v._read_workers

    async def counted():
        reads.append(1)
        return await read()

    v._read_workers = counted
    together = await asyncio.gather(*(v.workers(max_age_s=0) for _ in range(5)))
    assert reads == [1] and all([b.engine for b in beats] == [0] for beats in together)
    await aredis.set(keys.router_state, encode(RouterState(long_context=False)))
    await v.workers(max_age_s=0)
    assert v.pooled_context is False


async def test_observe_renews_the_liveness_key_and_reads_the_lease_the_counter_and_the_depth(aredis, keys):
    v = ClusterView(aredis, keys, GatewayConfig(model_path="unused", key_prefix=keys.prefix, gateway_id="g1"))
    await aredis.hset(
        keys.stats, mapping={"assigned": 7, "completed": 5, "admitted_high": 3, "admitted_low": 1}
    )
    await aredis.zadd(keys.queue, {"a": 1, "b": 2})
    tick = await v.observe()
    assert isinstance(tick, Tick) and (tick.assigned, tick.depth, tick.admitted) == (7, 2, (3, 0, 1))
    assert (tick.completed, tick.engine_waiting) == (5, 0)
    assert 0 < await aredis.pttl(keys.gateway("g1")) <= GATEWAY_TTL_MS
    assert v.no_workers_since == tick.now, "no engine registered"
    assert v.lease_missing_since == tick.now, "no router holds the lease"
    await aredis.set(keys.router_lease, "r1", px=60_000)
    await v.observe()
    assert v.lease_missing_since is None


async def test_engines_live_a_moment_ago_are_waited_for_before_none_is_reported(aredis, keys):
    v = ClusterView(aredis, keys, GatewayConfig(model_path="unused", key_prefix=keys.prefix))
    await aredis.set(keys.worker(0), encode(beat(0)), px=60_000)
    await aredis.sadd(keys.workers, 0)
    await aredis.set(keys.ready(0), "")
    assert [b.engine for b in await v.workers(max_age_s=0)] == [0]
    await aredis.delete(keys.ready(0))  # a failover dropped the ready key; the launcher writes it again soon

    async def announce_again() -> None:
        await asyncio.sleep(0.4)
        await aredis.set(keys.ready(0), "")

    t0 = time.monotonic()
    again, _ = await asyncio.gather(v.workers_again(within_s=2.0), announce_again())
    assert [b.engine for b in again] == [0] and 0.4 <= time.monotonic() - t0 < 1.5
    await aredis.delete(keys.ready(0))
    t0 = time.monotonic()
    assert await v.workers_again(within_s=0.5) == [] and time.monotonic() - t0 < 1.0, (
        "then none, after the wait"
    )
    v.last_live -= 60
    t0 = time.monotonic()
    assert await v.workers_again(within_s=2.0) == [] and time.monotonic() - t0 < 0.3, "none for long: no wait"


async def test_observe_sums_the_requests_waiting_held_and_running_in_the_live_engines(
    aredis, sync_redis, keys
):
    from tests.stack import announce_engine

    announce_engine(sync_redis, keys, 0, waiting=3, running=2)
    announce_engine(sync_redis, keys, 1, url="http://e1", waiting=4, running=1)
    sync_redis.sadd(keys.inflight(0), *(f"r{i}" for i in range(9)))  # 2 run, 3 wait, 4 on their way
    sync_redis.sadd(keys.inflight(1), "s0", "s1")
    sync_redis.sadd(keys.inflight(5), "gone")  # an engine not live: not counted
    v = ClusterView(aredis, keys, GatewayConfig(model_path="unused", key_prefix=keys.prefix))
    tick = await v.observe()
    assert (tick.engine_waiting, tick.engine_held, tick.engine_running) == (7, 11, 3)


def test_the_context_limit_counts_every_nodes_widest_live_group():
    """Two nodes of two engines (KV 100 each): node 0 is down, node 1's pair still holds 200 tokens."""
    node1 = [
        msgspec.structs.replace(beat(e, num_engines=2, kv=100, context=10_000), pool_first=2) for e in (2, 3)
    ]
    assert ClusterView.context_limit(node1) == 200
    assert ClusterView.context_limit(node1[:1]) == 100, "its pair is not whole"
