"""The gateway's background steps (a request's end recorded, an abort sent, a stream closed): spawned so that
the request's own path neither waits for them nor, when its client leaves, cancels them; a Redis error in one is
logged, not left unretrieved."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

import redis.asyncio as aioredis

log = logging.getLogger("flying.gateway")


class Background:
    """Holds the spawned steps until they end (the event loop keeps only weak references to tasks)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[None]] = set()

    def spawn(self, coro: Awaitable) -> None:
        task = asyncio.ensure_future(_logged(coro))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settle(self) -> None:
        """Wait for the steps spawned so far."""
        await asyncio.gather(*self._tasks)


async def _logged(coro: Awaitable) -> None:
    """A background step (finish, abort) that must not end in an unretrieved exception when Redis is away."""
    try:
        await coro
    except aioredis.RedisError as exc:
        log.warning("background step failed, redis unavailable: %r", exc)
