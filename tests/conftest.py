"""Shared fixtures: a real redis-server per session (fresh key prefix per test), the tiny model."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from devstack.redis_server import RedisServer
from flying.keys import Keys

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def keys() -> Keys:
    return Keys(f"t{uuid.uuid4().hex[:8]}")


@pytest.fixture
def sync_redis(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
async def aredis(redis_server):
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from worker_ext.tinymodel import ensure

    return ensure(ROOT / ".flying" / "test-model", seed=0)
