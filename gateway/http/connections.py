"""Connection limits: what the gateway refuses at the door, before a request reaches the application. uvicorn's
httptools protocol has no bound on a request's head, and times out only a keep-alive connection that has already
answered; :func:`guarded_protocol` is that protocol with the limits of a :class:`ConnectionLimits`:

- the request line's URL beyond ``max_url_bytes``: 414;
- more than ``max_header_count`` header fields, or more than ``max_header_bytes`` of them (names and values): 431;
  a head that grows past what those allow without ending is refused while it arrives, never buffered whole;
- a request head not complete within ``header_timeout_s`` of its first byte (or of the connection's start): 408,
  and a connection that sent nothing in that time is closed;
- beyond ``max_connections`` open connections: the new one's requests get 503 with ``Retry-After``.

An idle or silent connection is never closed while bytes from the client wait unread in its socket: under load
the event loop can run a due timer before it reads what arrived meanwhile (uvloop runs timers before it polls the
sockets), and closing then would drop a request the client has sent on a connection it had every right to use
(the client sees a reset, not an answer). Such a connection's timer is armed again instead, and the request is
read and answered. (A head that has begun arriving gets its 408 on time.)

The refusals are OpenAI-shaped JSON with ``Connection: close``; after one the connection reads and drops what the
client still sends for a moment (so the client, still writing, gets the answer rather than a reset), then closes.
The idle keep-alive timeout is uvicorn's ``timeout_keep_alive``, with that guard.

Each request's scope holds the future its connection completes when it closes (:data:`gateway.http.disconnect
.DISCONNECTED`): the request's disconnect watcher without a task of its own. (A client that pipelines requests
has its connection's reading paused while one is answered, as uvicorn does: its leaving is seen when reading
resumes.)"""

from __future__ import annotations

import asyncio
import json
import select
import sys
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.api.errors import APIError, HeadersTooLarge, RequestTimeout, TooManyConnections, URITooLong
from gateway.http.disconnect import DISCONNECTED

LINGER_S = 2.0  # after a refusal: how long what the client still sends is read and dropped before closing


@dataclass(frozen=True)
class ConnectionLimits:
    max_header_bytes: int = 16384
    max_header_count: int = 100
    max_url_bytes: int = 8192
    header_timeout_s: float = 10.0
    max_connections: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_header_count", "max_url_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0, got {self.header_timeout_s!r}")

    @property
    def max_head_bytes(self) -> int:
        """Raw bytes an unfinished request head may reach: the URL, the fields, their separators, the line."""
        return self.max_url_bytes + self.max_header_bytes + 4 * self.max_header_count + 1024


class _Refused(Exception):
    """Raised in a parser callback to stop parsing; the protocol answers with ``error``."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


def raw_response(error: APIError) -> bytes:
    """``error`` as a complete HTTP/1.1 response that closes the connection."""
    body = json.dumps(error.body()).encode()
    reason = {408: "Request Timeout", 414: "URI Too Long", 431: "Request Header Fields Too Large"}
    head = [
        f"HTTP/1.1 {error.status} {reason.get(error.status, 'Error')}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    if error.retry_after_s is not None:
        head.append(f"retry-after: {error.retry_after_s}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def _too_many_connections(scope: Any, receive: Any, send: Any) -> None:
    """The ASGI app a connection beyond the cap is served by: 503 with Retry-After, then close."""
    err = TooManyConnections("the gateway has too many open connections; retry later", retry_after_s=1)
    await err.response({"Connection": "close"})(scope, receive, send)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the :class:`ConnectionLimits` of :attr:`limits`."""

    limits = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # between a request's first byte (or the connection's start) and its complete head
        self.in_head = True
        self.head_bytes = self.url_bytes = self.field_bytes = self.fields = 0
        self.head_timer: asyncio.TimerHandle | None = None
        self.refusal: APIError | None = None
        self.watchers: list[tuple[Any, asyncio.Future[None]]] = []  # (request cycle, its disconnect future)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.app = _too_many_connections  # this connection's requests only
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)
        for _, fut in self.watchers:
            if not fut.done():
                fut.set_result(None)
        self.watchers.clear()

    def timeout_keep_alive_handler(self) -> None:
        """uvicorn's idle keep-alive timeout: closes the connection, unless the client has sent more meanwhile."""
        if self._unread():
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
            return
        super().timeout_keep_alive_handler()

    def data_received(self, data: bytes) -> None:
        if self.refusal is not None:  # refused: drop what the client still sends until the linger ends
            return
        super().data_received(data)
        if self.refusal is None and self.in_head:
            self.head_bytes += len(data)
            if self.head_bytes > self.limits.max_head_bytes:
                self._refuse(HeadersTooLarge(f"the request head exceeds {self.limits.max_head_bytes} bytes"))

    # -- parser callbacks ---------------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.in_head = True
        self.url_bytes = self.field_bytes = self.fields = 0
        if self.head_timer is None:
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self.url_bytes += len(url)
        if self.url_bytes > self.limits.max_url_bytes:
            raise _Refused(URITooLong(f"the URL exceeds {self.limits.max_url_bytes} bytes"))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields += 1
        self.field_bytes += len(name) + len(value)
        limits = self.limits
        if self.fields > limits.max_header_count:
            raise _Refused(
                HeadersTooLarge(f"the request has more than {limits.max_header_count} header fields")
            )
        if self.field_bytes > limits.max_header_bytes:
            raise _Refused(
                HeadersTooLarge(f"the request's header fields exceed {limits.max_header_bytes} bytes")
            )
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self.in_head, self.head_bytes = False, 0
        self._cancel_head_timer()
        super().on_headers_complete()
        cycle = getattr(self, "cycle", None)
        if cycle is None or cycle.scope is not self.scope:  # (an upgrade: no request cycle)
            return
        # the earlier requests' futures, once answered, are no longer watched
        self.watchers = [(c, f) for c, f in self.watchers if not (c.response_complete or f.done())]
        fut = self.loop.create_future()
        self.scope[DISCONNECTED] = fut
        self.watchers.append((cycle, fut))

    def send_400_response(self, msg: str) -> None:
        """uvicorn answers a parser error (a callback's exception included) here: a refusal is answered as such."""
        refused = self._refusal_in_flight()
        if refused is None:
            super().send_400_response(msg)
        else:
            self._refuse(refused)

    # -- refusals ---------------------------------------------------------------------------------------------
    def _refusal_in_flight(self) -> APIError | None:
        exc = sys.exc_info()[1]
        cause = exc.__context__ if exc is not None else None
        return cause.error if isinstance(cause, _Refused) else None

    def _refuse(self, error: APIError) -> None:
        self.refusal = error
        self._cancel_head_timer()
        if self.transport.is_closing():
            return
        self.transport.write(raw_response(error))
        self.loop.call_later(LINGER_S, self.transport.close)

    def _unread(self) -> bool:
        """Bytes from the client (or its end) wait in the socket, not yet read by the event loop."""
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return False
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    def _arm_head_timer(self) -> None:
        self.head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.transport.is_closing() or not self.in_head:
            return
        if self.head_bytes == 0 and self.url_bytes == 0 and self.fields == 0:  # sent nothing read yet
            if self._unread():  # its head arrived while the loop was busy: read and answer it
                self._arm_head_timer()
            else:
                self.transport.close()
            return
        secs = self.limits.header_timeout_s
        self._refuse(RequestTimeout(f"the request head did not arrive within {secs:g} s"))


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedProtocol]:
    """The protocol class (uvicorn's ``http=``) that enforces ``limits``."""
    return type("GuardedProtocol", (GuardedProtocol,), {"limits": limits})
