"""Talking to the engines' SGLang HTTP servers.

Requests, streaming or not (the gateway's hot path), go over a small HTTP/1.1 client of its own: keep-alive
connections pooled per engine, each an asyncio protocol whose bytes httptools parses (chunked encoding included) as
they arrive. A reader takes every complete line that has arrived in one go (``aiter_batches``), so the events of
one socket read cost one wake-up and one write to the client, and no read creates a task. It costs a fraction of a
millisecond per request where httpx costs about three on a 2-core machine (``benchmarks/router_hop.py``), which
was most of what the gateway added to a request. Aborts use one pooled httpx client.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit

import httptools
import httpx
import msgspec

from gateway.observer import NOTHING, Observer

CONNECT_TIMEOUT_S = 3.0
# a stream given up after its last event: how long its end may take before the connection closes
DRAIN_S = 1.0
ABORTS_AT_ONCE = 32  # abort POSTs in flight to one engine (the rest wait their turn) ...
ABORTS_IN_ALL = 128  # ... and to all engines, per gateway process
ABORT_TIMEOUT_S = 2.0  # an engine that does not take an abort in this time is not waited for
MAX_IDLE = 512  # pooled keep-alive connections per engine (fewer: a burst beyond them reconnects, and churns)
PAUSE_BYTES = 1 << 20  # an unread body this large pauses reading from the engine
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


class WorkerUnavailable(Exception):
    """The assigned engine could not be reached or died before answering; ``engine_fault`` False: it is fine, but
    could not serve the request (its TP group lost a member), so its circuit breaker does not count it;
    ``counted`` False: nothing failed (its group was parked before its first token), so the request's re-dispatch
    does not count toward its ``max_attempts``; ``died``: the engine had the request and its connection broke
    (the request is suspect: gateway.waiting)."""

    def __init__(
        self, message: str, engine_fault: bool = True, counted: bool = True, died: bool = False
    ) -> None:
        super().__init__(message)
        self.engine_fault, self.counted, self.died = engine_fault, counted, died


def unreachable(exc: BaseException) -> str:
    """Why an engine could not be reached, in words and without its address (the message reaches clients; the
    engine's number, which the callers add, is what ``flyctl status`` lists)."""
    if isinstance(exc, TimeoutError):
        return "the engine did not answer in time"
    if isinstance(exc, ConnectionRefusedError):
        return "the engine refused the connection"
    if isinstance(exc, ConnectionResetError):
        return f"the engine's connection ended: {exc}"
    if isinstance(exc, OSError) and exc.errno:  # (its strerror may be asyncio's, naming the address)
        return f"the engine could not be reached ({os.strerror(exc.errno)})"
    return f"the engine could not be reached ({type(exc).__name__})"


class StreamBroken(Exception):
    """The engine's connection failed or closed in the middle of a response."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection to an engine; the current response's status, headers and body as they arrive."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        # called once when the current response's end arrives
        self.on_complete: Callable[[], None] | None = None
        self.reset()

    def reset(self) -> None:
        self.status, self.body = 0, bytearray()
        self.headers: dict[str, str] = {}
        self.headers_done = self.complete = self.keep_alive = False

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status, self.headers_done = self.parser.get_status_code(), True

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete, self.keep_alive = True, self.parser.should_keep_alive()  # (not known after this call)
        if self.on_complete is not None:
            done, self.on_complete = self.on_complete, None
            done()

    # -- asyncio protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = StreamBroken(f"engine sent a malformed response: {exc!r}")
            self.close()
        if len(self.body) > PAUSE_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.error is None and not self.complete:
            self.error = StreamBroken(
                f"engine closed the connection ({exc!r})" if exc else "engine closed the stream"
            )
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self, timeout_s: float) -> None:
        """Until more arrives, the connection ends, or ``timeout_s`` passes (TimeoutError). (A timer on the
        future rather than ``asyncio.timeout``: this runs a few times per request.)"""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout_s, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def take(self) -> bytes:
        out = bytes(self.body)
        self.body.clear()
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return out

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.closed = True


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class StreamResponse:
    """An engine's answer whose body is still arriving: ``status_code`` and ``headers`` now, then
    ``aiter_batches()``/``aiter_lines()`` or ``aread()``. Its connection goes back to the pool once the body has
    been read to its end (or, after ``finish()``, once the end arrives); ``aclose()`` before that closes it."""

    def __init__(self, upstream: Upstream, key: tuple[str, int], conn: _Conn) -> None:
        self._upstream, self._key = upstream, key
        self._conn: _Conn | None = conn
        self.status_code, self.headers = conn.status, conn.headers
        self.content = b""
        self._rest = b""  # the start of a line whose end has not arrived

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self):
        return _decode(self.content)

    async def _data(self) -> bytes | None:
        """The body's bytes that have arrived since the last call (waiting for some); None at its end."""
        conn = self._conn
        assert conn is not None, "read after close"
        while True:
            if conn.body:
                return conn.take()
            if conn.complete:
                self._release()
                return None
            if conn.error is not None or conn.closed:
                await self.aclose()
                raise conn.error or StreamBroken("engine closed the stream")
            try:
                await conn.wait(self._upstream.read_timeout_s)
            except TimeoutError as exc:
                await self.aclose()
                raise StreamBroken(f"engine sent nothing for {self._upstream.read_timeout_s:.0f} s") from exc

    async def batch(self) -> list[str] | None:
        """The body's next lines (without line ends): every complete one that has arrived, at least one (waiting
        for it); None at the body's end. A coroutine, not a generator: the relay's hot path reads through it."""
        while self._conn is not None:
            data = await self._data()
            if data is None:
                break
            *lines, self._rest = (self._rest + data).split(b"\n")
            if lines:
                return [line.rstrip(b"\r").decode() for line in lines]
        if self._rest:
            rest, self._rest = self._rest, b""
            return [rest.decode()]
        return None

    async def aiter_batches(self) -> AsyncIterator[list[str]]:
        """The body's lines (without line ends), as lists of those that arrived together."""
        while (lines := await self.batch()) is not None:
            yield lines

    async def aiter_lines(self) -> AsyncIterator[str]:
        async for batch in self.aiter_batches():
            for line in batch:
                yield line

    async def aread(self) -> bytes:
        parts = []
        while self._conn is not None and (data := await self._data()) is not None:
            parts.append(data)
        self.content = b"".join(parts)
        return self.content

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._upstream._release(self._key, conn)

    def finish(self) -> None:
        """The reader is done (e.g. it saw ``[DONE]``): the connection goes back to the pool when the response's
        end arrives (usually it has), or closes if that takes longer than DRAIN_S."""
        conn = self._conn
        if conn is None:
            return
        conn.take()
        if conn.complete:
            self._release()
            return
        if conn.closed:
            self._conn = None
            return
        timer = asyncio.get_running_loop().call_later(DRAIN_S, self._give_up)

        def ended() -> None:
            timer.cancel()
            conn.take()
            self._release()

        conn.on_complete = ended

    def _give_up(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.on_complete = None
            conn.close()

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.complete and not conn.body:
            self._upstream._release(self._key, conn)
        else:  # not read to its end: the connection cannot be reused
            conn.close()


class Upstream:
    """Calls to the engines: streams and whole answers over pooled connections, and aborts; each call reported to
    ``observer`` (gateway.observer)."""

    def __init__(self, read_timeout_s: float, observer: Observer = NOTHING) -> None:
        self.read_timeout_s = read_timeout_s
        self.observer = observer
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=read_timeout_s, write=30.0, pool=30.0),
            limits=httpx.Limits(max_connections=2048, max_keepalive_connections=256),
        )
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._keys: dict[str, tuple[str, int]] = {}
        # aborts in flight at most: a batch of prompts x n choices whose client left is one POST per choice, and
        # thousands at once starved the event loop in httpx's pool (each waiting request scans every connection);
        # per engine too, so that one that does not answer holds up no other engine's aborts
        self._aborts = asyncio.Semaphore(ABORTS_IN_ALL)
        self._engine_aborts: dict[str, asyncio.Semaphore] = {}

    async def close(self) -> None:
        await self.client.aclose()
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()

    def _release(self, key: tuple[str, int], conn: _Conn) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) < MAX_IDLE and not conn.closed and conn.error is None and conn.keep_alive:
            conn.reset()
            idle.append(conn)
        else:
            conn.close()

    def _key(self, url: str) -> tuple[str, int]:
        key = self._keys.get(url)
        if key is None:
            u = urlsplit(url)
            key = self._keys[url] = (u.hostname or "127.0.0.1", u.port or 80)
        return key

    async def _connect(self, key: tuple[str, int]) -> _Conn:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            _, conn = await loop.create_connection(_Conn, *key)
        return conn

    async def open_stream(
        self, url: str, path: str, body: dict, headers: dict[str, str] | None = None
    ) -> StreamResponse:
        """Send a streaming request (with ``headers`` besides its own, e.g. a ``traceparent``) and return once the
        response headers arrive (body still streaming). A pooled connection the engine closed while idle is
        replaced once, transparently."""
        return await self._observed(url, path, body, headers, stream=True)

    async def _send(
        self, url: str, path: str, body: dict, accept: str, headers: dict[str, str] | None
    ) -> StreamResponse:
        key = self._key(url)
        payload = _encode(body)
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()) if headers else ""
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {key[0]}:{key[1]}\r\ncontent-type: application/json\r\n"
            f"accept: {accept}\r\ncontent-length: {len(payload)}\r\n{extra}\r\n"
        ).encode()
        idle = self._idle.get(key) or []
        while idle and idle[-1].closed:
            idle.pop()
        broke = False  # a kept-alive connection took the request and broke: stale, or the engine died
        for reused in (True, False):
            conn = idle.pop() if reused and idle else None
            if conn is None and reused:
                continue
            written = False
            try:
                if conn is None:
                    conn = await self._connect(key)
                assert conn.transport is not None
                conn.transport.write(head + payload)
                written = True
                while not conn.headers_done:
                    if conn.error is not None or conn.closed:
                        raise ConnectionResetError(f"closed before answering ({conn.error})")
                    await conn.wait(self.read_timeout_s)
                return StreamResponse(self, key, conn)
            except (TimeoutError, OSError) as exc:
                if conn is not None:
                    conn.close()
                broke = broke or (written and not isinstance(exc, TimeoutError))
                if not reused:
                    # the engine died holding it: sent, and the connection broke; or the kept-alive one broke
                    # and the engine now refuses connections
                    died = (written and not isinstance(exc, TimeoutError)) or (
                        broke and isinstance(exc, ConnectionRefusedError)
                    )
                    raise WorkerUnavailable(unreachable(exc), died=died) from exc
            except BaseException:  # cancelled (its client left): a connection mid-request cannot be reused
                if conn is not None:
                    conn.close()
                raise
        raise AssertionError("unreachable")

    async def post(
        self, url: str, path: str, body: dict, headers: dict[str, str] | None = None
    ) -> StreamResponse:
        """A non-streaming request's whole answer (``status_code``, ``content``, ``json()``). Raises
        WorkerUnavailable when the engine cannot be reached, sends nothing for the read timeout, or its
        connection breaks before the answer's end."""
        return await self._observed(url, path, body, headers, stream=False)

    async def _observed(
        self, url: str, path: str, body: dict, headers: dict[str, str] | None, stream: bool
    ) -> StreamResponse:
        """One call to the engine (a stream's head, or a whole answer), reported to the observer."""
        headers = dict(headers or {})
        handle = self.observer.relaying(body, url, path, stream, headers)
        try:
            if stream:
                resp = await self._send(url, path, body, "text/event-stream", headers)
            else:
                resp = await self._whole(url, path, body, headers)
        except BaseException as exc:
            self.observer.relay_failed(handle, exc)
            raise
        self.observer.relayed(handle, body, stream, resp.status_code)
        return resp

    async def _whole(self, url: str, path: str, body: dict, headers: dict[str, str]) -> StreamResponse:
        resp = await self._send(url, path, body, "application/json", headers)
        try:
            await resp.aread()
        except StreamBroken as exc:
            raise WorkerUnavailable(str(exc), died=True) from exc
        except BaseException:  # cancelled (its client left) with the answer half read: not reusable
            await resp.aclose()
            raise
        return resp

    async def abort(self, url: str, *rids: str) -> None:
        """Stop a request on its engine (SGLang keeps decoding after a client disconnect otherwise): each of the
        ids SGLang runs it as (one per choice)."""

        engine = self._engine_aborts.setdefault(url, asyncio.Semaphore(ABORTS_AT_ONCE))

        async def one(rid: str) -> None:
            async with engine, self._aborts:
                with contextlib.suppress(httpx.HTTPError):
                    await self.client.post(f"{url}/abort_request", json={"rid": rid}, timeout=ABORT_TIMEOUT_S)

        await asyncio.gather(*(one(rid) for rid in rids))
