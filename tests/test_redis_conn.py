"""Redis URLs and Sentinel options (``flying.redis_conn``, ``flying.cli``), and against real servers a replica's
READONLY answer and the replica wait's group commit (``flying.autopipeline``)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from redis.exceptions import ConnectionError

from devstack.redis_server import RedisServer
from flying import cli, redis_conn
from flying.autopipeline import AutoPipeline
from flying.redis_conn import RedisUrlError, ReplicaWait, parse, with_sentinel


def test_a_plain_url_is_kept_and_waits_for_no_replica():
    t = parse("redis://:pw@10.0.0.1:6380/2")
    assert not t.sentinel and t.url == "redis://:pw@10.0.0.1:6380/2" and t.wait == ReplicaWait(0)
    assert t.describe() == "redis://10.0.0.1:6380/2"


def test_a_plain_url_may_ask_for_a_replica_wait_and_keeps_redis_py_options():
    t = parse("redis://h:1/0?socket_timeout=3&wait=1&wait_ms=20")
    assert t.url == "redis://h:1/0?socket_timeout=3" and t.wait == ReplicaWait(1, 20)


def test_a_sentinel_url_names_sentinels_master_db_and_credentials():
    t = parse("redis+sentinel://u:p%40ss@s1:26379,s2:26380,s3/prod/3")
    assert t.sentinels == (("s1", 26379), ("s2", 26380), ("s3", 26379))
    assert (t.master, t.db, t.username, t.password) == ("prod", 3, "u", "p@ss")
    assert t.wait == ReplicaWait(1, 100), "behind Sentinel the queue's writes wait for one replica by default"
    assert "p@ss" not in t.describe()
    assert parse("redis+sentinel://s1:1").master == redis_conn.DEFAULT_MASTER
    assert parse("redis+sentinel://s1:1/m/0?wait=0").wait.replicas == 0


@pytest.mark.parametrize(
    "url",
    ["127.0.0.1:6379", "redis+sentinel:///m/0", "redis+sentinel://h:x/m", "redis+sentinel://h:1/m/0/x",
     "redis+sentinel://h:1/m/0?bogus=1", "redis+sentinel://h:1/m/0?wait=-1"],
)  # fmt: skip
def test_unusable_urls_are_refused_with_a_reason(url):
    with pytest.raises(RedisUrlError):
        parse(url)


def test_sentinel_options_make_a_sentinel_url_with_the_plain_urls_db_and_password():
    assert with_sentinel("redis://:pw@127.0.0.1:6379/4", "a:1,b:2", "m") == "redis+sentinel://:pw@a:1,b:2/m/4"
    assert with_sentinel("redis://127.0.0.1:6379/0", "", "m") == "redis://127.0.0.1:6379/0"
    with pytest.raises(RedisUrlError):
        with_sentinel("redis+sentinel://a:1/m/0", "b:2")


def test_every_process_parser_takes_the_sentinel_flags():
    p = cli.parser("x", "x")
    cli.add_redis_arguments(p)
    a = p.parse_args(["--redis-sentinel", "h1:5000,h2:5001", "--redis-master-name", "prod"])
    assert cli.redis_url(a) == "redis+sentinel://h1:5000,h2:5001/prod/0"
    assert cli.redis_url(p.parse_args(["--redis-url", "redis://x:1/0"])) == "redis://x:1/0"
    with pytest.raises(SystemExit):
        cli.redis_url(p.parse_args(["--redis-url", "redis+sentinel://a:1/m/0", "--redis-sentinel", "b:2"]))


@pytest.mark.parametrize("url", ["http://x", "x:6379", "localhost"])
def test_a_url_that_is_not_redis_is_a_usage_error_in_words(url, capsys):
    p = cli.parser("x", "x")
    cli.add_redis_arguments(p)
    with pytest.raises(SystemExit) as exited:
        cli.redis_url(p.parse_args(["--redis-url", url]))
    assert exited.value.code == 2 and "is no Redis URL" in capsys.readouterr().err


def test_unreachable_sentinels_are_given_up_on_within_the_failover_window():
    """Nothing listens at the sentinel: redis-py's own retries nested inside ours made this take minutes."""
    client = redis_conn.sync_client("redis+sentinel://127.0.0.1:1/m/0")
    t0 = time.monotonic()
    with pytest.raises(redis.RedisError) as raised:
        client.ping()
    assert time.monotonic() - t0 < 15
    assert "no sentinel answered" in redis_conn.explain(raised.value)


def test_clients_remember_their_target():
    url = "redis+sentinel://127.0.0.1:1/m/0?wait=1&wait_ms=7"
    for client in (
        redis_conn.async_client(url),
        redis_conn.sync_client(url),
        redis_conn.async_pool_client(url, 4),
    ):
        assert redis_conn.target_of(client).wait == ReplicaWait(1, 7)
    assert redis_conn.target_of(redis_conn.sync_client("redis://127.0.0.1:1/0")).wait == ReplicaWait(0)


def test_the_wait_gate_skips_the_wait_for_a_while_once_too_few_replicas_answer():
    gate = redis_conn.WaitGate(ReplicaWait(1, 50))
    assert gate.wanted()
    gate.saw(1)
    assert gate.wanted()
    gate.saw(0)
    assert not gate.wanted()
    assert not redis_conn.WaitGate(ReplicaWait(0)).wanted()


@pytest.fixture
def primary_and_replica(tmp_path):
    primary = RedisServer(data_dir=tmp_path / "p").start()
    replica = RedisServer(data_dir=tmp_path / "r", replica_of=primary.port).start()
    yield primary, replica
    replica.stop()
    primary.stop()


@pytest.mark.slow
async def test_a_write_a_replica_refuses_closes_the_connection_as_lost(primary_and_replica):
    _, replica = primary_and_replica
    p = AutoPipeline(port=replica.port)
    with pytest.raises(ConnectionError, match="replica"):
        await p.execute("SET", "k", "v")
    assert p._protocol is not None and p._protocol.transport.is_closing()  # the next call connects again
    p.close()


@pytest.mark.slow
async def test_a_script_waits_for_the_replica_and_concurrent_writes_share_the_waits(primary_and_replica):
    primary, replica = primary_and_replica
    while b"master_link_status:up" not in await AutoPipeline(port=replica.port).execute(
        "INFO", "replication"
    ):
        await asyncio.sleep(0.05)
    p = AutoPipeline(port=primary.port)
    script = "return redis.call('INCR', KEYS[1])"
    assert await p.script(script, ["n"], [], wait=(1, 1000)) == (1, 1)
    replies = await asyncio.gather(*(p.script(script, ["n"], [], wait=(1, 1000)) for _ in range(200)))
    assert sorted(r[0] for r in replies) == list(range(2, 202)) and {r[1] for r in replies} == {1}
    replica.stop()
    await asyncio.sleep(0.2)
    t0 = time.monotonic()

    async def later(i: int):
        await asyncio.sleep(i * 0.01)  # arriving while a WAIT is in flight
        return await p.script(script, ["n"], [], wait=(1, 300))

    replies = await asyncio.gather(*(later(i) for i in range(50)))
    assert {r[1] for r in replies} == {0}
    assert time.monotonic() - t0 < 1.5, (
        "writes sent while a WAIT times out share its answer, not wait in turn"
    )
    p.close()


def test_the_gateway_router_and_worker_take_a_sentinel_set():
    from gateway import main as gateway_main
    from router import main as router_main
    from worker_ext import launch

    flags = ["--redis-sentinel", "127.0.0.1:26379,127.0.0.1:26380", "--redis-master-name", "prod"]
    url = "redis+sentinel://127.0.0.1:26379,127.0.0.1:26380/prod/0"
    assert gateway_main.parse_args(["--model-path", "m", *flags]).redis_url == url
    assert router_main.parse_args(flags).redis_url == url
    worker = launch.parser().parse_args(
        ["--engine", "0", "--num-engines", "1", "--model-path", "m", "--port", "1", *flags]
    )
    assert cli.redis_url(worker) == url


def test_a_client_behind_sentinel_retries_through_a_failover_whatever_retry_its_caller_asks():
    """The gateway asks for a short retry of its own; behind Sentinel every client waits out a failover instead
    (without it, requests got 503 while the sentinels promoted the replica)."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client = redis_conn.sync_client("redis+sentinel://127.0.0.1:1/m/0", retry=Retry(NoBackoff(), 0))
    assert client.connection_pool.connection_kwargs["retry"].get_retries() == redis_conn.FAILOVER_RETRIES
