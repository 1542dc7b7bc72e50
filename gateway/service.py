"""The gateway's request path: validate -> admit to the Redis queue -> await the router's assignment ->
forward to the engine (re-dispatched if it fails before answering) -> stream back (resumed elsewhere if it fails
mid-stream). :class:`Gateway` composes the pieces: the cluster view (:mod:`gateway.cluster_view`), admission
(:mod:`gateway.admission`), the waiting room (:mod:`gateway.waiting`) and the relay (:mod:`gateway.relay`);
:meth:`Gateway.serve` is the whole path after validation, and a monitor keeps the cluster view fresh. HTTP
framing lives in :mod:`gateway.app`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from flying.cancel import reraise_if_cancelled, stop_task
from flying.keys import Keys
from flying.messages import Assignment
from flying.queue import DuplicateId, EarlyDeclined
from gateway.admission import Admission, Admitted
from gateway.api import engine_fields
from gateway.api.errors import NoLiveWorkers, NoRouter, QueueFullError
from gateway.background import Background
from gateway.cluster_view import ClusterView
from gateway.config import GatewayConfig
from gateway.early_dispatch import Early, EarlyDispatch
from gateway.http.disconnect import ClientGone
from gateway.http.upstream import Upstream, WorkerUnavailable
from gateway.metrics import GatewayMetrics
from gateway.observer import NOTHING, Observer
from gateway.relay import DONE, Relay
from gateway.waiting import WaitingRoom

__all__ = ["DONE", "Admitted", "ClientGone", "Gateway", "Reply"]

log = logging.getLogger("flying.gateway")


@dataclass(frozen=True)
class Reply:
    """What a request is answered with: a JSON ``body``, an engine's error bytes (``raw``), or an SSE ``stream``;
    ``assignment`` names the engine that served it (response headers)."""

    status: int
    assignment: Assignment
    body: dict | None = None
    raw: bytes | None = None
    stream: AsyncGenerator[bytes, None] | None = None
    unstarted: Callable[[], None] | None = None  # a stream never started (its client left at once): clean up


class Gateway:
    """One gateway process's service: ``cluster`` (what the deployment can serve), ``admission`` (requests
    validated into :class:`Admitted`), ``waiting`` (their place in the global queue) and ``relay`` (the engines'
    answers brought back). ``admit``, ``enqueue``, ``wait_assignment`` and ``finish_surely`` are those objects'
    own methods."""

    def __init__(
        self,
        config: GatewayConfig,
        client: aioredis.Redis,
        count_tokens,
        metrics: GatewayMetrics | None = None,
        observer: Observer = NOTHING,
    ) -> None:
        self.config = config
        self.metrics = metrics or GatewayMetrics()
        self.started = time.time()  # the model card's "created"
        self.keys = Keys(config.key_prefix)
        self.r = client
        self.background = Background()
        self.cluster = ClusterView(client, self.keys, config)
        self.admission = Admission(config, self.cluster, count_tokens, self.metrics, observer)
        self.waiting = WaitingRoom(config, client, self.keys, self.metrics, self.background, observer)
        self.upstream = Upstream(config.request_timeout_s, observer)
        self.relay = Relay(self.upstream, self.waiting, self.background, config.raw_engine_fields)
        self.early = EarlyDispatch(
            self.cluster,
            self.upstream,
            self.background,
            self.metrics,
            config.early_dispatch,
            observer=observer,
        )
        self.queue, self.waiter = self.waiting.queue, self.waiting.waiter
        self.admit = self.admission.admit
        self.enqueue = self.waiting.enqueue
        self.wait_assignment = self.waiting.wait_assignment
        self.finish_surely = self.waiting.finish_surely
        self._monitor: asyncio.Task | None = None
        self._stopping = False

    @property
    def readmitted(self) -> int:
        """Waiting requests admitted again after Redis lost them."""
        return self.waiting.readmitted

    async def start(self) -> None:
        await self.cluster.announce()
        await self.waiter.start()
        self._monitor = asyncio.create_task(self._watch(), name="gateway-monitor")

    async def stop(self) -> None:
        self._stopping = True
        if not await stop_task(self._monitor):
            log.warning("the gateway monitor did not end when cancelled; left behind")
        await self.waiter.stop()
        await self.upstream.close()
        if self.queue.pipe is not None:
            self.queue.pipe.close()
        with contextlib.suppress(aioredis.RedisError):
            await self.r.delete(self.keys.gateway(self.config.gateway_id))

    # -- the monitor -------------------------------------------------------------------------------------------
    async def _watch(self) -> None:
        """Once per ``monitor_s``, whatever the load: refresh the cluster view, sample the service rate, and end
        the waiting requests when no engine has been live for ``no_worker_grace_s`` or no router has held the lease
        for ``no_router_grace_s`` (503 with Retry-After, as new requests then get, rather than a 504 at the end of
        the wait budget)."""
        while not self._stopping:
            try:
                await self.observe()
            except aioredis.RedisError as exc:
                reraise_if_cancelled()
                log.warning("cluster view: redis unavailable (%r)", exc)
            await asyncio.sleep(self.config.monitor_s)

    async def observe(self) -> None:
        tick = await self.cluster.observe()
        self.waiting.backpressure.observe(tick)
        grace = self.config.no_worker_grace_s
        if self.cluster.no_workers_for(tick.now) > grace and self.waiter.pending:
            n = self.waiter.fail_all(
                lambda: NoLiveWorkers(f"no live workers for {grace:.0f} s; request dropped")
            )
            log.warning("no live workers for %.0f s: %d waiting requests ended with 503", grace, n)
        elif self.cluster.router_missing() and self.waiter.pending:
            grace = self.config.no_router_grace_s
            n = self.waiter.fail_all(
                lambda: NoRouter(
                    f"no router has dispatched for {grace:.0f} s (none holds the lease); try again later"
                )
            )
            log.warning("no router for %.0f s: %d waiting requests ended with 503", grace, n)

    # -- the request's path ----------------------------------------------------------------------------------
    def _send_early(self, adm: Admitted) -> Early | None:
        """``adm`` sent to an engine before its admission, where the queue would assign it at once
        (:mod:`gateway.early_dispatch`); not when its class's backlog alone refuses it."""
        if self.waiting.backpressure.limits(adm.record.priority).full:
            return None
        if adm.stream:
            return self.early.send(adm.record, lambda url: self.upstream.open_stream(url, adm.path, adm.body))
        return self.early.send(adm.record, lambda url: self.upstream.post(url, adm.path, adm.body))

    async def serve(
        self,
        adm: Admitted,
        disconnected: asyncio.Future[None],
        early: bool = True,
        assigned: Callable[[Assignment], None] | None = None,
    ) -> Reply:
        """Queue ``adm``, wait for its assignment and forward it; an engine that fails before answering sends it
        back to the queue, up to ``max_attempts``. Raises ClientGone if ``disconnected`` completes first, else the
        steps' API errors (429, 503, 504). A reused id runs as ``<id>-<8 hex>`` (the reply's ``assignment.id``).
        ``early``: it may leave for its engine while its admission runs (:mod:`gateway.early_dispatch`);
        ``assigned`` hears of each assignment."""
        waiting, relay = self.waiting, self.relay
        base = adm.record.id
        sent_early = self._send_early(adm) if early else None
        if sent_early is not None:
            # its request leaves for the engine first (its task's first step), then the admission's for Redis:
            # the engine's round trip, the longer one, covers the admission's work and round trip
            try:
                await asyncio.sleep(0)
            except BaseException:
                self.early.take_back(sent_early, adm.record)
                raise
        while True:
            try:
                fut = await waiting.enqueue(
                    adm, sent_to=sent_early.engine if sent_early is not None else None
                )
                break
            except (DuplicateId, EarlyDeclined) as exc:  # (an early request's id may still run on its engine)
                self.early.take_back(sent_early, adm.record, declined=isinstance(exc, EarlyDeclined))
                sent_early = None
                # a client's id reused: <id>-<8 hex>; the gateway's own, declined early: a fresh id of its own
                fresh = (
                    uuid.uuid4().hex if isinstance(exc, EarlyDeclined) else f"{base}-{uuid.uuid4().hex[:8]}"
                )
                adm = adm.renamed(fresh)
            except BaseException as exc:  # refused (429: a filling queue, a tenant's limit), Redis away, ...
                self.early.take_back(sent_early, adm.record, declined=isinstance(exc, QueueFullError))
                raise
        while True:
            try:
                a = await waiting.wait_assignment(adm, fut, disconnected)
            except BaseException:
                self.early.take_back(sent_early, adm.record)
                raise
            if assigned is not None:
                assigned(a)
            self.metrics.child(self.metrics.queue_time, adm.record.priority).observe(
                max(0.0, time.time() - adm.record.enqueued_at)
            )
            used = sent_early if sent_early is not None and sent_early.went_to(a) else None
            if used is None:
                self.early.take_back(sent_early, adm.record)
            sent_early = None  # (a re-dispatch sends anew)
            try:
                if not adm.stream:
                    sent = used.answer if used is not None else None
                    status, payload = await relay.forward(adm, a, disconnected, sent)
                    return Reply(status, a, body=payload)
                if used is not None:
                    resp = await self.early.answer(used, adm.record)
                else:
                    resp = await self.upstream.open_stream(a.url, adm.path, adm.body)
                if resp.status_code == 200:  # nothing goes to the client before the engine's first event
                    events = await relay.first_event(adm, a, resp, disconnected)
            except WorkerUnavailable as exc:
                fut = await waiting.retry_or_fail(
                    adm, a, str(exc), engine_fault=exc.engine_fault, counted=exc.counted, died=exc.died
                )
                continue
            if resp.status_code != 200:
                await resp.aread()
                if resp.status_code >= 500:
                    waiting.engine_failed(a.engine, f"answered {resp.status_code}")
                await self.queue.finish(adm.record.id, "failed", resp.text[:200])
                return Reply(resp.status_code, a, raw=resp.content)
            if (error := engine_fields.stream_error(events[0])) is not None:  # refused before its first token
                with contextlib.suppress(Exception):
                    await resp.aclose()
                await self.queue.finish(adm.record.id, "failed", str(error.get("message", ""))[:200])
                return Reply(engine_fields.error_status(error), a, body=error)
            stream = relay.relay(adm, a, resp, events)
            return Reply(200, a, stream=stream, unstarted=functools.partial(relay.drop, adm, a, resp))
