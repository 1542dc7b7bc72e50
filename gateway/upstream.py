"""Talking to the engines' SGLang HTTP servers.

Streams, the gateway's hot path, go over a small HTTP/1.1 client of its own: keep-alive connections pooled per
engine, chunked SSE read straight off the socket. It costs a fraction of a millisecond per request where httpx
costs about three on a 2-core machine (``benchmarks/gateway_hop.py``), which is most of what the gateway adds to
a request's TTFT. Everything else (non-streaming requests, aborts) uses one pooled httpx client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx

log = logging.getLogger("flying.gateway")
CONNECT_TIMEOUT_S = 3.0


class WorkerUnavailable(Exception):
    """The assigned engine could not be reached or died before answering."""


class StreamBroken(Exception):
    """The engine's connection failed or closed in the middle of a response."""


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class StreamResponse:
    """An engine's answer whose body is still arriving: ``status_code`` and ``headers`` now, then
    ``aiter_lines()`` (a chunked SSE stream) or ``aread()``. Its connection goes back to the pool once the body
    has been read to its end; ``aclose()`` before that closes it."""

    def __init__(
        self, upstream: Upstream, key: tuple[str, int], conn: _Conn, status: int, headers: dict
    ) -> None:
        self._upstream, self._key = upstream, key
        self._conn: _Conn | None = conn
        self.status_code, self.headers = status, headers
        self.content = b""
        self._done = False

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self):
        return json.loads(self.content)

    async def _read(self, coro):
        try:
            return await asyncio.wait_for(coro, self._upstream.read_timeout_s)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
            await self.aclose()
            raise StreamBroken(f"engine connection failed: {exc!r}") from exc

    async def _chunks(self) -> AsyncIterator[bytes]:
        assert self._conn is not None, "read after close"
        r = self._conn.reader
        if "chunked" not in self.headers.get("transfer-encoding", ""):
            self.content = await self._read(r.readexactly(int(self.headers.get("content-length", "0"))))
            self._finish()
            yield self.content
            return
        while True:
            line = (await self._read(r.readline())).split(b";")[0].strip()
            try:
                size = int(line, 16)
            except ValueError:
                await self.aclose()
                raise StreamBroken(f"engine closed the stream (chunk header {line[:20]!r})") from None
            if size == 0:
                await self._read(r.readline())  # the blank line after the last chunk (no trailers)
                self._finish()
                return
            data = await self._read(r.readexactly(size + 2))
            yield data[:-2]

    async def aiter_lines(self) -> AsyncIterator[str]:
        buf = b""
        async for chunk in self._chunks():
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode()
        if buf:
            yield buf.decode()
        if not self._done:
            raise StreamBroken("engine closed the stream")

    async def aread(self) -> bytes:
        self.content = b"".join([c async for c in self._chunks()])
        return self.content

    def _finish(self) -> None:
        self._done = True
        if self._conn is not None:
            self._upstream._release(self._key, self._conn)
            self._conn = None

    async def aclose(self) -> None:
        if self._conn is not None:  # not read to its end: the connection cannot be reused
            self._conn.close()
            self._conn = None


class Upstream:
    def __init__(self, read_timeout_s: float) -> None:
        self.read_timeout_s = read_timeout_s
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=read_timeout_s, write=30.0, pool=30.0),
            limits=httpx.Limits(max_connections=2048, max_keepalive_connections=256),
        )
        self._idle: dict[tuple[str, int], list[_Conn]] = {}

    async def close(self) -> None:
        await self.client.aclose()
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()

    def _release(self, key: tuple[str, int], conn: _Conn) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) < 64 and not conn.writer.is_closing():
            idle.append(conn)
        else:
            conn.close()

    async def open_stream(self, url: str, path: str, body: dict) -> StreamResponse:
        """Send the request and return once the response headers arrive (body still streaming). A pooled
        connection the engine closed while idle is replaced once, transparently."""
        u = urlsplit(url)
        key = (u.hostname or "127.0.0.1", u.port or 80)
        payload = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {key[0]}:{key[1]}\r\ncontent-type: application/json\r\n"
            f"accept: text/event-stream\r\ncontent-length: {len(payload)}\r\n\r\n"
        ).encode()
        idle = self._idle.get(key) or []
        for reused in (True, False):
            conn = idle.pop() if reused and idle else None
            if conn is None and reused:
                continue
            try:
                if conn is None:
                    conn = _Conn(*await asyncio.wait_for(asyncio.open_connection(*key), CONNECT_TIMEOUT_S))
                conn.writer.write(head + payload)
                status_line = await asyncio.wait_for(conn.reader.readline(), self.read_timeout_s)
                if not status_line:
                    raise ConnectionResetError("closed before answering")
                headers = {}
                while (line := await asyncio.wait_for(conn.reader.readline(), self.read_timeout_s)) not in (
                    b"\r\n",
                    b"",
                ):
                    k, _, v = line.decode("latin-1").partition(":")
                    headers[k.strip().lower()] = v.strip()
                return StreamResponse(self, key, conn, int(status_line.split()[1]), headers)
            except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
                if conn is not None:
                    conn.close()
                if not reused:
                    raise WorkerUnavailable(f"{url}: {exc!r}") from exc
        raise AssertionError("unreachable")

    async def post(self, url: str, path: str, body: dict) -> httpx.Response:
        try:
            resp = await self.client.post(url + path, json=body)
            await resp.aread()
            return resp
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectTimeout) as exc:
            raise WorkerUnavailable(f"{url}: {exc!r}") from exc

    async def abort(self, url: str, *rids: str) -> None:
        """Stop a request on its engine (SGLang keeps decoding after a client disconnect otherwise): each of the
        ids SGLang runs it as (one per choice)."""

        async def one(rid: str) -> None:
            with contextlib.suppress(httpx.HTTPError):
                await self.client.post(f"{url}/abort_request", json={"rid": rid}, timeout=5)

        await asyncio.gather(*(one(rid) for rid in rids))
