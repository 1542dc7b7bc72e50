"""The gateway's request path: validate -> admit to the Redis queue -> await the router's assignment ->
forward to the engine (re-dispatched if it fails before answering) -> stream back (resumed elsewhere if it fails
mid-stream). :meth:`Gateway.serve` is that whole path after validation; HTTP framing lives in
:mod:`gateway.app`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import redis.asyncio as aioredis

from flying.autopipeline import AutoPipeline
from flying.cancel import reraise_if_cancelled, stop_task
from flying.groups import merge_sets
from flying.keys import Keys
from flying.messages import (
    GROUP_LOST,
    Assignment,
    Heartbeat,
    Priority,
    QueuedRequest,
    RouterState,
    decode,
    engine_gave_up,
)
from flying.prefix import block_hashes, encode_chain
from flying.queue import DuplicateId, QueueFull, RequestQueue
from flying.workers import live_workers
from gateway.assignments import AssignmentWaiter
from gateway.backpressure import Backpressure
from gateway.config import GatewayConfig
from gateway.disconnect import CancelOnDisconnect, ClientGone
from gateway.errors import (
    ContextTooLong,
    InvalidRequest,
    ModelNotFound,
    NoLiveWorkers,
    NoRouter,
    QueueFullError,
    QueueTimeout,
    WorkerFailed,
)
from gateway.metrics import GatewayMetrics
from gateway.resume import Resumable, upstream_body
from gateway.schemas import NOT_RESUMABLE, ChatCompletionRequest, requested_max_tokens
from gateway.upstream import StreamBroken, Upstream, WorkerUnavailable

log = logging.getLogger("flying.gateway")
SGLANG_PRIORITY = {"high": 2, "normal": 1, "low": 0}  # SGLang runs higher integers first
GATEWAY_TTL_MS = (
    3000  # the liveness key's TTL; refreshed every monitor_s (the router reaps a dead gateway's work)
)


@dataclass(frozen=True)
class Admitted:
    """A validated request, ready to queue and forward."""

    record: QueuedRequest
    path: str  # SGLang endpoint
    body: dict
    stream: bool
    resume: Resumable | None = None  # a stream that can continue on another engine (see gateway.resume)

    def renamed(self, rid: str) -> Admitted:
        """The same request under id ``rid`` (record and SGLang rid)."""
        self.body["rid"] = rid  # the one body dict, shared with ``resume``
        return dataclasses.replace(self, record=msgspec.structs.replace(self.record, id=rid))


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


DONE = b"data: [DONE]\n\n"  # a stream's last event
FINISH_RETRY_S = 300.0  # how long a request's end is retried while Redis is away
OFF_LOOP_CHARS = 8192  # prompts longer than this are tokenized off the event loop


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        client: aioredis.Redis,
        count_tokens,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics or GatewayMetrics()
        self.started = time.time()  # the model card's "created"
        self.keys = Keys(config.key_prefix)
        self.r = client
        self.queue = RequestQueue(client, self.keys, pipe=autopipeline(client))
        self.waiter = AssignmentWaiter(
            client, self.keys, config.gateway_id, config.reconcile_s, on_missing=self.readmit
        )
        self.holding: dict[
            str, QueuedRequest
        ] = {}  # waiting requests' records, to re-admit if Redis lost them
        self.readmitted = 0
        self.upstream = Upstream(config.request_timeout_s)
        self.count_tokens = count_tokens
        self.backpressure = Backpressure(config.max_queue, config.max_wait_s)
        self._workers: tuple[float, list[Heartbeat]] = (-1e9, [])
        self._refresh: asyncio.Task | None = None  # the one in-flight refresh of the cluster view
        self.no_workers_since: float | None = None
        self.router_seen = time.monotonic()  # last time a router held the lease (start: a grace period)
        self.pooled_context = True  # the router binds groups for long requests (from its published state)
        self._background: set[asyncio.Task] = set()
        self._monitor: asyncio.Task | None = None
        self._stopping = False

    async def start(self) -> None:
        await self.r.set(self.keys.gateway(self.config.gateway_id), self.config.gateway_id, px=GATEWAY_TTL_MS)
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

    # -- cluster view ------------------------------------------------------------------------------------------
    async def workers(self, max_age_s: float = 0.25) -> list[Heartbeat]:
        """The live engines, as read at most ``max_age_s`` ago; concurrent callers share one refresh."""
        ts, beats = self._workers
        if time.monotonic() - ts <= max_age_s:
            return beats
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._read_workers())
        return await asyncio.shield(self._refresh)

    async def _read_workers(self) -> list[Heartbeat]:
        beats = await live_workers(self.r, self.keys)
        raw = await self.r.get(self.keys.router_state)
        self.pooled_context = decode(raw, RouterState).long_context if raw else True
        self._workers = (time.monotonic(), beats)
        return beats

    async def _watch(self) -> None:
        """Once per ``monitor_s``, whatever the load: refresh the cluster view, sample the service rate, and end
        the waiting requests when no engine has been live for ``no_worker_grace_s``."""
        while not self._stopping:
            try:
                await self.observe()
            except aioredis.RedisError as exc:
                reraise_if_cancelled()
                log.warning("cluster view: redis unavailable (%r)", exc)
            await asyncio.sleep(self.config.monitor_s)

    async def observe(self) -> None:
        beats = await self.workers(max_age_s=0)
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self.keys.gateway(self.config.gateway_id), self.config.gateway_id, px=GATEWAY_TTL_MS)
        pipe.hget(self.keys.stats, "assigned")
        pipe.exists(self.keys.router_lease)
        pipe.zcard(self.keys.queue)
        _, assigned, lease, depth = await pipe.execute()
        now = time.monotonic()
        self.backpressure.rate.sample(now, int(assigned or 0), backlogged=depth > 0)
        if lease:
            self.router_seen = now
        if beats:
            self.no_workers_since = None
        elif self.no_workers_since is None:
            self.no_workers_since = now
        elif now - self.no_workers_since > self.config.no_worker_grace_s and self.waiter.pending:
            grace = self.config.no_worker_grace_s
            n = self.waiter.fail_all(
                lambda: NoLiveWorkers(f"no live workers for {grace:.0f} s; request dropped")
            )
            log.warning("no live workers for %.0f s: %d waiting requests ended with 503", grace, n)

    def degraded(self) -> list[str]:
        """Why this deployment cannot serve new requests now (empty: it can)."""
        why = []
        if self.no_workers_since is not None:
            why.append("no live engine")
        if time.monotonic() - self.router_seen > self.config.no_router_grace_s:
            why.append(f"no router has held the lease for {time.monotonic() - self.router_seen:.0f} s")
        return why

    @staticmethod
    def context_limit(beats: list[Heartbeat], pooled: bool = True) -> int:
        """Largest prompt+output the deployment can hold: one engine's context length, capped by the KV of the
        widest group whose members are all live (one engine's KV when engines cannot bind)."""
        live = {hb.engine for hb in beats}
        per_engine = min(hb.max_total_tokens for hb in beats)
        sets = merge_sets(max(hb.num_engines for hb in beats)) if pooled else []
        widest = max((len(ms) for ms in sets if set(ms) <= live), default=1)
        kv = max(max(hb.max_total_tokens for hb in beats), widest * per_engine)
        return min(max(hb.context_len for hb in beats), kv)

    # -- admission ---------------------------------------------------------------------------------------------
    async def admit(self, req, priority: Priority, request_id: str | None = None) -> Admitted:
        """Validate ``req`` and build its record and engine body, under ``request_id`` (else a fresh id)."""
        if req.model != self.config.served_model_name:
            raise ModelNotFound(
                f"The model '{req.model}' does not exist; this gateway serves '{self.config.served_model_name}'",
                param="model",
            )
        beats = await self.workers() or await self.workers(max_age_s=0)  # before a 503, look again
        if not beats:
            raise NoLiveWorkers("no live workers; try again later")
        if time.monotonic() - self.router_seen > self.config.no_router_grace_s:
            raise NoRouter("no router is dispatching (none holds the lease); try again later")
        chat = isinstance(req, ChatCompletionRequest)
        size = sum(len(m.text()) for m in req.messages) if chat else len(req.prompt)
        if size > OFF_LOOP_CHARS:  # a long prompt is tokenized on a thread: other requests keep flowing
            ids = await asyncio.to_thread(self._tokens, req, chat)
        else:
            ids = self._tokens(req, chat)
        prompt = ids if isinstance(ids, int) else len(ids)
        limit = self.context_limit(beats, self.pooled_context)
        max_tokens = self._max_tokens(req, prompt, limit)
        rid = request_id or uuid.uuid4().hex
        chain = block_hashes(ids if isinstance(ids, list) else req.prompt)  # for cache-aware dispatch
        body = msgspec.to_builtins(req)
        body.pop("max_completion_tokens", None)
        body.update(max_tokens=max_tokens, rid=rid, priority=SGLANG_PRIORITY[priority])
        record = QueuedRequest(
            id=rid,
            priority=priority,
            model=req.model,
            prompt_tokens=prompt,
            max_tokens=max_tokens,
            gateway=self.config.gateway_id,
            enqueued_at=time.time(),
            n=req.n,
            prefix=encode_chain(chain),
        )
        path = "/v1/chat/completions" if chat else "/v1/completions"
        keep = req.logprobs or req.n > 1 or (not chat and req.echo) or any(getattr(req, f, None) is not None for f in NOT_RESUMABLE)  # fmt: skip
        if not req.stream or keep:  # the engine's own endpoint
            return Admitted(record, path, body, bool(req.stream))
        up = upstream_body(body, chat, ids if isinstance(ids, list) else None)
        known = (
            up["prompt"] if isinstance(up["prompt"], list) else None
        )  # a text prompt's: from the first chunk
        return Admitted(
            record, "/v1/completions", up, True, Resumable(up, max_tokens, chat=chat, prompt_ids=known)
        )

    def _tokens(self, req, chat: bool) -> list[int] | int:
        """The chat prompt's token ids, or a completion prompt's length; a prompt the tokenizer or chat
        template rejects (e.g. roles a template does not allow) is the client's error."""
        try:
            return self.count_tokens.chat_ids(req) if chat else self.count_tokens.completion(req)
        except Exception as exc:  # noqa: BLE001 - tokenizers and Jinja templates raise anything
            param = "messages" if chat else "prompt"
            raise InvalidRequest(f"the {param} could not be tokenized: {exc}", param=param) from None

    def _max_tokens(self, req, prompt: int, limit: int) -> int:
        asked, param = requested_max_tokens(req)
        if asked is not None and asked < 1:
            raise InvalidRequest(f"{param} must be at least 1, got {asked}", param=param)
        if prompt >= limit:
            raise ContextTooLong(
                f"This model's maximum context length is {limit} tokens; the prompt has {prompt} tokens.",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            )
        if asked is None:
            return min(self.config.default_max_tokens, limit - prompt)
        if prompt + asked > limit:
            raise ContextTooLong(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt + asked} tokens ({prompt} in the prompt, {asked} in the completion).",
                param=param,
            )
        return asked

    async def enqueue(self, adm: Admitted) -> asyncio.Future[Assignment]:
        """Admit to the global queue, within the backpressure limits for its priority (else 429)."""
        rid = adm.record.id
        limits = self.backpressure.limits(adm.record.priority)
        fut = self.waiter.expect(rid)
        try:
            fast = await self.queue.admit(adm.record, limits.max_depth, limits.max_ahead)
        except QueueFull as exc:
            self.waiter.forget(rid)
            bound = limits.max_depth if exc.reason == "depth" else limits.max_ahead
            retry = self.backpressure.retry_after_s(exc.count - bound + 1)
            why = (
                f"the queue is full for {adm.record.priority} priority ({exc.count} waiting)"
                if exc.reason == "depth"
                else f"the estimated wait is too long ({exc.count} requests ahead)"
            )
            raise QueueFullError(f"{why}; retry after {retry} s", retry_after_s=retry) from None
        except BaseException:
            self.waiter.forget(rid)
            raise
        if fast is not None:  # assigned at admission (the queue was empty): no wait for the router's round
            self.waiter.resolve(fast)
            return fut
        self.waiter.mark_admitted(rid)
        self.holding[rid] = adm.record
        return fut

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

    # -- the request's path ----------------------------------------------------------------------------------
    async def serve(self, adm: Admitted, disconnected: asyncio.Future[None]) -> Reply:
        """Queue ``adm``, wait for its assignment and forward it; an engine that fails before answering (or, for
        a stream, before its first event) sends it back to the queue, within ``max_attempts``. Raises ClientGone
        when ``disconnected`` completes first, and the API errors of the steps (429, 503, 504). An id a record
        already holds (a client's ``X-Request-Id`` reused) is made unique: ``<id>-<8 hex>``; the reply's
        ``assignment.id`` is the id it ran under."""
        base = adm.record.id
        while True:
            try:
                fut = await self.enqueue(adm)
                break
            except DuplicateId:
                adm = adm.renamed(f"{base}-{uuid.uuid4().hex[:8]}")
        while True:
            a = await self.wait_assignment(adm, fut, disconnected)
            self.metrics.child(self.metrics.queue_time, adm.record.priority).observe(
                max(0.0, time.time() - adm.record.enqueued_at)
            )
            try:
                if not adm.stream:
                    status, payload = await self.forward(adm, a, disconnected)
                    return Reply(status, a, body=payload)
                resp = await self.upstream.open_stream(a.url, adm.path, adm.body)
                if resp.status_code == 200:  # nothing goes to the client before the engine's first event
                    events = await self.first_event(adm, a, resp, disconnected)
            except WorkerUnavailable as exc:
                fut = await self.retry_or_fail(adm, a, str(exc))
                continue
            if resp.status_code != 200:
                await resp.aread()
                await self.queue.finish(adm.record.id, "failed", resp.text[:200])
                return Reply(resp.status_code, a, raw=resp.content)
            stream = self.relay(adm, a, resp, events)
            return Reply(200, a, stream=stream, unstarted=functools.partial(self.drop, adm, a, resp))

    # -- waiting -----------------------------------------------------------------------------------------------
    async def wait_assignment(
        self, adm: Admitted, fut: asyncio.Future[Assignment], disconnected: asyncio.Future[None]
    ) -> Assignment:
        """The assignment (from the subscription or the reconciliation); no Redis call of its own while it
        waits. Raises ClientGone, QueueTimeout, or NoLiveWorkers (set on the future by the monitor)."""
        rid = adm.record.id
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            self.holding.pop(rid, None)  # the fast path: assigned at admission
            return fut.result()
        try:
            waits: set[asyncio.Future[Any]] = {fut, disconnected}
            done, _ = await asyncio.wait(
                waits, timeout=self.config.queue_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if fut in done:
                self.holding.pop(rid, None)
                return fut.result()
            if disconnected in done:
                raise ClientGone(rid)
            raise QueueTimeout(f"request was not scheduled within {self.config.queue_timeout_s:.0f} s")
        except BaseException:
            self.holding.pop(rid, None)
            self.waiter.forget(rid)
            try:
                await self.queue.finish(rid, "cancelled", "not scheduled")
            except aioredis.RedisError:  # Redis away: retried in the background until it is back
                self.spawn(self.finish_surely(rid, "cancelled", "not scheduled"))
            raise

    async def retry_or_fail(
        self, adm: Admitted, a: Assignment, why: str, cause: str = "before_first_event"
    ) -> asyncio.Future[Assignment]:
        """The engine died before answering: put the request back in the queue (bounded) or fail it."""
        rec = await self.queue.get(adm.record.id)
        attempts = int(rec.get("attempts", 0)) + 1
        if attempts >= self.config.max_attempts:
            await self.queue.finish(adm.record.id, "failed", why)
            raise WorkerFailed(f"engine {a.engine} failed and {attempts} attempts are used up: {why}")
        log.warning("request %s: engine %d unavailable (%s); re-queueing", adm.record.id, a.engine, why,
                    extra={"request_id": adm.record.id})  # fmt: skip
        self.metrics.redispatched.labels(cause).inc()
        fut = self.waiter.expect(adm.record.id)
        await self.queue.requeue(adm.record, a.engine, why)
        self.waiter.mark_admitted(adm.record.id)
        self.holding[adm.record.id] = adm.record
        return fut

    # -- forwarding --------------------------------------------------------------------------------------------
    async def forward(self, adm: Admitted, a: Assignment, disconnected: asyncio.Future[None]):
        """Non-streaming: the engine's (status, JSON body). Raises WorkerUnavailable or ClientGone."""
        resp = await self._unless_gone(adm, a, self.upstream.post(a.url, adm.path, adm.body), disconnected)
        if resp.status_code == GROUP_LOST.status:  # the engine cannot serve it (its TP group lost a member)
            raise WorkerUnavailable(f"engine {a.engine} answered 503: {resp.text[:200]}")
        try:
            payload = resp.json()
        except ValueError:
            error = f"engine {a.engine} answered {resp.status_code} with a body that is not JSON: {resp.text[:120]!r}"
            await self.queue.finish(adm.record.id, "failed", error)
            raise WorkerFailed(error) from None
        state = "done" if resp.status_code == 200 else "failed"
        await self.queue.finish(adm.record.id, state, "" if state == "done" else resp.text[:200])
        return resp.status_code, payload

    async def first_event(
        self, adm: Admitted, a: Assignment, resp, disconnected: asyncio.Future[None]
    ) -> AsyncIterator[list[str]]:
        """Streaming: wait for the engine's first SSE event before the client gets anything, so an engine that
        dies (or a group that loses a member) before it can still be replaced: raises WorkerUnavailable and the
        request is re-dispatched; ClientGone if the client leaves meanwhile. Returns the stream's lines in the
        batches they arrived in, the first starting with that event."""
        batches = resp.aiter_batches()

        async def read() -> list[str]:
            try:
                async for batch in batches:
                    for i, line in enumerate(batch):
                        if line.startswith("data:"):
                            return batch[i:]
            except Exception as exc:  # noqa: BLE001 - any upstream failure before the first event: try another
                raise WorkerUnavailable(f"engine {a.engine} failed before its first event: {exc!r}") from exc
            raise WorkerUnavailable(f"engine {a.engine} closed the stream before its first event")

        try:
            first = await self._unless_gone(adm, a, read(), disconnected)
            if why := unavailable(first[0]):
                raise WorkerUnavailable(f"engine {a.engine} ended the stream before a token: {why}")
        except BaseException:
            with contextlib.suppress(Exception):
                await resp.aclose()
            raise
        return _prepend(first, batches)

    async def _unless_gone(
        self, adm: Admitted, a: Assignment, coro: Awaitable, disconnected: asyncio.Future[None]
    ):
        """``await coro``, unless the client disconnects first: then it is cancelled, the engine is told to abort
        the request, and ClientGone is raised. (The disconnect cancels this task; no task of its own for ``coro``.)"""
        watch = CancelOnDisconnect(disconnected)
        try:
            watch.check()
            return await coro
        except asyncio.CancelledError:
            if not watch.caught():
                raise
            self.spawn(self._abandon(adm, a, "client disconnected"))
            raise ClientGone(adm.record.id) from None
        finally:
            watch.close()
            if inspect.iscoroutine(coro) and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
                coro.close()  # never started (the client had left already)

    async def relay(
        self, adm: Admitted, a: Assignment, resp, events: AsyncIterator[list[str]]
    ) -> AsyncGenerator[bytes, None]:
        """Streaming: relay the engine's SSE ``events`` (from :meth:`first_event`), the last chunk ending with
        ``DONE``. A resumable stream whose engine
        dies, or aborts it (its TP group lost a member), after the first event continues on another engine from
        the tokens already sent (:mod:`gateway.resume`, within ``max_attempts``); any other broken stream ends
        with an error event."""
        state, error = "cancelled", "client disconnected"
        try:
            while True:
                try:
                    async for chunk in self._events(adm, a, events):
                        yield chunk
                    state, error = "done", ""
                    break
                except WorkerUnavailable as exc:
                    if adm.resume is None or adm.resume.prompt_ids is None:
                        raise
                    with contextlib.suppress(Exception):
                        await resp.aclose()
                    if adm.resume.remaining() <= 0:  # it broke after its last token: nothing left to ask
                        yield DONE
                        state, error = "done", ""
                        break
                    a, resp, events = await self._resume(adm, a, str(exc))
        except Exception as exc:  # noqa: BLE001 - any upstream failure that cannot be resumed: an error event
            state, error = "failed", f"engine {a.engine} failed mid-stream: {exc!r}"
            yield sse_error(exc if isinstance(exc, WorkerFailed) else WorkerFailed(error)) + DONE
        finally:  # spawned first: an await here may be cancelled again (the client left)
            if state == "cancelled":
                self.spawn(self._abandon(adm, a, error))
            else:
                self.spawn(self.finish_surely(adm.record.id, state, error))
            if state == "done":
                resp.finish()  # its connection goes back to the pool once the response's end is in
            else:
                with contextlib.suppress(Exception):
                    await resp.aclose()

    async def _events(
        self, adm: Admitted, a: Assignment, batches: AsyncIterator[list[str]]
    ) -> AsyncIterator[bytes]:
        """One engine's events as the client gets them, through ``[DONE]``: those that arrived together in one
        piece (one write to the client); WorkerUnavailable if the engine fails, aborts the request or closes the
        stream before its end."""
        try:
            async for batch in batches:
                out: list[bytes] = []
                for line in batch:
                    if not line.startswith("data:"):
                        continue
                    if line.strip() == "data: [DONE]":
                        out.append(DONE)
                        yield b"".join(out)
                        return
                    if adm.resume is None:
                        out.append((line + "\n\n").encode())
                        if why := unavailable(line):
                            yield b"".join(out)
                            raise WorkerUnavailable(f"engine {a.engine} ended the stream: {why}")
                        continue
                    event, data = adm.resume.event(line[5:].strip())
                    if why := engine_gave_up(event):
                        if out:
                            yield b"".join(out)
                        raise WorkerUnavailable(f"engine {a.engine} ended the stream: {why}")
                    if data is not None:
                        out += (b"data: ", data, b"\n\n")
                if out:
                    yield b"".join(out)
        except (httpx.HTTPError, StreamBroken) as exc:
            raise WorkerUnavailable(f"engine {a.engine} failed mid-stream: {exc!r}") from exc
        raise WorkerUnavailable(f"engine {a.engine} closed the stream early")

    async def _resume(self, adm: Admitted, a: Assignment, why: str):
        """Continue a broken stream elsewhere: back in the queue (bounded by ``max_attempts``, else WorkerFailed),
        then the remaining tokens from a new engine. Returns (assignment, response, events)."""
        assert adm.resume is not None, "only a resumable stream is resumed"
        body = adm.resume.continuation()
        log.warning("request %s: %s; resuming after %d tokens", adm.record.id, why, len(adm.resume.generated),
                    extra={"request_id": adm.record.id})  # fmt: skip
        fut = await self.retry_or_fail(adm, a, why, cause="mid_stream")
        never = (
            asyncio.get_running_loop().create_future()
        )  # a client that leaves cancels this generator instead
        a = await self.wait_assignment(adm, fut, never)
        resp = await self.upstream.open_stream(a.url, adm.path, body)
        if resp.status_code != 200:
            await resp.aread()
            raise WorkerUnavailable(f"engine {a.engine} answered {resp.status_code}: {resp.text[:200]}")
        return a, resp, await self.first_event(adm, a, resp, never)

    async def _abandon(self, adm: Admitted, a: Assignment, why: str) -> None:
        """The client left: free its slot in Redis and stop it on the engine, both at once (an engine busy with
        many aborts must not hold the slot)."""
        await asyncio.gather(
            self.upstream.abort(a.url, *adm.record.engine_rids()),
            self.finish_surely(adm.record.id, "cancelled", why),
        )

    def drop(self, adm: Admitted, a: Assignment, resp) -> None:
        """A stream whose client left before it started: close the engine's stream, abort it there, free its
        slot (what the relay does when it ends)."""
        self.spawn(resp.aclose())
        self.spawn(self._abandon(adm, a, "client disconnected before its stream started"))

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

    def spawn(self, coro: Awaitable) -> None:
        task = asyncio.ensure_future(_logged(coro))
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def autopipeline(client: aioredis.Redis) -> AutoPipeline | None:
    """An auto-pipelined connection to the client's Redis for the per-request scripts (none for TLS, which it
    does not speak: those go through the client's pool)."""
    pool = client.connection_pool
    if issubclass(pool.connection_class, aioredis.SSLConnection):
        return None
    return AutoPipeline.like(pool.connection_kwargs)


async def _logged(coro: Awaitable) -> None:
    """A background step (finish, abort) that must not end in an unretrieved exception when Redis is away."""
    try:
        await coro
    except aioredis.RedisError as exc:
        log.warning("background step failed, redis unavailable: %r", exc)


async def _prepend(first: list[str], rest: AsyncIterator[list[str]]) -> AsyncIterator[list[str]]:
    yield first
    async for item in rest:
        yield item


def unavailable(line: str) -> str:
    """Why an SSE line says the engine gave up on the request ('' if it does not): see engine_gave_up."""
    with contextlib.suppress(ValueError):  # (msgspec.DecodeError is one)
        return engine_gave_up(msgspec.json.decode(line[5:]))
    return ""


def sse_error(err) -> bytes:
    return b"data: " + json.dumps(err.body()).encode() + b"\n\n"
