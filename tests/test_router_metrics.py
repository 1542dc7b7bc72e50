"""The router's metrics: what a round's decision counts, and the cluster's state read from a real Redis."""

from __future__ import annotations

import msgspec
from prometheus_client import generate_latest

from flying.keys import Keys
from flying.messages import Group, Release, RouterState, encode
from router.metrics import ClusterCollector, RouterMetrics, scrape_client
from router.policy import Decision
from tests.stack import announce_engine

BINDING = Group(epoch=3, members=(0, 1), reason="load", state="binding", since=100.0, adopt=True)


def value(m: RouterMetrics, name: str, **labels) -> float:
    v = m.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_a_bind_is_issued_then_bound_and_a_release_issued_then_done():
    m = RouterMetrics()
    m.observe([], Decision(binds=[msgspec.structs.replace(BINDING, epoch=0)]), assigned=0, now=100.0)
    assert value(m, "flying_router_binds_total", reason="load", mode="adopt", outcome="issued") == 1
    bound = msgspec.structs.replace(BINDING, state="bound", since=100.02)
    m.observe([BINDING], Decision(put={3: bound}), assigned=0, now=100.02)
    assert value(m, "flying_router_binds_total", reason="load", mode="adopt", outcome="bound") == 1
    assert value(m, "flying_router_switch_seconds_count", kind="bind") == 1
    assert abs(value(m, "flying_router_switch_seconds_sum", kind="bind") - 0.02) < 1e-9
    releasing = msgspec.structs.replace(bound, state="releasing", since=101.0, released="scatter")
    d = Decision(put={3: releasing}, commands=[((0, 1), Release(epoch=3, scatter=True))])
    m.observe([bound], d, assigned=0, now=101.0)
    assert value(m, "flying_router_releases_total", reason="load", mode="scatter", outcome="issued") == 1
    m.observe([releasing], Decision(drop=[3]), assigned=0, now=101.5)
    assert value(m, "flying_router_releases_total", reason="load", mode="scatter", outcome="done") == 1
    assert abs(value(m, "flying_router_switch_seconds_sum", kind="release") - 0.5) < 1e-9
    assert value(m, "flying_router_rounds_total") == 4


def test_a_release_flyctl_sent_is_counted_done_with_its_mode():
    """flyctl writes the releasing record itself (the router issued nothing): its mode comes from the record."""
    m = RouterMetrics()
    releasing = msgspec.structs.replace(BINDING, state="releasing", reason="manual", released="retract")
    m.observe([releasing], Decision(drop=[3]), assigned=0, now=101.5)
    assert value(m, "flying_router_releases_total", reason="manual", mode="retract", outcome="done") == 1


def test_a_bind_released_before_it_bound_is_rolled_back():
    m = RouterMetrics()
    rolled = msgspec.structs.replace(BINDING, state="releasing")
    m.observe([BINDING], Decision(put={3: rolled}, commands=[((0, 1), Release(epoch=3))]), assigned=0)
    assert value(m, "flying_router_binds_total", reason="load", mode="adopt", outcome="rolled_back") == 1
    assert value(m, "flying_router_binds_total", reason="load", mode="adopt", outcome="bound") == 0


def test_the_cluster_collector_reads_queue_engines_groups_and_regime(sync_redis, keys):
    from flying.messages import QueuedRequest
    from flying.queue import CLASS_WEIGHT

    announce_engine(sync_redis, keys, engine=0, running=3, prompt_tokens=400, cached_tokens=300, parked=(2,))
    announce_engine(
        sync_redis, keys, engine=1, mode="tp", epoch=3, group=(0, 1), width=2, steps_sp=4, steps_tp=9
    )
    sync_redis.hset(keys.groups, "3", encode(msgspec.structs.replace(BINDING, state="bound")))
    sync_redis.set(keys.router_state, encode(RouterState(busy=False)))
    sync_redis.set(keys.router_lease, "me")
    sync_redis.hset(keys.stats, mapping={"admitted": 7, "fast": 2})
    req = QueuedRequest(id="q", priority="high", model="m", prompt_tokens=1, max_tokens=1, gateway="g", enqueued_at=1.0)  # fmt: skip
    sync_redis.hset(keys.request("q"), mapping={"enqueued_at": "1.0"})
    sync_redis.zadd(keys.queue, {req.id: 0 * CLASS_WEIGHT + 1})
    m = RouterMetrics()
    m.registry.register(ClusterCollector(sync_redis, keys, "me"))
    text = generate_latest(m.registry).decode()
    assert 'flying_queue_depth{priority="high"} 1.0' in text
    assert 'flying_queue_depth{priority="normal"} 0.0' in text
    assert value(m, "flying_queue_oldest_wait_seconds", priority="high") > 1e9  # enqueued at t=1 s
    assert value(m, "flying_requests_total", event="admitted") == 7
    assert value(m, "flying_engine_mode", engine="0", mode="dp") == 1
    assert value(m, "flying_engine_mode", engine="1", mode="tp") == 1
    assert value(m, "flying_engine_running", engine="0") == 3
    assert value(m, "flying_engine_width", engine="1") == 2
    assert value(m, "flying_engine_prompt_tokens_total", engine="0") == 400
    assert value(m, "flying_engine_cached_tokens_total", engine="0") == 300
    assert value(m, "flying_group_steps_total", engine="1", mode="sp") == 4
    assert value(m, "flying_group_steps_total", engine="1", mode="tp") == 9
    assert value(m, "flying_engine_parked_epochs", engine="0") == 1
    assert value(m, "flying_engine_parked_epochs", engine="1") == 0
    assert value(m, "flying_engine_prefix_cache_hit_ratio", engine="0") == 0.75
    assert m.registry.get_sample_value("flying_engine_prefix_cache_hit_ratio", {"engine": "1"}) is None, (
        "none yet"
    )
    assert value(m, "flying_groups", width="2", reason="load", state="bound") == 1
    assert value(m, "flying_router_regime", regime="light") == 1
    assert value(m, "flying_router_leader") == 1
    assert value(m, "flying_router_redis_up") == 1
    sync_redis.delete(keys.groups)  # released: the series reads 0 (sum(flying_groups) is 0, not no data)
    assert (
        m.registry.get_sample_value("flying_groups", {"width": "2", "reason": "load", "state": "bound"}) == 0
    )


def test_the_switch_histogram_leaves_out_the_release_of_a_bind_that_never_formed():
    m = RouterMetrics()
    rolled = msgspec.structs.replace(BINDING, state="releasing", since=100.0)
    m.observe([BINDING], Decision(put={3: rolled}, commands=[((0, 1), Release(epoch=3))]), assigned=0)
    m.observe([rolled], Decision(drop=[3]), assigned=0, now=100.1)
    assert value(m, "flying_router_releases_total", reason="load", mode="wait", outcome="done") == 1
    assert value(m, "flying_router_switch_seconds_count", kind="release") == 0


def test_the_cluster_series_in_base_units_and_admissions_by_priority(sync_redis, keys):
    announce_engine(
        sync_redis, keys, engine=0, bind_ms=4.5, release_ms=1.5, transform_ms=20.0, comm_rebuilds=2
    )
    sync_redis.set(keys.router_lease, "me")
    sync_redis.hset(keys.stats, mapping={"admitted": 7, "admitted_high": 2, "admitted_normal": 5})
    m = RouterMetrics()
    m.registry.register(ClusterCollector(sync_redis, keys, "me"))
    assert value(m, "flying_engine_last_bind_seconds", engine="0") == 0.0045
    assert value(m, "flying_engine_last_release_seconds", engine="0") == 0.0015
    assert value(m, "flying_engine_last_kv_transform_seconds", engine="0") == 0.02
    assert value(m, "flying_engine_comm_rebuilds_total", engine="0") == 2
    assert value(m, "flying_requests_admitted_by_priority_total", priority="high") == 2
    assert value(m, "flying_requests_admitted_by_priority_total", priority="normal") == 5
    assert m.registry.get_sample_value("flying_requests_total", {"event": "admitted_high"}) is None
    assert value(m, "flying_requests_total", event="admitted") == 7


def test_only_the_leader_exports_the_cluster_state(sync_redis, keys):
    """Two routers scraped (k8s runs a standby): the cluster's series come from the lease holder alone, so a
    sum over routers counts each request once."""
    announce_engine(sync_redis, keys, engine=0, running=3)
    sync_redis.set(keys.router_lease, "other")
    m = RouterMetrics()
    m.registry.register(ClusterCollector(sync_redis, keys, "me"))
    text = generate_latest(m.registry).decode()
    assert "flying_queue_depth" not in text and "flying_engine_running" not in text
    assert value(m, "flying_router_leader") == 0 and value(m, "flying_router_redis_up") == 1


def test_a_scrape_with_redis_down_still_answers_with_the_routers_own_series():
    down = scrape_client("redis://127.0.0.1:1/0")  # nothing listens on port 1
    m = RouterMetrics()
    m.rounds.inc()
    m.registry.register(ClusterCollector(down, Keys("flying"), "me", leading=lambda: True))
    text = generate_latest(m.registry).decode()
    assert "flying_router_rounds_total 1.0" in text
    assert value(m, "flying_router_redis_up") == 0 and value(m, "flying_router_leader") == 1
    assert "flying_queue_depth" not in text


def test_a_parking_release_is_done_when_its_record_turns_parked():
    m = RouterMetrics()
    bound = msgspec.structs.replace(BINDING, state="bound")
    releasing = msgspec.structs.replace(BINDING, state="releasing", since=10.0, park=True, released="park")
    m.observe([bound], Decision(put={3: releasing}, commands=[((0, 1), Release(epoch=3, park=True))]), 0)
    assert value(m, "flying_router_releases_total", reason="load", mode="park", outcome="issued") == 1
    parked = msgspec.structs.replace(releasing, state="parked")
    m.observe([releasing], Decision(put={3: parked}), 0, now=10.5)
    assert value(m, "flying_router_releases_total", reason="load", mode="park", outcome="done") == 1
    assert m.registry.get_sample_value("flying_router_switch_seconds_sum", {"kind": "release"}) == 0.5
