"""Waiting for the router's assignments, at a cost that does not grow with the queue: one pub/sub subscription per
gateway resolves a future per request, and one reconciliation every ``reconcile_s`` reads the state of all of this
gateway's waiting requests in a single round trip (one Lua call) in case a message was missed, e.g. across a
Redis reconnect. No request polls Redis on its own."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from flying.cancel import reraise_if_cancelled, stop_task
from flying.keys import Keys
from flying.messages import Assignment, decode
from flying.queue import RequestQueue

log = logging.getLogger("flying.gateway")


class AssignmentWaiter:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        gateway_id: str,
        reconcile_s: float = 2.0,
        on_missing: Callable[[list[str]], Awaitable[None]] | None = None,
    ) -> None:
        self.r = client
        self.keys = keys
        self.queue = RequestQueue(client, keys)
        self.channel = keys.gateway_channel(gateway_id)
        self.reconcile_s = reconcile_s
        self.on_missing = on_missing  # called with admitted requests whose record Redis no longer has
        self.pending: dict[str, asyncio.Future[Assignment]] = {}
        self.admitted: set[str] = set()  # pending ids known to be in Redis (so a missing record means lost)
        self.reconciled = 0  # assignments found by reconciliation rather than by message
        self._tasks: list[asyncio.Task] = []
        self._pubsub = self.r.pubsub(ignore_subscribe_messages=True)  # connects at its first subscribe
        self._stopping = False

    async def start(self) -> None:
        await self._pubsub.subscribe(self.channel)
        self._tasks = [
            asyncio.create_task(self._listen(), name="assignment-listener"),
            asyncio.create_task(self._reconcile_loop(), name="assignment-reconciler"),
        ]

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            if not await stop_task(task):
                log.warning("%s did not end when cancelled; left behind", task.get_name())
        if self._pubsub:
            with contextlib.suppress(aioredis.RedisError):
                await self._pubsub.aclose()

    def expect(self, rid: str) -> asyncio.Future[Assignment]:
        """Register interest before admitting the request, so the assignment cannot race past us."""
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        self.admitted.discard(rid)
        return fut

    def expects(self, rid: str) -> bool:
        """Whether a request of this gateway waits under ``rid`` already."""
        return rid in self.pending

    def mark_admitted(self, rid: str) -> None:
        if rid in self.pending:
            self.admitted.add(rid)

    def forget(self, rid: str) -> None:
        self.admitted.discard(rid)
        fut = self.pending.pop(rid, None)
        if fut and not fut.done():
            fut.cancel()

    def resolve(self, a: Assignment) -> None:
        self.admitted.discard(a.id)
        fut = self.pending.pop(a.id, None)
        if fut and not fut.done():
            fut.set_result(a)

    def fail_all(self, make_error: Callable[[], BaseException]) -> int:
        """End every waiting request with ``make_error()`` (e.g. no live engine for too long)."""
        n = 0
        for rid in list(self.pending):
            fut = self.pending.pop(rid)
            self.admitted.discard(rid)
            if not fut.done():
                fut.set_exception(make_error())
                n += 1
        return n

    async def reconcile(self) -> int:
        """One round trip over every admitted, waiting request: resolve those already assigned (a missed
        message), hand those whose record is gone to ``on_missing``. Returns how many were resolved."""
        rids = [rid for rid in self.pending if rid in self.admitted]
        assigned, missing = await self.queue.assigned_or_missing(rids)
        for a in assigned:
            self.resolve(a)
        self.reconciled += len(assigned)
        missing = [rid for rid in missing if rid in self.admitted]
        if missing and self.on_missing is not None:
            await self.on_missing(missing)
        return len(assigned)

    async def _reconcile_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.reconcile_s)
            try:
                if n := await self.reconcile():
                    log.info("reconciliation found %d assignments whose message was missed", n)
            except aioredis.RedisError as exc:
                reraise_if_cancelled()
                log.warning("reconciliation failed: %r", exc)
            except Exception:  # noqa: BLE001 - the loop must outlive any one round
                reraise_if_cancelled()
                log.exception("reconciliation round failed")

    async def _listen(self) -> None:
        """Relay messages to futures; when the connection breaks, subscribe again on a fresh connection (with
        backoff while Redis is away), then reconcile: messages published meanwhile are gone."""
        backoff = 0.1
        while not self._stopping:
            try:
                async for msg in self._pubsub.listen():
                    backoff = 0.1
                    if msg.get("type") == "message":
                        self.resolve(decode(msg["data"], Assignment))
                raise aioredis.ConnectionError("subscription ended")
            except aioredis.RedisError as exc:
                reraise_if_cancelled()
                log.warning("assignment subscription lost (%r); resubscribing in %.1f s", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                with contextlib.suppress(aioredis.RedisError):
                    await self._pubsub.aclose()
                self._pubsub = self.r.pubsub(ignore_subscribe_messages=True)
                with contextlib.suppress(aioredis.RedisError):
                    await self._pubsub.subscribe(self.channel)
                    await self.reconcile()
