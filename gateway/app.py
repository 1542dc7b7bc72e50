"""The gateway's HTTP surface (Starlette): OpenAI-style routes, error mapping, lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import time
import uuid
import zlib
from collections.abc import AsyncGenerator, Callable

import msgspec
import redis.asyncio as aioredis
from prometheus_client import CONTENT_TYPE_LATEST
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from flying import redis_conn, taskdump
from flying.messages import Priority
from gateway import batch, engine_fields, responses, schemas
from gateway import tenants as tenancy
from gateway.auth import InvalidAPIKey, RequireKey
from gateway.config import GatewayConfig
from gateway.disconnect import CancelOnDisconnect, ClientGone, watcher
from gateway.drain import CountRequests, Drain
from gateway.errors import (
    APIError,
    ContextTooLong,
    Draining,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    PayloadTooLarge,
    QueueUnavailable,
    RequestTimeout,
    UnsupportedMediaType,
)
from gateway.hot_routes import HotRoutesApp
from gateway.metrics import GatewayMetrics
from gateway.request_log import RequestLog
from gateway.request_log import info as request_info
from gateway.service import DONE, Gateway, Reply
from gateway.tenant_slots import TenantSlots
from gateway.tenants import Tenants
from gateway.tracing import TraceRequests, Tracing

log = logging.getLogger("flying.gateway")
_encode = msgspec.json.Encoder().encode


async def read_body(request: Request, limit: int, timeout_s: float = 30.0) -> bytes:
    """The request's body, at most ``limit`` bytes (413), all of it within ``timeout_s`` (408: a client that
    declared more than it sends, or sends it too slowly, no longer holds the request open forever)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
    chunks, size, more = [], 0, True
    try:
        async with asyncio.timeout(timeout_s):  # (a timer, no task: the body usually came with the head)
            while more:  # ``receive`` itself, not ``request.stream()``: no async generator per request
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    raise ClientDisconnect()
                chunk, more = message.get("body", b""), message.get("more_body", False)
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        came = f"{size} of the {declared} bytes declared" if declared else f"{size} bytes"
        raise RequestTimeout(
            f"the request body did not arrive within {timeout_s:g} s ({came} came)"
        ) from None
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding")
    return body if encoding is None else decoded_body(body, encoding, limit)


# media types read as JSON besides application/json and */*+json: a body without one, and curl's ``-d`` default
LENIENT_TYPES = frozenset({"", "application/x-www-form-urlencoded"})


def check_media_type(header: str | None) -> None:
    """A body declared as anything but JSON (``text/plain``, a form upload) is a 415, not parsed as JSON."""
    media = (header or "").split(";", 1)[0].strip().lower()
    if media == "application/json" or media.endswith("+json") or media in LENIENT_TYPES:
        return
    raise UnsupportedMediaType(f"request body is {media}; send it as application/json")


def decoded_body(body: bytes, encoding: str, limit: int) -> bytes:
    """A body sent with ``Content-Encoding`` gzip or deflate, decompressed (at most ``limit`` bytes of it: 413);
    another encoding is a 415."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "x-gzip", "deflate"):
        raise UnsupportedMediaType(f"Content-Encoding {encoding} is not supported (gzip, deflate or none)")
    d = zlib.decompressobj(wbits=47)  # a gzip or a zlib header, found in the data
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as exc:
        raise InvalidRequest(f"the request body is not valid {encoding} data ({exc})") from None
    if len(out) > limit or d.unconsumed_tail:
        raise PayloadTooLarge(f"the decompressed request body exceeds the limit of {limit} bytes")
    if not d.eof or d.unused_data:  # cut short, or more after its end: not one whole stream
        raise InvalidRequest(f"the request body is not one whole {encoding} stream")
    return out


async def completions(request: Request, kind: str) -> Response:
    """A completion request, counted in the metrics with its status and priority (``unknown`` until resolved)."""
    gw: Gateway = request.app.state.gateway
    seen = {"priority": "unknown"}
    status = 500
    try:
        response = await answer(request, kind, gw, seen)
        status = response.status_code
        return response
    except APIError as exc:
        status = exc.status
        if status < 500:
            gw.metrics.rejected.labels(str(status), exc.code or "").inc()
        raise
    except aioredis.RedisError:
        status = QueueUnavailable.status  # what redis_error answers
        raise
    finally:
        gw.metrics.child(gw.metrics.requests, request.scope["path"], str(status), seen["priority"]).inc()


async def answer(request: Request, kind: str, gw: Gateway, seen: dict[str, str]) -> Response:
    t0 = time.monotonic()
    if request.app.state.drain.draining:
        raise Draining("this gateway is shutting down; retry on another one")
    check_media_type(request.headers.get("content-type"))
    body = await read_body(request, gw.config.max_body_bytes, gw.config.body_timeout_s)
    if kind == "responses":
        asked = responses.decode(body)
        chat = responses.to_chat(asked)
        try:
            return await answer_response(request, gw, asked, chat, prioritise(request, chat, seen), t0)
        except (InvalidRequest, ContextTooLong) as exc:  # from the admission, in the chat's terms
            raise responses.in_client_terms(exc) from None
    req = parse(body, kind)
    priority = prioritise(request, req, seen)
    if isinstance(req, schemas.CompletionRequest):
        parts = schemas.split_prompts(req)
        if len(parts) > 1:
            return await answer_batch(request, gw, parts, priority, t0)
        req = parts[0]
    return await answer_one(request, gw, req, priority, t0)


def prioritise(request: Request, req, seen: dict[str, str]) -> Priority:
    """The request's priority (X-Priority, else its ``priority``, else its ``service_tier``), lowered to its
    tenant's highest if it asks for more (the request log line then names the one asked for too), or refused (403)
    for a tenant that refuses instead; a request that asks for none runs at the default or its tenant's highest,
    whichever is lower. Noted for the metrics and the request log."""
    headers = request.headers.getlist("x-priority")
    if len(set(headers)) > 1:
        raise InvalidRequest(
            f"send one X-Priority header; got {len(headers)}: {', '.join(headers)}", param="X-Priority"
        )
    header = headers[0] if headers else None
    asked = schemas.resolve_priority(header, req.priority, req.service_tier)
    info, priority = request_info(request.scope), asked
    tenant = tenancy.current.get()
    if tenant is not None:
        gw: Gateway = request.app.state.gateway
        source = schemas.priority_param(header, req.priority, req.service_tier)
        explicit = source is not None
        if source is not None and tenant.over_priority is tenancy.OverPriority.REFUSE:
            try:
                tenant.priority(asked, source)
            except tenancy.PriorityNotAllowed:
                gw.metrics.tenant_rejected.labels(tenant.name, "max_priority").inc()
                request.app.state.tenants.refused(tenant.name, "max_priority")
                raise
        priority = tenant.lowered(asked)
        if priority != asked and explicit:
            info.requested_priority = asked
            gw.metrics.child(gw.metrics.tenant_lowered, tenant.name, asked, priority).inc()
    seen["priority"] = info.priority = priority
    return priority


def parse(body: bytes, kind: str) -> schemas.ChatCompletionRequest | schemas.CompletionRequest:
    """The request body decoded and checked (InvalidRequest naming what is wrong)."""
    if kind == "chat":
        chat = schemas.decode(body, schemas.ChatCompletionRequest)
        assert isinstance(chat, schemas.ChatCompletionRequest)
        schemas.check_chat(chat)
        return chat
    completion = schemas.decode(body, schemas.CompletionRequest)
    assert isinstance(completion, schemas.CompletionRequest)
    schemas.check_completion(completion)
    return completion


async def answer_one(request: Request, gw: Gateway, req, priority: Priority, t0: float) -> Response:
    """One request (one prompt) through the queue: its JSON answer, or its stream."""
    served = await serve_one(request, gw, req, priority, t0)
    if isinstance(served, Response):
        return served
    reply, headers, disconnected = served
    if reply.stream is not None:
        assert reply.unstarted is not None
        return RelayResponse(reply.stream, headers, reply.unstarted, disconnected)
    disconnected.cancel()
    return json_reply(gw, reply, headers, schemas.answer_tier(req, priority))


async def answer_response(
    request: Request,
    gw: Gateway,
    asked: responses.ResponsesRequest,
    req: schemas.ChatCompletionRequest,
    priority: Priority,
    t0: float,
) -> Response:
    """``/v1/responses``: the chat completion ``req`` through the queue, answered in the Responses API's terms."""
    served = await serve_one(request, gw, req, priority, t0)
    if isinstance(served, Response):
        return served
    reply, headers, disconnected = served
    draft = responses.Draft(asked, schemas.answer_tier(req, priority))
    if reply.stream is not None:
        assert reply.unstarted is not None
        return RelayResponse(responses.events(draft, reply.stream), headers, reply.unstarted, disconnected)
    disconnected.cancel()
    if reply.status != 200 or reply.body is None:
        return json_reply(gw, reply, headers)
    return JSONResponse(responses.response(draft, engine_fields.clean(reply.body)), headers=headers)


async def serve_one(
    request: Request, gw: Gateway, req, priority: Priority, t0: float
) -> tuple[Reply, dict[str, str], asyncio.Future[None]] | Response:
    """Admit, queue and forward one request: its reply, the response headers and the disconnect watcher (still
    on for a stream), or the 499 of a client that left."""
    logged = request_info(request.scope)
    adm = await gw.admit(schemas.for_engine(req), priority, logged.request_id)
    disconnected = watcher(request.scope, request.receive)
    try:
        # a client's own id is never sent early: it may still run on an engine (reused), and a decline renames it
        reply = await gw.serve(adm, disconnected, early=not logged.client_id, assigned=logged.assigned)
        gw.metrics.child(gw.metrics.ttft, priority).observe(time.monotonic() - t0)
    except ClientGone:
        disconnected.cancel()
        return Response(status_code=499)
    except BaseException:
        disconnected.cancel()
        raise
    a = reply.assignment
    headers = {
        "X-Request-Id": a.id,  # the client's, or one made unique (gateway.request_log)
        "X-Queue-Time-Ms": f"{a.queue_ms:.1f}",
        "X-Flying-Engine": str(a.engine),
    }
    return reply, headers, disconnected


class EncodedJSON(JSONResponse):
    """A JSON answer encoded by msgspec: compact UTF-8 as Starlette's, at a fraction of ``json.dumps``'s cost."""

    def render(self, content: object) -> bytes:
        return _encode(content)


def json_reply(gw: Gateway, reply: Reply, headers: dict[str, str], tier: str | None = None) -> Response:
    """A non-streaming answer as the client gets it: SGLang's extra fields removed, the ``service_tier`` it was
    served at added (``tier``; a chat answer's), an engine's error in OpenAI's shape (all kept as they are with
    ``raw_engine_fields``)."""
    raw = gw.config.raw_engine_fields
    if reply.raw is not None:
        content = reply.raw if raw else engine_fields.openai_error(reply.raw)
        return Response(content, status_code=reply.status, media_type="application/json", headers=headers)
    body = (
        reply.body
        if raw
        else engine_fields.openai_error_doc(reply.body)
        or engine_fields.clean(reply.body, headers.get("X-Request-Id"), tier)
    )
    return EncodedJSON(body, status_code=reply.status, headers=headers)


async def answer_batch(
    request: Request, gw: Gateway, reqs: list[schemas.CompletionRequest], priority: Priority, t0: float
) -> Response:
    """A completion of several prompts: each admitted and queued as a request of its own (``<id>-<i>``), served
    concurrently; one answer (or one stream) with the choices numbered as OpenAI does (:mod:`gateway.batch`)."""
    logged = request_info(request.scope)
    base = logged.request_id or uuid.uuid4().hex
    batch.check_fits(len(reqs), gw.config.max_queue, priority, tenancy.current.get())
    adms = []
    for i, r in enumerate(reqs):
        try:
            adms.append(await gw.admit(schemas.for_engine(r), priority, f"{base}-{i}"))
        except APIError as exc:
            if exc.param == "prompt":  # which of the batch's prompts
                exc.param = f"prompt[{i}]"
            raise
    disconnected = watcher(request.scope, request.receive)
    early = not logged.client_id  # (the prompts' ids derive from it)
    tasks = [asyncio.ensure_future(gw.serve(adm, disconnected, early)) for adm in adms]
    streaming = False
    try:
        replies = await asyncio.gather(*tasks)
        gw.metrics.child(gw.metrics.ttft, priority).observe(time.monotonic() - t0)
        logged.request_id = base
        headers = {
            "X-Request-Id": base,
            "X-Queue-Time-Ms": f"{max(r.assignment.queue_ms for r in replies):.1f}",
            "X-Flying-Engine": ",".join(str(r.assignment.engine) for r in replies),
        }
        failed = next((r for r in replies if r.status != 200), None)
        if failed is not None:
            return json_reply(gw, failed, headers)
        n = reqs[0].n
        if reqs[0].stream:
            usage = bool(reqs[0].stream_options and reqs[0].stream_options.include_usage)
            streams = [r.stream for r in replies if r.stream is not None]
            relay = batch.merge_streams(streams, n, usage, base)
            streaming = True
            return RelayResponse(relay, headers, functools.partial(batch.unstarted, replies), disconnected)
        merged = batch.merge_completions([r.body for r in replies if r.body is not None], n, base)
        return json_reply(gw, Reply(200, replies[0].assignment, body=merged), headers)
    except ClientGone:
        return Response(status_code=499)
    finally:
        if not streaming:
            disconnected.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            batch.unstarted([t.result() for t in tasks if not t.cancelled() and t.exception() is None])


class RelayResponse(StreamingResponse):
    """A stream relayed as the engine's events come, each chunk of them in one write, the last (ending with
    ``[DONE]``) together with the end of the response. The request's disconnect watcher (``disconnected``) stays
    on: a client that leaves cancels the relay at once (no task group per stream), and the relay's cleanup (the
    abort on the engine, the slot freed in Redis) runs then, not when the garbage collector finds the generator.
    If the client leaves before the relay has even started (its cleanup is in the relay), ``unstarted`` is called
    instead."""

    def __init__(
        self,
        relay: AsyncGenerator[bytes, None],
        headers: dict[str, str],
        unstarted: Callable[[], None],
        disconnected: asyncio.Future[None],
    ) -> None:
        super().__init__(relay, media_type="text/event-stream", headers=headers)
        self.relay, self.unstarted, self.disconnected = relay, unstarted, disconnected
        self.started = self.complete = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = CancelOnDisconnect(self.disconnected)
        try:
            watch.check()
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            self.started = True
            async for chunk in self.relay:  # to its end: the relay's cleanup runs in it
                if not self.complete:
                    self.complete = chunk.endswith(DONE)
                    if self.complete:  # (the watcher ends with the response too)
                        watch.close()
                    await send({"type": "http.response.body", "body": chunk, "more_body": not self.complete})
            if not self.complete:
                self.complete = True
                watch.close()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watch.caught():
                raise
            # the client left: the response ends here, as a finished one
        finally:
            watch.close()
            self.disconnected.cancel()
            if not self.started:
                self.unstarted()
            await self.relay.aclose()


async def models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    return JSONResponse({"object": "list", "data": [await model_card(gw)]})


async def model(request: Request) -> Response:
    """``GET /v1/models/{id}``: the served model's card, 404 (OpenAI's shape) for any other id."""
    gw: Gateway = request.app.state.gateway
    name = request.path_params["model_id"]
    if name != gw.config.served_model_name:
        raise ModelNotFound(
            f"The model '{name}' does not exist; this gateway serves '{gw.config.served_model_name}'",
            param="model",
        )
    return JSONResponse(await model_card(gw))


async def model_card(gw: Gateway) -> dict:
    """The served model, with its context length (``max_model_len``) once an engine reports it."""
    beats = await gw.cluster.workers()
    card: dict[str, object] = {
        "id": gw.config.served_model_name,
        "object": "model",
        "created": int(gw.started),
        "owned_by": "flying-serving",
    }
    if beats:
        card["max_model_len"] = gw.cluster.context_limit(beats)
    return card


async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    return Response(gw.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


async def health(request: Request) -> Response:
    """200 "ok" while the deployment can serve; 503 "degraded" (with Retry-After and the reasons) when no engine
    is live or no router holds the lease; 503 "unhealthy" when Redis does not answer."""
    gw: Gateway = request.app.state.gateway
    if request.app.state.drain.draining:
        return JSONResponse(
            {"status": "draining", "gateway_id": gw.config.gateway_id}, status_code=503, headers=RETRY
        )
    try:
        beats = await gw.cluster.workers(max_age_s=0)
        depth = await gw.queue.depth()
    except aioredis.RedisError as exc:
        return JSONResponse({"status": "unhealthy", "redis": repr(exc)}, status_code=503, headers=RETRY)
    others = [w for w in gw.cluster.degraded() if w != "no live engine"]
    why = (["no live engine"] if not beats else []) + others
    body = {
        "status": "degraded" if why else "ok",
        "gateway_id": gw.config.gateway_id,
        "live_workers": [hb.engine for hb in beats],
        "queue_depth": depth,
    }
    if why:
        return JSONResponse(body | {"reasons": why}, status_code=503, headers=RETRY)
    return JSONResponse(body)


RETRY = {"Retry-After": "2"}


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return NotFound(f"no route {request.method} {request.url.path}").response()
    if exc.status_code == 405:
        return MethodNotAllowed(f"method {request.method} not allowed on {request.url.path}").response()
    return InvalidRequest(str(exc.detail)).response()


async def redis_error(request: Request, exc: Exception) -> Response:
    log.error("redis unavailable: %r", exc)
    return QueueUnavailable("the request queue (Redis) is unavailable; retry later").response()


async def internal_error(request: Request, exc: Exception) -> Response:
    """A bug, not a client error; still OpenAI-shaped so clients can parse it."""
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    err = APIError(f"internal error: {type(exc).__name__}", code="internal_error")
    err.status, err.type = 500, "server_error"
    return err.response()


def redis_client(config: GatewayConfig) -> aioredis.Redis:
    """A bounded pool that makes callers wait for a connection rather than fail: the number of connections does
    not grow with the number of requests, and a burst queues for a moment instead of getting 503s."""
    return redis_conn.async_pool_client(
        config.redis_url,
        max_connections=config.redis_max_connections,
        timeout=None,  # wait for a connection as long as it takes (connecting to a dead Redis fails fast)
        client_name=f"flying-gw-{config.gateway_id}",
        health_check_interval=10,
        # a pooled connection that died with a Redis restart is replaced, not reported as an outage (behind
        # Sentinel, redis_conn retries for as long as a failover takes)
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.02), 3),
        retry_on_error=[aioredis.ConnectionError, aioredis.TimeoutError],
    )


def create_app(
    config: GatewayConfig,
    count_tokens=None,
    drain: Drain | None = None,
    tenants: Tenants | None = None,
    tracing: Tracing | None = None,
) -> Starlette:
    """The app; ``drain`` (made here when not given) counts requests in progress and holds the drain state;
    ``tenants`` are the API keys (default: ``config.api_keys``, plain); ``tracing`` its spans (default: to
    ``config.otlp_endpoint``, none without one)."""
    drain = drain or Drain()
    tracing = tracing or Tracing.from_config(config.otlp_endpoint, config.otel_service_name)
    tenants = tenants if tenants is not None else Tenants.of(config.api_keys)
    meters = GatewayMetrics()
    meters.in_flight.set_function(lambda: drain.active)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        counter = count_tokens
        if counter is None:
            from gateway.tokens import PromptCounter

            counter = PromptCounter(config.model_path)
        client = redis_client(config)
        gw = Gateway(config, client, counter, meters)
        if tracing is not None:
            tracing.instrument(gw)
        await gw.start()
        tenants.slots = TenantSlots(client, gw.keys, config.gateway_id)  # max_concurrent across the gateways
        app.state.gateway = gw
        taskdump.install(asyncio.get_running_loop())
        # The start-up heap (transformers, the tokenizer: ~400K objects) is never garbage; out of the collector's
        # sight, a full collection takes ~1 ms instead of ~100 (a pause every request in flight would wait out).
        gc.collect()
        gc.freeze()
        log.info(
            "gateway %s serving %s on %s:%d (%s)",
            config.gateway_id,
            config.served_model_name,
            config.host,
            config.port,
            f"{len(tenants.book.entries)} API keys" if not tenants.open else "no API keys: open",
        )
        try:
            yield
        finally:
            await gw.stop()
            await client.aclose()
            if tracing is not None:
                tracing.shutdown()

    hot = {
        "/v1/chat/completions": functools.partial(completions, kind="chat"),
        "/v1/completions": functools.partial(completions, kind="completion"),
        "/v1/responses": functools.partial(completions, kind="responses"),
    }
    routes = [
        *(Route(path, endpoint, methods=["POST"]) for path, endpoint in hot.items()),  # (other methods: 405)
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    handlers = {
        APIError: api_error,
        HTTPException: http_error,
        aioredis.RedisError: redis_error,
        Exception: internal_error,
    }
    app = HotRoutesApp(
        hot=hot,  # past Starlette's router and exception layer (gateway.hot_routes)
        routes=routes,
        lifespan=lifespan,
        exception_handlers=handlers,
        middleware=[
            *([Middleware(TraceRequests, tracing=tracing)] if tracing is not None else []),
            Middleware(CountRequests, drain=drain),
            Middleware(RequestLog),
            Middleware(
                RequireKey,
                tenants=tenants,
                protect_metrics=config.metrics_require_key,
                on_reject=lambda: meters.rejected.labels("401", InvalidAPIKey.code).inc(),
                metrics=meters,
            ),
        ],
    )
    # "/v1/models/" is a JSON 404, not a bare redirect (a POST cannot follow one)
    app.router.redirect_slashes = False
    app.state.drain = drain
    app.state.tenants = tenants
    return app
