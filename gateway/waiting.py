"""A gateway's requests in the global queue (Redis), from admission to their end: admitted within the
backpressure limits for their priority (else 429), waited for until the router assigns them or their class's wait
budget runs out (504; no Redis call per waiting request: :mod:`gateway.assignments`), put back when their engine fails before answering (within
``max_attempts``), their end recorded (retried through a Redis outage), and admitted again if Redis lost them
while they waited."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from typing import Any

import redis.asyncio as aioredis

from flying import crashes, redis_conn
from flying.autopipeline import AutoPipeline
from flying.breaker import Breakers
from flying.cancel import reraise_if_cancelled
from flying.crashes import Blame
from flying.keys import Keys
from flying.messages import GROUP_LEADER_ONLY, Assignment, Priority, QueuedRequest
from flying.queue import DuplicateId, QueueFull, RequestQueue, TenantLimit, TenantLimited
from gateway import tenants
from gateway.admission import Admitted
from gateway.api.errors import PoisonRequest, QueueFullError, QueueTimeout, WorkerFailed
from gateway.assignments import AssignmentWaiter
from gateway.background import Background
from gateway.backpressure import Backpressure, Limits
from gateway.config import GatewayConfig
from gateway.http.disconnect import ClientGone
from gateway.metrics import GatewayMetrics
from gateway.observer import NOTHING, Observer
from gateway.tenants import Tenant

POISON_DEATHS = 2  # engines that may die holding one request: the second's death ends it
log = logging.getLogger("flying.gateway")
PRIORITIES: tuple[Priority, ...] = ("high", "normal", "low")
FINISH_RETRY_S = 300.0  # how long a request's end is retried while Redis is away


class WaitingRoom:
    """Owns this gateway's waiting requests: the futures of their assignments (``waiter``) and, for those Redis
    may lose, their records (``holding``, to admit them again)."""

    def __init__(
        self,
        config: GatewayConfig,
        client: aioredis.Redis,
        keys: Keys,
        metrics: GatewayMetrics,
        background: Background,
        observer: Observer = NOTHING,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.background = background
        self.observer = observer
        self.queue = RequestQueue(client, keys, pipe=autopipeline(client), on_finish=observer.finished)
        self.waiter = AssignmentWaiter(
            client, keys, config.gateway_id, config.reconcile_s, on_missing=self.readmit, metrics=metrics
        )
        budgets = {p: config.wait_budget_s(p) for p in PRIORITIES}
        self.backpressure = Backpressure(config.max_queue, {p: b for p, b in budgets.items() if b})
        self.breakers = Breakers(client, keys, config.breaker)
        self.holding: dict[
            str, QueuedRequest
        ] = {}  # waiting requests' records, to re-admit if Redis lost them
        self.readmitted = 0

    async def enqueue(self, adm: Admitted, sent_to: int | None = None) -> asyncio.Future[Assignment]:
        """Admit to the global queue, within the backpressure limits for its priority (else 429). ``sent_to``: the
        engine it went to early (gateway.early_dispatch): assigned there, else EarlyDeclined."""
        rid, rec = adm.record.id, adm.record
        limits = self.backpressure.limits(rec.priority)
        if limits.full:  # the engines' backlog alone is beyond the class's budget: no need to ask the queue
            raise self._refusal(rec.priority, QueueFull("the engines' backlog", "wait", 0), limits)
        if self.waiter.expects(rid):  # (a client's id, reused while its first request waits here)
            raise DuplicateId(f"a request with id {rid} waits at this gateway already")
        tenant = tenants.current.get()
        charge = tenant.charge(rec.prompt_tokens + rec.max_tokens) if tenant is not None else None
        fut = self.waiter.expect(rid)
        try:
            fast = await self.queue.admit(rec, limits.max_depth, limits.max_ahead, charge, sent_to)
        except QueueFull as exc:
            self.waiter.forget(rid)
            raise self._refusal(rec.priority, exc, limits) from None
        except TenantLimited as exc:
            self.waiter.forget(rid)
            raise self._tenant_refusal(tenant, exc) from None
        except BaseException:
            self.waiter.forget(rid)
            raise
        if tenant is not None:
            self.metrics.child(self.metrics.tenant_requests, tenant.name).inc()
            self.metrics.child(self.metrics.tenant_tokens, tenant.name).inc(
                rec.prompt_tokens + rec.max_tokens
            )
        if fast is not None:  # assigned at admission (the queue was empty): no wait for the router's round
            self.backpressure.handed_to_engine()
            self.metrics.assignments.labels("admission").inc()
            self.waiter.resolve(fast)
            return fut
        self.waiter.mark_admitted(rid)
        self.holding[rid] = adm.record
        return fut

    def _refusal(self, priority: Priority, exc: QueueFull, limits: Limits) -> QueueFullError:
        """The 429 for a refused admission: the queue's share for the class is full, or the predicted wait is
        beyond the class's budget."""
        bp = self.backpressure
        if exc.reason == "depth":
            retry = bp.retry_after_s(exc.count - limits.max_depth + 1)
            why = f"the queue is full for {priority} priority ({exc.count} waiting)"
        else:
            retry = bp.wait_retry_after_s(priority, exc.count)
            wait = bp.predicted_wait_s(priority, exc.count) or 0.0
            why = (
                f"the predicted queue wait ({wait:.1f} s, {exc.count + bp.behind(priority)} requests ahead) exceeds {priority} "
                f"priority's budget of {bp.budgets[priority]:g} s"
            )
        self.metrics.child(self.metrics.refused, priority, exc.reason).inc()
        return QueueFullError(f"{why}; retry after {retry} s", retry_after_s=retry)

    def _tenant_refusal(self, tenant: Tenant | None, exc: TenantLimited) -> QueueFullError:
        """The 429 for a request over its tenant's requests/s or tokens/min."""
        assert tenant is not None, "only a tenant's request is charged"
        self.metrics.tenant_rejected.labels(tenant.name, exc.limit.value).inc()
        retry = max(1, math.ceil(exc.retry_after_s))
        value = tenant.requests_per_s if exc.limit is TenantLimit.REQUESTS_PER_S else tenant.tokens_per_min
        return QueueFullError(
            f"tenant {tenant.name} is over its {exc.limit.value} limit ({value:g}); retry after {retry} s",
            retry_after_s=retry,
        )

    async def readmit(self, rids: list[str]) -> None:
        """Redis lost these waiting requests (a restart without persistence, or with the last second of AOF
        lost): admit them again, beyond the backpressure limits (they were accepted), so the router serves
        them."""
        for rid in rids:
            if (record := self.holding.get(rid)) is None:
                continue
            with contextlib.suppress(QueueFull, DuplicateId):  # DuplicateId: its record is back already
                await self.queue.admit(record)
            self.readmitted += 1
        log.warning("re-admitted %d waiting requests that Redis had lost", len(rids))

    async def wait_assignment(
        self, adm: Admitted, fut: asyncio.Future[Assignment], disconnected: asyncio.Future[None]
    ) -> Assignment:
        """The assignment (from the subscription or the reconciliation); no Redis call of its own while it
        waits, at most its class's wait budget (``GatewayConfig.queue_wait_s``). Raises ClientGone, QueueTimeout
        (the budget ran out), or NoLiveWorkers (set on the future by the monitor)."""
        try:
            a = await self._wait(adm, fut, disconnected)
        except BaseException as exc:
            self.observer.wait_failed(adm.record, exc)
            raise
        self.observer.assigned(adm.record, a)
        return a

    async def _wait(
        self, adm: Admitted, fut: asyncio.Future[Assignment], disconnected: asyncio.Future[None]
    ) -> Assignment:
        rid = adm.record.id
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            self.holding.pop(rid, None)  # the fast path: assigned at admission
            return fut.result()
        limit = max(self.config.queue_wait_s(adm.record.priority), adm.patience_s)
        try:
            waits: set[asyncio.Future[Any]] = {fut, disconnected}
            done, _ = await asyncio.wait(waits, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
            if fut in done:
                self.holding.pop(rid, None)
                return fut.result()
            if disconnected in done:
                raise ClientGone(rid)
            self.metrics.child(self.metrics.expired, adm.record.priority).inc()
            raise QueueTimeout(f"request was not scheduled within {limit:g} s")
        except BaseException:
            self.holding.pop(rid, None)
            self.waiter.forget(rid)
            try:
                await self.queue.finish(rid, "cancelled", "not scheduled")
            except aioredis.RedisError:  # Redis away: retried in the background until it is back
                self.background.spawn(self.finish_surely(rid, "cancelled", "not scheduled"))
            raise

    async def retry_or_fail(
        self,
        adm: Admitted,
        a: Assignment,
        why: str,
        cause: str = "before_first_event",
        engine_fault: bool = True,
        counted: bool = True,
        died: bool = False,
    ) -> asyncio.Future[Assignment]:
        """The engine failed before answering: re-queue the request (within ``max_attempts``) or fail it.
        ``engine_fault`` False: the engine is fine (its group lost a member), its breaker does not count it;
        ``counted`` False: nothing failed (its group was parked), not counted toward ``max_attempts``; ``died``: the
        engine died holding it: ended if the engine's crash report says it crashed it, or at a second such death
        (:meth:`suspect`)."""
        self.observer.requeued(adm.record, why)
        if engine_fault:
            self.engine_failed(a.engine, why)
        ran = adm.engine_rids()  # (the attempt that failed: the next one's rids are set below)
        blame = await self.suspect(adm, a, why) if died and engine_fault and counted else None
        rec = await self.queue.get(adm.record.id)
        attempts = int(rec.get("attempts", 0)) + 1  # (every re-dispatch: its SGLang rid's suffix)
        used = attempts - int(rec.get("parked_attempts", 0))
        # a follower could not run it: from now on, leaders only
        leader_only = GROUP_LEADER_ONLY.message in why
        if leader_only:
            cause = "leader_only"
        elif not counted:
            cause = "group_parked"
        elif used >= self.config.max_attempts:
            await self.queue.finish(adm.record.id, "failed", why)
            raise WorkerFailed(f"engine {a.engine} failed and {used} attempts are used up: {why}")
        adm.next_attempt(attempts)
        await asyncio.sleep(self.redispatch_delay_s(attempts))
        if blame is Blame.UNKNOWN:
            # a crash report that landed after the engine's connection broke still keeps it from a second engine
            await self.crashed(adm, a, await self.blame(a, ran))
        log.warning(
            "request %s: engine %d unavailable (%s); re-queueing",
            adm.record.id,
            a.engine,
            why,
            extra={"request_id": adm.record.id},
        )
        self.metrics.redispatched.labels(cause).inc()
        fut = self.waiter.expect(adm.record.id)
        await self.queue.requeue(adm.record, a.engine, why, counted=counted, leader_only=leader_only)
        self.waiter.mark_admitted(adm.record.id)
        self.holding[adm.record.id] = adm.record
        return fut

    async def suspect(self, adm: Admitted, a: Assignment, why: str) -> Blame:
        """The engine that held ``adm`` died. If its crash report (:mod:`flying.crashes`) says ``adm`` crashed it,
        ``adm`` is not tried again (:meth:`crashed`); if the report clears it, it is re-dispatched as any other
        request. Else the death is counted, and at the :data:`POISON_DEATHS`-th it is not tried again either (the
        router gave it an engine holding no other suspect request, so it is the likely cause). Returns the
        report's blame."""
        rid = adm.record.id
        blame = await self.blame(a, adm.engine_rids())
        await self.crashed(adm, a, blame)
        if blame is Blame.CLEARED:
            return blame
        if await self.queue.mark_suspect(rid) < POISON_DEATHS:
            return blame
        error = f"engines died twice while running this request (the last: engine {a.engine}, {why})"
        self.metrics.poison.inc()
        await self._end_poison(rid, error)
        raise PoisonRequest(
            f"engine {a.engine} died running this request, as another engine had before: it is not tried on a third"
        )

    async def blame(self, a: Assignment, rids: list[str]) -> Blame:
        """What the crash report of ``a``'s engine says of the attempt it ran under ``rids`` (UNKNOWN: Redis did
        not say)."""
        try:
            report = await crashes.read(self.queue.r, self.queue.keys, a.engine)
        except aioredis.RedisError as exc:
            reraise_if_cancelled()
            log.warning("engine %d: crash report not read (%r)", a.engine, exc)
            return Blame.UNKNOWN
        return crashes.blame(report, rids)

    async def crashed(self, adm: Admitted, a: Assignment, blame: Blame) -> None:
        """``blame`` CAUSE: the engine's crashing batch held ``adm`` alone, so it crashed the engine: ended in
        Redis, logged, counted and answered with a 500 (PoisonRequest), not tried on another engine."""
        if blame is not Blame.CAUSE:
            return
        error = f"engine {a.engine} crashed running this request alone (its crash report names it)"
        self.metrics.poison.inc()
        await self._end_poison(adm.record.id, error)
        raise PoisonRequest(f"engine {a.engine} crashed running this request: it is not tried on another")

    async def _end_poison(self, rid: str, error: str) -> None:
        await self.queue.finish(rid, "failed", error)
        log.error("request %s: %s; not tried again", rid, error, extra={"request_id": rid})

    def redispatch_delay_s(self, attempt: int) -> float:
        """The jittered back-off before the ``attempt``-th re-dispatch (1: the first): a random 50-100 % of
        ``redispatch_backoff_s * 2^(attempt-1)``, at most ``redispatch_backoff_max_s`` (requests that failed
        together do not all come back at once)."""
        c = self.config
        full = min(c.redispatch_backoff_max_s, c.redispatch_backoff_s * 2 ** max(0, attempt - 1))
        return full * random.uniform(0.5, 1.0)

    def engine_failed(self, engine: int, why: str) -> None:
        """Count a failed request against ``engine``'s circuit breaker (in the background: the request's path
        does not wait for it)."""
        self.metrics.child(self.metrics.engine_failures, str(engine)).inc()
        self.background.spawn(self._record_failure(engine, why))

    async def _record_failure(self, engine: int, why: str) -> None:
        try:
            tripped = await self.breakers.failure(engine, time.time(), why)
        except aioredis.RedisError as exc:
            reraise_if_cancelled()
            log.warning("engine %d: failure not recorded in its circuit breaker (redis: %r)", engine, exc)
            return
        if tripped:
            log.warning("engine %d: circuit breaker open after repeated failures (last: %s)", engine, why)

    def finish_soon(self, rid: str, state: str, error: str = "") -> None:
        """:meth:`finish_surely` in the background, without a task while Redis answers: the script is sent at the
        end of this loop turn (a non-streaming answer is written first) and its reply checked by a callback; a failed one (Redis away, a script it forgot) or a connection not yet
        open spawns ``finish_surely``."""
        fut = self.queue.finish_nowait(rid, state, error)
        if fut is None:
            self.background.spawn(self.finish_surely(rid, state, error))
            return
        fut.add_done_callback(lambda f: self._finished(f, rid, state, error))

    def _finished(self, fut: asyncio.Future[Any], rid: str, state: str, error: str) -> None:
        if fut.cancelled() or fut.exception() is not None:
            self.background.spawn(self.finish_surely(rid, state, error))

    async def finish_surely(self, rid: str, state: str, error: str = "") -> None:
        """``queue.finish``, retried while Redis is away (up to FINISH_RETRY_S): a finish lost to an outage would
        leave the record ``assigned`` and its engine's inflight slot taken for good."""
        delay, deadline = 0.1, time.monotonic() + FINISH_RETRY_S
        while True:
            try:
                await self.queue.finish(rid, state, error)
                return
            except aioredis.RedisError as exc:
                reraise_if_cancelled()
                if time.monotonic() > deadline:
                    log.error(
                        "request %s: could not record its end (%s) for %.0f s: %r",
                        rid,
                        state,
                        FINISH_RETRY_S,
                        exc,
                    )
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)


def autopipeline(client: aioredis.Redis) -> AutoPipeline | None:
    """An auto-pipelined connection to the client's Redis for the per-request scripts (none for TLS, which it
    does not speak: those go through the client's pool)."""
    return redis_conn.autopipeline(client)
