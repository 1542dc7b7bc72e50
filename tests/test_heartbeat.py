"""The heartbeat publisher against a real Redis: periodic writes, immediate writes on a switch, expiry."""

import threading
import time

from flying.messages import Heartbeat, decode
from worker_ext.heartbeat import HeartbeatConfig, HeartbeatPublisher


def read(r, keys, engine=0):
    raw = r.get(keys.worker(engine))
    return decode(raw, Heartbeat) if raw else None


def wait_for(pred, timeout=2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (v := pred()) is not None:
            return v
        time.sleep(0.002)
    raise AssertionError("timed out")


def test_writes_periodically_and_at_once_on_a_mode_change(sync_redis, keys, redis_server):
    pub = HeartbeatPublisher(
        HeartbeatConfig(engine=0, url="u", model="m", redis_url=redis_server.url, key_prefix=keys.prefix)
    )
    pub.beat(running=1, mode="dp", epoch=0)
    pub.start()
    assert wait_for(lambda: read(sync_redis, keys)).running == 1
    assert sync_redis.sismember(keys.workers, 0)
    pub.beat(running=2, mode="dp", epoch=0)  # an ordinary step: picked up within one interval
    assert wait_for(lambda: (hb := read(sync_redis, keys)) and hb.running == 2 and hb or None, 0.5)
    time.sleep(0.02)
    t0 = time.monotonic()
    pub.beat(running=2, mode="tp", epoch=3, group=(0, 1), width=2)  # a switch: written at once
    hb = wait_for(lambda: (hb := read(sync_redis, keys)) and hb.mode == "tp" and hb or None, 0.5)
    assert time.monotonic() - t0 < 0.04 and hb.group == (0, 1) and hb.epoch == 3
    ttl = sync_redis.pttl(keys.worker(0))
    assert 1000 < ttl <= 3000  # a starved scheduler survives a few seconds; a dead one vanishes
    pub.stop()
    step = read(sync_redis, keys).step
    pub.beat(running=9, mode="dp", epoch=0)
    time.sleep(0.15)
    assert read(sync_redis, keys).step == step  # stopped: nothing written any more


def test_a_stalled_writer_is_not_declared_dead(redis_server, sync_redis, keys):
    """A scheduler starved of CPU for a second and a half (no beat written) still has its heartbeat key."""
    pub = HeartbeatPublisher(
        HeartbeatConfig(engine=0, url="u", model="m", redis_url=redis_server.url, key_prefix=keys.prefix)
    )
    pub.beat(running=1, mode="dp", epoch=0)
    pub.start()
    assert wait_for(lambda: read(sync_redis, keys))
    stalled = threading.Event()
    real = pub.snapshot

    def slow():
        if not stalled.is_set():
            stalled.set()
            time.sleep(1.5)
        return real()

    pub.snapshot = slow
    assert stalled.wait(1)
    time.sleep(1.3)
    assert sync_redis.exists(keys.worker(0)), "still live after 1.3 s without a beat"
    pub.stop()
