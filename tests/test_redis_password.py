"""A Redis with ``requirepass``: the gateway's per-request path (the auto-pipelined admission script) and its pool
authenticate with the password in ``--redis-url``; a wrong one is refused."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
import redis
import redis.asyncio as aioredis

from flying.keys import Keys
from flying.procs import free_port
from flying.queue import RequestQueue
from flying.redis_conn import waiting_pool_client
from gateway.config import GatewayConfig
from gateway.waiting import autopipeline
from tests.test_queue import mk

PASSWORD = "s3cret-pw"


@pytest.fixture
def locked_redis(tmp_path):
    port = free_port()
    exe = shutil.which("redis-server")
    assert exe is not None, "redis-server is needed (scripts/setup.sh installs it)"
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--requirepass", PASSWORD, "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis(port=port, password=PASSWORD)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    yield port
    proc.terminate()
    proc.wait(10)


async def test_the_gateway_authenticates_with_the_password_in_its_redis_url(locked_redis):
    cfg = GatewayConfig(model_path="unused", redis_url=f"redis://:{PASSWORD}@127.0.0.1:{locked_redis}/0")
    client, keys = waiting_pool_client(cfg.redis_url, cfg.redis_max_connections, "test"), Keys("pw")
    pipe = autopipeline(client)
    assert pipe is not None
    try:
        q = RequestQueue(client, keys, pipe=pipe)
        assert await q.admit(mk("a")) is None  # through the auto-pipelined connection
        assert await q.depth() == 1  # through the pool
    finally:
        pipe.close()
        await client.aclose()
    wrong = aioredis.Redis.from_url(f"redis://:wrong@127.0.0.1:{locked_redis}/0")
    with pytest.raises(redis.AuthenticationError):
        await wrong.ping()
    await wrong.aclose()


async def test_the_gateway_and_router_clients_speak_tls_with_a_password(tmp_path):
    """``rediss://`` with the password and the CA in the URL: the gateway's pool (its per-request scripts go
    through it: the auto-pipelined connection does not speak TLS) and the router's client."""
    from router.config import RouterConfig
    from router.dispatcher import Dispatcher
    from tests.stack import announce_engine
    from tests.tls import tls_redis

    with tls_redis(tmp_path) as url:
        cfg = GatewayConfig(model_path="unused", redis_url=url)
        client, keys = waiting_pool_client(cfg.redis_url, cfg.redis_max_connections, "test"), Keys("tls")
        assert autopipeline(client) is None
        router_client = aioredis.Redis.from_url(url)
        try:
            announce_engine(redis.Redis.from_url(url), keys)
            assert await RequestQueue(client, keys).admit(mk("a")) is None
            assert await Dispatcher(RouterConfig(key_prefix=keys.prefix), router_client).round() == 1
            assert await client.hget(keys.request("a"), "state") == b"assigned"
        finally:
            await client.aclose()
            await router_client.aclose()
        plain = aioredis.Redis.from_url(url.replace("rediss://", "redis://").split("?")[0])
        with pytest.raises(redis.ConnectionError):
            await plain.ping()
        await plain.aclose()
        untrusted = aioredis.Redis.from_url(url.split("&ssl_ca_certs")[0])
        with pytest.raises(redis.ConnectionError, match="(?i)certificate"):
            await untrusted.ping()
        await untrusted.aclose()
