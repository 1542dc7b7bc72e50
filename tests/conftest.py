"""Shared fixtures: a real redis-server per session (fresh key prefix per test), the tiny model; the test tiers.

Two tiers: ``pytest -m "not e2e"`` is the fast tier (unit and Redis-level tests, run before each commit) and plain
``pytest`` the full suite (what CI runs). A test that needs SGLang workers is marked ``e2e``; a unit or Redis-level
test that takes seconds is marked ``slow``, which adds ``e2e``, so the fast tier leaves both out."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from devstack.redis_server import RedisServer
from flying.keys import Keys

ROOT = Path(__file__).resolve().parents[1]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.e2e)


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
