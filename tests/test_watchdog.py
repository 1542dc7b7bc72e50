"""The router's stall watchdog (router.watchdog): pure readings, then the dispatcher's reading of a real Redis."""

from __future__ import annotations

import logging
import time

from flying.messages import Group, Heartbeat, encode
from router.config import RouterConfig
from router.dispatcher import Dispatcher
from router.watchdog import Change, Progress, Watchdog


def reading(moved: int, queued: int = 0, kv: tuple[int, ...] = (), **inflight: int) -> Progress:
    return Progress(queued, {int(e[1:]): n for e, n in inflight.items()}, moved, kv)


def test_a_stall_begins_once_nothing_moved_for_stall_s_while_requests_are_pending():
    w = Watchdog(stall_s=30)
    assert w.observe(0.0, reading(5, queued=3)) is None
    assert w.observe(29.0, reading(5, queued=3)) is None and not w.stalled
    event = w.observe(30.0, reading(5, queued=3, e0=2))
    assert event is not None and event.change is Change.STALLED and w.stalled
    assert "for 30 s while 3 wait in the queue and 2 are in flight (0:2)" in str(event)
    assert str(event).startswith(
        "stalled: no request assigned, finished or re-queued, and no engine's KV changed"
    )
    assert w.observe(40.0, reading(5, queued=3)) is None, "said once per stall"
    resumed = w.observe(42.0, reading(6, queued=2))
    assert resumed is not None and resumed.change is Change.RESUMED and not w.stalled
    assert str(resumed) == "requests move again after a stall of 42 s"


def test_an_idle_cluster_or_one_that_keeps_moving_is_never_stalled():
    w = Watchdog(stall_s=30)
    assert all(w.observe(t, reading(5)) is None for t in (0.0, 40.0, 80.0)), "nothing pending"
    assert w.observe(81.0, reading(5, e1=1)) is None, "the clock starts when requests become pending"
    assert all(w.observe(81.0 + 20 * i, reading(5 + i, e1=1)) is None for i in range(1, 6))
    assert Watchdog(stall_s=0).observe(1e6, reading(5, queued=9)) is None, "off"


def test_a_long_generation_alone_is_progress_while_its_engines_kv_changes():
    w = Watchdog(stall_s=30)
    assert all(w.observe(20.0 * i, reading(5, kv=(1000 - i, 4096), e0=1)) is None for i in range(6))
    assert w.observe(130.0, reading(5, kv=(995, 4096), e0=1)) is not None, "its KV stopped changing"


async def test_the_dispatcher_logs_where_the_requests_are_held_and_sets_the_gauge(aredis, keys, caplog):
    """Requests in flight on two engines bound in a group that holds them paused: the warning names the group
    and each engine's state, so the operator sees where they are held."""
    d = Dispatcher(RouterConfig(key_prefix=keys.prefix, stall_s=30), aredis)
    group = Group(epoch=2, members=(0, 1), reason="load", state="bound", adopt=True)
    await aredis.hset(keys.groups, "2", encode(group))
    for e in (0, 1):
        hb = Heartbeat(engine=e, url=f"http://e{e}", pid=1, model="m", launch_id="L", mode="tp", epoch=2,
                       paused=106, ts=time.time())  # fmt: skip
        await aredis.set(keys.worker(e), encode(hb), px=10_000)
        await aredis.set(keys.ready(e), "L")
        await aredis.sadd(keys.inflight(e), *(f"r{e}-{i}" for i in range(106)))
    await aredis.hset(keys.stats, mapping={"assigned": 500, "completed": 288})
    caplog.set_level(logging.WARNING, logger="flying.router")
    await d.watch([0, 1], 100.0)
    await d.watch([0, 1], 129.0)
    assert not caplog.records and d.metrics.stalled._value.get() == 0
    await d.watch([0, 1], 130.0)
    [warning] = [r.getMessage() for r in caplog.records]
    assert (
        "stalled: no request assigned, finished or re-queued, and no engine's KV changed, for 30 s" in warning
    )
    assert "212 are in flight (0:106 1:106)" in warning
    assert "groups [epoch 2 (0, 1) load bound adopt]" in warning
    assert "0: tp epoch 2 pending 0 running 0 waiting 0 paused 106" in warning
    assert d.metrics.stalled._value.get() == 1 and d.metrics.stalls._value.get() == 1
    await aredis.hincrby(keys.stats, "completed", 1)
    await d.watch([0, 1], 132.0)
    assert caplog.records[-1].getMessage() == "requests move again after a stall of 32 s"
    assert d.metrics.stalled._value.get() == 0
    await d.close()
