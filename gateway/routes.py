"""The routes' handlers: a completion (chat, text, Responses) from its body to its answer, health and metrics."""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from flying.messages import Priority
from gateway import tenants as tenancy
from gateway.api import batch, engine_fields, responses, schemas
from gateway.api.errors import (
    APIError,
    ContextTooLong,
    Draining,
    InvalidRequest,
    QueueUnavailable,
)
from gateway.api.replies import RelayResponse, json_reply
from gateway.http import body as body_of
from gateway.http.disconnect import ClientGone, watcher
from gateway.request_log import info as request_info
from gateway.service import Gateway, Reply

log = logging.getLogger("flying.gateway")


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
    req = schemas.parse(body, kind)
    priority = tenancy.prioritise(request, req, seen)
    if isinstance(req, schemas.CompletionRequest):
        parts = schemas.split_prompts(req)
        if len(parts) > 1:
            return await batch.answer_batch(request, gw, parts, priority, t0)
        req = parts[0]
    return await answer_one(request, gw, req, priority, t0)


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
