"""A completion of several prompts (``prompt`` a list of strings or of token-id lists): each prompt is served as a
request of its own (queued, prioritised and dispatched like any other), and their answers become one, with the
choices numbered as OpenAI does: prompt ``i``'s choice ``j`` is index ``i * n + j``. Non-streaming, the answers
merge with the usage summed (:func:`merge_completions`); streaming, the streams interleave as their chunks come,
each chunk's choices renumbered, the per-prompt usage chunks summed into one at the end, and one ``[DONE]``
(:func:`merge_streams`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from flying.messages import Priority
from gateway import tenants as tenancy
from gateway.api import schemas
from gateway.api.engine_fields import StreamId
from gateway.api.errors import APIError, InvalidRequest
from gateway.api.replies import RelayResponse, json_reply
from gateway.backpressure import queue_room
from gateway.http.disconnect import ClientGone, watcher
from gateway.relay import DONE
from gateway.request_log import info as request_info
from gateway.service import Gateway, Reply
from gateway.tenants import Tenant

COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def check_fits(n: int, max_queue: int, priority: str, tenant: Tenant | None) -> None:
    """A batch of ``n`` prompts is queued as ``n`` requests: one that could never be admitted whole (more than
    its priority's share of the queue, or more requests than its tenant's bucket holds) is a 400 that says so,
    not a 429 whose Retry-After can never work."""
    room = queue_room(max_queue, priority)
    if n > room:
        raise InvalidRequest(
            f"prompt holds {n} prompts, more than the queue takes at {priority} priority ({room}); "
            "send fewer prompts per request",
            param="prompt",
        )
    if tenant is not None and tenant.requests_per_s:
        burst = max(1, int(tenant.requests_per_s))
        if n > burst:
            raise InvalidRequest(
                f"prompt holds {n} prompts, each a request, and this API key may send {burst} at once "
                f"(requests_per_s {tenant.requests_per_s:g}); send at most {burst} prompts per request",
                param="prompt",
            )


def merge_completions(bodies: list[dict], n: int, request_id: str) -> dict:
    """The answers to a batch's prompts as one: the batch's id, every choice renumbered, the usage summed."""
    out = dict(bodies[0], id=request_id)
    out["choices"] = [
        c | {"index": i * n + int(c.get("index", 0))}
        for i, b in enumerate(bodies)
        for c in b.get("choices") or ()
    ]
    usage = sum_usage([b.get("usage") for b in bodies])
    if usage is not None:
        out["usage"] = usage
    return out


def sum_usage(usages: Sequence[Any]) -> dict | None:
    """The usages summed (cached prompt tokens too); None if none is a dict."""
    given = [u for u in usages if isinstance(u, dict)]
    if not given:
        return None
    usage: dict[str, object] = {k: sum(int(u.get(k) or 0) for u in given) for k in COUNTS}
    details = [u["prompt_tokens_details"] for u in given if isinstance(u.get("prompt_tokens_details"), dict)]
    if details:
        usage["prompt_tokens_details"] = {
            "cached_tokens": sum(int(d.get("cached_tokens") or 0) for d in details)
        }
    return dict(given[0]) | usage


async def merge_streams(
    streams: list[AsyncGenerator[bytes, None]], n: int, include_usage: bool, request_id: str | None = None
) -> AsyncGenerator[bytes, None]:
    """The prompts' SSE streams as one: chunks as they come, choices renumbered, then the summed usage (when asked)
    and ``[DONE]``. Each stream is read to its end by a task of its own; closing this one cancels them (each
    relay's cleanup then runs: the engine's abort, the slot freed)."""
    queue: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[bytes, None]) -> None:
        try:
            async for chunk in stream:
                await queue.put((i, chunk))
        finally:
            queue.put_nowait((i, None))

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    tails: list[dict] = []
    stream_id = StreamId(request_id)  # one id for the merged stream (each prompt's stream has its own)
    try:
        left = len(streams)
        while left:
            i, chunk = await queue.get()
            if chunk is None:
                left -= 1
                continue
            out = b"".join(_renumbered(chunk, i, n, tails, stream_id))
            if out:
                yield out
        if include_usage and tails:
            tail = tails[0] | {"usage": sum_usage([t["usage"] for t in tails])}
            yield b"data: " + _encode(tail) + b"\n\n" + DONE
        else:
            yield DONE
    finally:
        for p in pumps:
            p.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*pumps, return_exceptions=True)


def _renumbered(chunk: bytes, i: int, n: int, tails: list[dict], stream_id: StreamId) -> list[bytes]:
    """One stream's events with prompt ``i``'s choices renumbered and the merged stream's id; its usage-only
    chunk kept aside in ``tails`` (summed at the end); its ``[DONE]`` dropped (the merged stream has one)."""
    out = []
    for event in chunk.split(b"\n\n"):
        if not event.startswith(b"data:"):
            continue
        payload = event[5:].strip()
        if payload == b"[DONE]":
            continue
        try:
            doc = _decode(payload)
        except msgspec.DecodeError:
            out.append(event + b"\n\n")
            continue
        stream_id.apply(doc)
        if isinstance(doc, dict) and isinstance(doc.get("choices"), list):
            if not doc["choices"] and doc.get("usage") is not None:
                tails.append(doc)
                continue
            for c in doc["choices"]:
                if isinstance(c, dict):
                    c["index"] = i * n + int(c.get("index") or 0)
        out.append(b"data: " + _encode(doc) + b"\n\n")
    return out


def unstarted(replies: Sequence[Any]) -> None:
    """Clean up the streams of ``replies`` that will never be read (their client left, or another prompt failed)."""
    for reply in replies:
        if getattr(reply, "unstarted", None) is not None:
            reply.unstarted()


async def answer_batch(
    request: Request, gw: Gateway, reqs: list[schemas.CompletionRequest], priority: Priority, t0: float
) -> Response:
    """A completion of several prompts: each admitted and queued as a request of its own (``<id>-<i>``), served
    concurrently; one answer (or one stream) with the choices numbered as OpenAI does (:mod:`gateway.api.batch`)."""
    logged = request_info(request.scope)
    base = logged.request_id or uuid.uuid4().hex
    check_fits(len(reqs), gw.config.max_queue, priority, tenancy.current.get())
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
            relay = merge_streams(streams, n, usage, base)
            streaming = True
            return RelayResponse(relay, headers, functools.partial(unstarted, replies), disconnected)
        merged = merge_completions([r.body for r in replies if r.body is not None], n, base)
        return json_reply(gw, Reply(200, replies[0].assignment, body=merged), headers)
    except ClientGone:
        return Response(status_code=499)
    finally:
        if not streaming:
            disconnected.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            unstarted([t.result() for t in tasks if not t.cancelled() and t.exception() is None])
