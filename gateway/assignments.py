"""Waiting for the router's assignments, at a cost that does not grow with the queue: one pub/sub subscription per
gateway resolves a future per request, and one reconciliation every ``reconcile_s`` reads the state of all of this
gateway's waiting requests in a single round trip (one Lua call) in case a message was missed, e.g. across a
Redis reconnect. No request polls Redis on its own.

The reconciliation also watches the subscription: a listener task that ended, or a channel Redis counts no
subscriber on, is a subscription lost without an error to say so (the waits would then go at one reconciliation
per ``reconcile_s``); it is reported and subscribed again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import msgspec
import redis.asyncio as aioredis

from flying.cancel import reraise_if_cancelled, stop_task
from flying.keys import Keys
from flying.messages import Assignment, decode
from flying.queue import RequestQueue
from gateway.metrics import GatewayMetrics

log = logging.getLogger("flying.gateway")


class AssignmentWaiter:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        gateway_id: str,
        reconcile_s: float = 2.0,
        on_missing: Callable[[list[str]], Awaitable[None]] | None = None,
        metrics: GatewayMetrics | None = None,
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
        self.resubscribed = 0  # subscriptions found lost by the reconciliation and made again
        self.metrics = metrics or GatewayMetrics()
        self._by_message = self.metrics.assignments.labels("message")
        self._pubsub: aioredis.client.PubSub | None = None
        self._listener: asyncio.Task[None] | None = None
        self._reconciler: asyncio.Task[None] | None = None
        self._reconcile_now = asyncio.Event()  # set when messages may have been missed (a new subscription)
        self._stopping = False

    async def start(self) -> None:
        """Subscribe (before the gateway admits anything, so no assignment can be published unheard), then
        listen and reconcile in the background."""
        await self._subscribe()
        self._listener = asyncio.create_task(self._listen(), name="assignment-listener")
        self._reconciler = asyncio.create_task(self._reconcile_loop(), name="assignment-reconciler")

    async def stop(self) -> None:
        self._stopping = True
        for task in (self._listener, self._reconciler):
            if not await stop_task(task):
                log.warning("%s did not end when cancelled; left behind", task.get_name() if task else "")
        await self._drop_pubsub()

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

    def resolve(self, a: Assignment) -> bool:
        """End ``a.id``'s wait with ``a``; whether one was waiting."""
        self.admitted.discard(a.id)
        fut = self.pending.pop(a.id, None)
        if fut and not fut.done():
            fut.set_result(a)
            return True
        return False

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
        if assigned:
            self.metrics.assignments.labels("reconciliation").inc(len(assigned))
        missing = [rid for rid in missing if rid in self.admitted]
        if missing and self.on_missing is not None:
            await self.on_missing(missing)
        return len(assigned)

    async def check_subscription(self) -> bool:
        """True if the subscription is live: the listener runs and Redis counts a subscriber on the channel.
        Otherwise report why, subscribe again on a fresh connection and return False."""
        if self._listener is not None and self._listener.done():
            exc = None if self._listener.cancelled() else self._listener.exception()
            why = f"the listener ended ({exc!r})"
        else:
            [(_, subscribers)] = await self.r.pubsub_numsub(self.channel)
            if subscribers:
                return True
            why = "Redis counts no subscriber on the channel"
        log.error("assignment subscription lost: %s; subscribing again", why)
        self.resubscribed += 1
        self.metrics.subscription_lost.inc()
        if not await stop_task(self._listener):
            log.warning("assignment-listener did not end when cancelled; left behind")
        await self._drop_pubsub()
        try:
            await self._subscribe()  # here, so that the next check sees it (else the new listener subscribes)
        finally:
            self._listener = asyncio.create_task(self._listen(), name="assignment-listener")
            self._reconcile_now.set()  # what was published while unheard: at once, not a period later
        return False

    async def _reconcile_loop(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reconcile_now.wait(), self.reconcile_s)
            self._reconcile_now.clear()
            try:  # bounded: a round that hung would leave a lost subscription unnoticed
                await asyncio.wait_for(self._round(), max(10.0, 5 * self.reconcile_s))
            except TimeoutError:
                reraise_if_cancelled()
                log.error(
                    "a reconciliation round took over %.0f s; abandoned", max(10.0, 5 * self.reconcile_s)
                )
            except aioredis.RedisError as exc:
                reraise_if_cancelled()
                log.warning("reconciliation failed: %r", exc)
            except Exception:  # noqa: BLE001 - the loop must outlive any one round
                reraise_if_cancelled()
                log.exception("reconciliation round failed")

    async def _round(self) -> None:
        if n := await self.reconcile():
            log.info("reconciliation found %d assignments whose message was missed", n)
        await self.check_subscription()

    async def _subscribe(self) -> aioredis.client.PubSub:
        pubsub = self.r.pubsub(ignore_subscribe_messages=True)  # connects at its first subscribe
        try:
            await pubsub.subscribe(self.channel)
        except BaseException:
            with contextlib.suppress(aioredis.RedisError, RuntimeError):
                await pubsub.aclose()
            raise
        self._pubsub = pubsub
        return pubsub

    async def _drop_pubsub(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(aioredis.RedisError, RuntimeError):
                await pubsub.aclose()

    async def _listen(self) -> None:
        """Relay messages to futures. When the subscription breaks (or anything else goes wrong), subscribe
        again on a fresh connection, with backoff while Redis is away, and have the reconciliation run at once:
        messages published meanwhile are gone. Nothing here waits on anything but Redis."""
        backoff = 0.1
        while not self._stopping:
            try:
                pubsub = self._pubsub
                if pubsub is None:
                    pubsub = await self._subscribe()
                    self._reconcile_now.set()
                async for msg in pubsub.listen():
                    backoff = 0.1
                    if msg.get("type") == "message":
                        self._deliver(msg["data"])
                raise aioredis.ConnectionError("subscription ended")
            except Exception as exc:  # noqa: BLE001 - the listener must outlive any one failure
                reraise_if_cancelled()
                if isinstance(exc, aioredis.RedisError):
                    log.warning("assignment subscription lost (%r); resubscribing in %.1f s", exc, backoff)
                else:
                    log.exception("assignment listener failed; resubscribing in %.1f s", backoff)
                await self._drop_pubsub()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    def _deliver(self, data: bytes) -> None:
        try:
            a = decode(data, Assignment)
        except msgspec.DecodeError as exc:  # (ValidationError included) not ours, or another version's
            log.warning("ignored a message on %s that is not an assignment: %s", self.channel, exc)
            return
        if self.resolve(a):
            self._by_message.inc()
