"""The launcher's liveness signal: the ready key lives exactly as long as the server process (refreshed with a
TTL), and rides out Redis losing its data or restarting."""

from __future__ import annotations

import subprocess
import threading
import time

import redis

from flying.redis_server import RedisServer
from worker_ext import launch


def keep_ready_in_thread(r, key, proc) -> dict:
    out: dict = {}
    t = threading.Thread(
        target=lambda: out.setdefault("rc", launch.keep_ready(r, key, "L1", proc)), daemon=True
    )
    t.start()
    out["thread"] = t
    return out


def wait_for(pred, timeout_s: float) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout_s, "condition not met in time"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_ready_key_expires_with_the_server_process(sync_redis, keys):
    proc = subprocess.Popen(["sleep", "1.5"])
    out = keep_ready_in_thread(sync_redis, keys.ready(0), proc)
    wait_for(lambda: sync_redis.get(keys.ready(0)) == b"L1", 2)
    assert 0 < sync_redis.pttl(keys.ready(0)) <= launch.READY_TTL_MS
    sync_redis.delete(keys.ready(0))  # Redis lost it: back within one refresh
    assert wait_for(lambda: sync_redis.exists(keys.ready(0)), 1) < 2 * launch.READY_REFRESH_S
    out["thread"].join(5)
    assert out["rc"] == 0
    assert wait_for(lambda: not sync_redis.exists(keys.ready(0)), 2) <= launch.READY_TTL_MS / 1000


def test_ready_key_comes_back_after_a_redis_restart(tmp_path, keys):
    server = RedisServer(data_dir=tmp_path).start()
    r = redis.Redis.from_url(server.url, socket_timeout=1, socket_connect_timeout=1)
    proc = subprocess.Popen(["sleep", "30"])
    try:
        out = keep_ready_in_thread(r, keys.ready(0), proc)
        wait_for(lambda: r.exists(keys.ready(0)), 2)
        server.stop()
        time.sleep(1.0)  # the launcher keeps going while Redis is away
        assert out["thread"].is_alive()
        server = RedisServer(port=server.port, data_dir=tmp_path).start()  # no persistence: the data is gone
        assert wait_for(lambda: r.exists(keys.ready(0)), 5) < 2
    finally:
        proc.kill()
        proc.wait()
        server.stop()
