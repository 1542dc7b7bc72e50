"""The auto-pipelined connection against a real redis-server: replies matched to callers, errors, scripts that
Redis forgot, cancelled callers, a database and client name from a redis-py pool, and a Redis restart."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError, ResponseError

from devstack.redis_server import RedisServer
from flying.autopipeline import AutoPipeline, pack


async def test_concurrent_calls_get_their_own_replies(redis_server, keys):
    p = AutoPipeline(port=redis_server.port)
    key = keys.prefix + ":n"
    replies = await asyncio.gather(*(p.execute("ECHO", f"m{i}") for i in range(300)))
    assert replies == [f"m{i}".encode() for i in range(300)]
    counts = await asyncio.gather(*(p.execute("INCR", key) for _ in range(100)))
    assert sorted(counts) == list(range(1, 101)) and counts == sorted(counts)  # in call order
    assert await p.execute("GET", key + ":none") is None
    assert await p.execute("HSET", key + ":h", "a", 1.5, "b", b"\x00\xff") == 2
    assert await p.execute("HMGET", key + ":h", "a", "b") == [b"1.5", b"\x00\xff"]
    p.close()


async def test_an_error_reply_fails_only_its_call(redis_server, keys):
    p = AutoPipeline(port=redis_server.port)
    key = keys.prefix + ":s"
    await p.execute("SET", key, "text")
    ok, bad, after = await asyncio.gather(
        p.execute("GET", key), p.execute("INCR", key), p.execute("ECHO", "x"), return_exceptions=True
    )
    assert ok == b"text" and after == b"x"
    assert isinstance(bad, ResponseError) and "not an integer" in str(bad)
    p.close()


async def test_a_script_is_loaded_again_when_redis_forgot_it(redis_server, keys, sync_redis):
    p = AutoPipeline(port=redis_server.port)
    source = "return {KEYS[1], tonumber(ARGV[1]) + 1}"
    assert await p.script(source, [keys.prefix], [41]) == [keys.prefix.encode(), 42]
    sync_redis.script_flush()
    assert await p.script(source, [keys.prefix], [1]) == [keys.prefix.encode(), 2]
    with pytest.raises(ResponseError, match="boom"):
        await p.script("return redis.error_reply('boom')", [], [])
    p.close()


async def test_a_cancelled_caller_leaves_the_replies_in_step(redis_server, keys):
    p = AutoPipeline(port=redis_server.port)
    slow = asyncio.ensure_future(p.execute("BLPOP", keys.prefix + ":empty", 0.3))
    await asyncio.sleep(0.05)
    slow.cancel()
    assert await p.execute("ECHO", "next") == b"next"  # BLPOP's nil reply went to no one
    p.close()


async def test_a_call_sent_nowait_goes_out_at_the_end_of_the_loop_turn(redis_server, keys, sync_redis):
    p = AutoPipeline(port=redis_server.port)
    key, source = keys.prefix + ":nowait", "return redis.call('INCR', KEYS[1])"
    assert await p.script(source, [key], []) == 1  # loaded: script_nowait can send it
    fut = p.script_nowait(source, [key], [])
    assert fut is not None
    assert (
        sync_redis.get(key) == b"1"
    )  # the rest of this step (a blocking read here) runs before it is written
    assert await fut == 2 and sync_redis.get(key) == b"2"
    p.close()


async def test_it_connects_like_a_redis_py_pool(redis_server, keys, sync_redis):
    client = aioredis.Redis(host="127.0.0.1", port=redis_server.port, db=3, client_name="flying-test")
    p = AutoPipeline.like(client.connection_pool.connection_kwargs)
    await p.execute("SET", keys.prefix + ":db3", "here")
    assert redis.Redis(port=redis_server.port, db=3).get(keys.prefix + ":db3") == b"here"
    assert sync_redis.get(keys.prefix + ":db3") is None
    assert await p.execute("CLIENT", "GETNAME") == b"flying-test"
    p.close()
    await client.aclose()


async def test_a_redis_restart_fails_the_calls_in_flight_and_then_serves_again(tmp_path):
    server = RedisServer(data_dir=tmp_path).start()
    p = AutoPipeline(port=server.port, connect_timeout_s=1)
    try:
        assert await p.execute("SET", "k", "1") == b"OK"
        waiting = asyncio.ensure_future(p.execute("BLPOP", "never", 5))
        await asyncio.sleep(0.1)
        server.stop()
        with pytest.raises(ConnectionError):
            await waiting
        with pytest.raises(ConnectionError, match="cannot connect"):
            await p.execute("PING")  # down: a clear error at once, no hang
        server.start()
        assert await p.execute("PING") == b"PONG"  # opened again by the next call
    finally:
        p.close()
        server.stop()


def test_pack_is_resp():
    assert pack(["SET", b"k", 3, 0.5]) == b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n3\r\n$3\r\n0.5\r\n"


async def test_a_password_is_sent_and_a_wrong_one_is_refused(tmp_path):
    server = RedisServer(data_dir=tmp_path).start()
    try:
        redis.Redis(port=server.port).config_set("requirepass", "s3cret")
        with pytest.raises(ResponseError, match="WRONGPASS|invalid password"):
            await AutoPipeline(port=server.port, password="wrong").execute("PING")
        p = AutoPipeline.like(
            aioredis.Redis(port=server.port, password="s3cret").connection_pool.connection_kwargs
        )
        assert await p.execute("PING") == b"PONG"
        p.close()
    finally:
        server.stop()
