"""The gateway's HTTP surface (Starlette): OpenAI-style routes, error mapping, lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import time

import msgspec
import redis.asyncio as aioredis
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from flying import redis_conn, taskdump
from flying.messages import Priority
from gateway import batch, engine_fields, responses, schemas
from gateway import body as body_of
from gateway import tenants as tenancy
from gateway.auth import InvalidAPIKey, RequireKey
from gateway.config import GatewayConfig
from gateway.disconnect import ClientGone, watcher
from gateway.drain import CountRequests, Drain
from gateway.errors import (
    APIError,
    ContextTooLong,
    Draining,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    QueueUnavailable,
)
from gateway.hot_routes import HotRoutesApp
from gateway.metrics import GatewayMetrics
from gateway.replies import RelayResponse, json_reply
from gateway.request_log import RequestLog
from gateway.request_log import info as request_info
from gateway.service import Gateway, Reply
from gateway.tenants import Tenants, TenantSlots
from gateway.tracing import TraceRequests, Tracing

log = logging.getLogger("flying.gateway")
_encode = msgspec.json.Encoder().encode


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
    body_of.check_media_type(request.headers.get("content-type"))
    body = await body_of.read_body(request, gw.config.max_body_bytes, gw.config.body_timeout_s)
    if kind == "responses":
        asked = responses.decode(body)
        chat = responses.to_chat(asked)
        try:
            return await answer_response(
                request, gw, asked, chat, tenancy.prioritise(request, chat, seen), t0
            )
        except (InvalidRequest, ContextTooLong) as exc:  # from the admission, in the chat's terms
            raise responses.in_client_terms(exc) from None
    req = parse(body, kind)
    priority = tenancy.prioritise(request, req, seen)
    if isinstance(req, schemas.CompletionRequest):
        parts = schemas.split_prompts(req)
        if len(parts) > 1:
            return await batch.answer_batch(request, gw, parts, priority, t0)
        req = parts[0]
    return await answer_one(request, gw, req, priority, t0)


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
        client = redis_conn.waiting_pool_client(
            config.redis_url, config.redis_max_connections, f"flying-gw-{config.gateway_id}"
        )
        gw = Gateway(config, client, counter, meters)
        if tracing is not None:
            tracing.instrument(gw)
        await gw.start()
        tenants.share(TenantSlots(client, gw.keys, config.gateway_id))  # max_concurrent across the gateways
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
