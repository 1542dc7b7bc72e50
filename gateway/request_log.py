"""Request ids and the gateway's request log: one INFO line per ``/v1/*`` request, written when its response ends
(a stream at its last byte).

The id: a client's ``X-Request-Id`` when it is 1..128 characters of ``[A-Za-z0-9._:-]``, otherwise (absent or not
valid) a fresh one (32 hex digits). The same id is the request's Redis record and the router's assignment line, the
engine's SGLang ``rid`` is ``<id>~<attempt>`` (flying.messages.engine_rid), and the id is echoed in the response's ``X-Request-Id`` (errors included). A client's id that a
record already holds (a request in flight, or one finished within the record's TTL) is not reused: the request
runs as ``<id>-<8 hex digits>`` (see :meth:`gateway.service.Gateway.serve`), which is echoed, and a grep for the
client's id still finds it.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flying import logs
from flying.messages import Assignment

log = logging.getLogger("flying.gateway.requests")
_VALID_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
HEADER = "x-request-id"
_HEADER = HEADER.encode()


def request_id(header: str | None) -> str:
    """The client's id if it is valid, else a fresh one."""
    if header is not None and _VALID_ID.fullmatch(header):
        return header
    return os.urandom(16).hex()


@dataclass(slots=True)
class RequestInfo:
    """What the request's log line says, filled in by the handler as it learns it (``scope["state"]``)."""

    request_id: str
    client_id: bool = False  # the id is the client's (X-Request-Id), not one the gateway made
    priority: str = "-"  # the priority it runs at
    requested_priority: str | None = None  # the one asked for, when its tenant's limit lowered it
    engine: int | None = None
    queue_ms: float | None = None

    def assigned(self, a: Assignment) -> None:
        """The request was assigned (again): the line names the id it ran under and where, even if it then
        failed or its client left."""
        self.request_id, self.engine, self.queue_ms = a.id, a.engine, a.queue_ms


def info(scope: Scope) -> RequestInfo:
    """The request's :class:`RequestInfo` (made here for a request the middleware did not see, e.g. in tests)."""
    state = scope.setdefault("state", {})
    if "flying" not in state:
        state["flying"] = RequestInfo(request_id(None))
    return state["flying"]


class RequestLog:
    """ASGI middleware for ``/v1/*``: picks the request id, sets ``X-Request-Id`` on the response, and logs the
    request when its response ends (or its handler raised: status 500)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope["headers"] if k == _HEADER), None)
        asked = header.decode("latin-1") if header is not None else None
        req = RequestInfo(rid := request_id(asked), client_id=rid == asked)
        scope.setdefault("state", {})["flying"] = req
        start, status = time.monotonic(), 500

        async def send_logged(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                _set_id(message, req.request_id)
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        finally:
            _log(scope, req, status, (time.monotonic() - start) * 1000)


def _set_id(message: Message, rid: str) -> None:
    """The response head's ``X-Request-Id`` set to ``rid`` (the handler's own replaced)."""
    headers = message.get("headers")
    if not isinstance(headers, list):  # (another iterable: Starlette's general way)
        MutableHeaders(scope=message)["X-Request-Id"] = rid
        return
    headers[:] = [h for h in headers if h[0] != _HEADER]
    headers.append((_HEADER, rid.encode("latin-1")))


def _log(scope: Scope, req: RequestInfo, status: int, duration_ms: float) -> None:
    engine = "-" if req.engine is None else str(req.engine)
    queue = "-" if req.queue_ms is None else f"{req.queue_ms:.1f}"
    asked = "" if req.requested_priority is None else f" requested_priority={req.requested_priority}"
    extra = {
        "request_id": req.request_id,
        "status": status,
        "priority": req.priority,
        "engine": req.engine,
        "queue_ms": req.queue_ms,
        "duration_ms": round(duration_ms, 1),
    }
    if req.requested_priority is not None:
        extra["requested_priority"] = req.requested_priority
    msg = (
        f"request {req.request_id} {scope['method']} {scope['path']} status={status} priority={req.priority}"
        f"{asked} engine={engine} queue_ms={queue} duration_ms={duration_ms:.1f}"
    )
    if (direct := logs.direct(log)) is not None:  # a line per request: no LogRecord (~8 % of a request's CPU)
        direct.line(log.name, msg, extra)
    else:
        log.info("%s", msg, extra=extra)
