"""Waiting for the router's assignment of a request: one pub/sub subscription per gateway, a future per request,
and a periodic look at the request hash in case a message was missed (e.g. across a Redis reconnect)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis

from flying.keys import Keys
from flying.messages import Assignment, decode

log = logging.getLogger("flying.gateway")


class AssignmentWaiter:
    def __init__(self, client: aioredis.Redis, keys: Keys, gateway_id: str) -> None:
        self.r = client
        self.keys = keys
        self.channel = keys.gateway_channel(gateway_id)
        self.pending: dict[str, asyncio.Future[Assignment]] = {}
        self._task: asyncio.Task | None = None
        self._pubsub = None

    async def start(self) -> None:
        self._pubsub = self.r.pubsub(ignore_subscribe_messages=True)
        await self._pubsub.subscribe(self.channel)
        self._task = asyncio.create_task(self._listen(), name="assignment-listener")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._pubsub:
            await self._pubsub.aclose()

    def expect(self, rid: str) -> asyncio.Future[Assignment]:
        """Register interest before admitting the request, so the assignment cannot race past us."""
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        return fut

    def forget(self, rid: str) -> None:
        fut = self.pending.pop(rid, None)
        if fut and not fut.done():
            fut.cancel()

    async def from_record(self, rid: str) -> Assignment | None:
        """The assignment as recorded in the request hash, if the request is assigned."""
        row = await self.r.hmget(self.keys.request(rid), ["state", "engine", "url", "queue_ms"])
        state, engine, url, queue_ms = (x.decode() if isinstance(x, bytes) else x for x in row)
        if state != "assigned" or url is None:
            return None
        return Assignment(id=rid, engine=int(engine), url=url, queue_ms=float(queue_ms or 0))

    async def _listen(self) -> None:
        while True:
            try:
                async for msg in self._pubsub.listen():
                    if msg.get("type") != "message":
                        continue
                    a = decode(msg["data"], Assignment)
                    fut = self.pending.pop(a.id, None)
                    if fut and not fut.done():
                        fut.set_result(a)
            except aioredis.RedisError as exc:
                log.warning("assignment subscription lost (%s); resubscribing", exc)
                await asyncio.sleep(0.5)
                with contextlib.suppress(aioredis.RedisError):
                    await self._pubsub.subscribe(self.channel)
