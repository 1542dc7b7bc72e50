"""One Redis connection that pipelines every call made on it: the gateway's per-request scripts (admission,
finish) without redis-py's per-call cost.

redis-py's asyncio client spends 150-200 us of CPU per ``EVALSHA`` (pool checkout, retry and event wrappers, a
parser in Python); this connection spends about 40 (``benchmarks/gateway_throughput.py`` counts the gateway's CPU
per request). A call made while replies are pending is written with the other calls of its event-loop turn in one
``write`` (one made with none pending, at light load, at once), and replies are matched to callers in order (Redis
answers a connection's commands in the order they came), so concurrent callers share round trips:
auto-pipelining, as ioredis and Lettuce do it. Replies are parsed by ``hiredis``.

Failures are redis-py's exceptions, so callers handle them as before: ``ConnectionError`` for a call whose
connection is lost or cannot be opened (a call that was sent may or may not have run), ``ResponseError`` for an
error reply. A lost connection is opened again by the next call, so a Redis restart costs the calls in flight at
that moment and nothing after. A script's SHA is loaded again once when Redis answers ``NOSCRIPT`` (a restarted
Redis, or a promoted replica, has forgotten it).

With ``locate`` (Redis Sentinel: ask the sentinels for the primary) the address is looked up at each connection, a
connection that cannot be opened is tried again with backoff for up to ``reconnect_s`` (nothing was sent, so
nothing runs twice), and a ``READONLY`` answer (a primary demoted while this connection stayed open) closes the
connection and raises ``ConnectionError``: the command did not run, and the next call goes to the new primary.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import hiredis
from redis.exceptions import ConnectionError, ResponseError

Arg = str | bytes | int | float


class AutoPipeline:
    """Calls on one lazily opened connection to ``host:port`` (or the unix socket ``path``)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 6379,
        db: int = 0,
        password: str | None = None,
        username: str | None = None,
        path: str | None = None,
        client_name: str | None = None,
        connect_timeout_s: float = 2.0,
        locate: Callable[[], Awaitable[tuple[str, int]]] | None = None,
        reconnect_s: float = 0.0,
    ) -> None:
        self.host, self.port, self.path, self.db = host, port, path, db
        self.auth = [x for x in (username, password) if x]
        self.client_name, self.connect_timeout_s = client_name, connect_timeout_s
        self.locate, self.reconnect_s = locate, reconnect_s
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None
        self._shas: dict[str, str] = {}

    @classmethod
    def like(cls, connection_kwargs: dict[str, Any], **options: Any) -> AutoPipeline:
        """The same server, database and credentials as a redis-py pool's ``connection_kwargs`` (``options``:
        ``locate``, ``reconnect_s``)."""
        kw = connection_kwargs
        return cls(
            **options,
            host=kw.get("host", "127.0.0.1"),
            port=int(kw.get("port", 6379)),
            db=int(kw.get("db", 0) or 0),
            password=kw.get("password"),
            username=kw.get("username"),
            path=kw.get("path"),
            client_name=kw.get("client_name"),
        )

    async def execute(self, *args: Arg) -> Any:
        """One command's reply (bytes, int, list, None); raises ConnectionError or ResponseError."""
        protocol = await self._ready()
        return _checked(protocol, await _gather(protocol.send(args)))[0]

    async def script(
        self, source: str, keys: Sequence[Arg], args: Sequence[Arg], wait: tuple[int, int] | None = None
    ) -> Any:
        """``EVALSHA`` of ``source`` (``SCRIPT LOAD`` first when Redis does not know it). With ``wait``
        (replicas, timeout in ms) a ``WAIT`` follows it on the same connection, one for all the calls written
        together (so concurrent writers share one wait), and the reply is the pair (reply, replicas that
        acknowledged)."""
        sha = self._shas.get(source)
        if sha is None:
            sha = self._shas[source] = hashlib.sha1(source.encode()).hexdigest()
        for loaded in (False, True):
            protocol = await self._ready()
            futures = [protocol.send(("EVALSHA", sha, len(keys), *keys, *args), batched=wait is not None)]
            if wait is not None:
                futures.append(protocol.wait_after(("WAIT", *wait)))
            replies = _checked(protocol, await _gather(*futures))
            if (
                not loaded
                and isinstance(replies[0], ResponseError)
                and str(replies[0]).startswith("NOSCRIPT")
            ):
                sha = self._shas[source] = (await self.execute("SCRIPT", "LOAD", source)).decode()
                continue
            break
        for reply in replies:
            if isinstance(reply, ResponseError):
                raise reply
        return (replies[0], replies[1]) if wait is not None else replies[0]

    async def _ready(self) -> _Protocol:
        protocol = self._protocol
        if protocol is None or protocol.lost:
            protocol = await self._connect()
        return protocol

    def script_nowait(
        self, source: str, keys: Sequence[Arg], args: Sequence[Arg]
    ) -> asyncio.Future[Any] | None:
        """``EVALSHA`` of ``source`` sent at the end of this event-loop turn (with the turn's other calls: what the
        caller does in the rest of its step, e.g. answer its client, goes first), without a coroutine: its reply's
        future (which fails with Redis's ``NOSCRIPT`` if Redis does not know the script), or None while no
        connection is open or the script has not been run through :meth:`script` yet; the caller then awaits
        :meth:`script`."""
        protocol, sha = self._protocol, self._shas.get(source)
        if protocol is None or protocol.lost or sha is None:
            return None
        return protocol.send(("EVALSHA", sha, len(keys), *keys, *args), batched=True)

    async def _connect(self) -> _Protocol:
        """The open connection; concurrent callers share one attempt."""
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._open_retrying())
        return await asyncio.shield(self._connecting)

    async def _open_retrying(self) -> _Protocol:
        """``_open``, tried again with backoff for up to ``reconnect_s`` (a failover in progress)."""
        deadline, delay = time.monotonic() + self.reconnect_s, 0.025
        while True:
            try:
                return await self._open()
            except ConnectionError:
                if time.monotonic() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _where(self) -> str:
        return self.path or f"{self.host}:{self.port}"

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        protocol: _Protocol | None = None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                if self.locate is not None:
                    self.host, self.port = await self.locate()  # raises ConnectionError when none is known
                if self.path:
                    _, protocol = await loop.create_unix_connection(_Protocol, self.path)
                else:
                    _, protocol = await loop.create_connection(_Protocol, self.host, self.port)
                setup: list[tuple[Arg, ...]] = []
                if self.auth:
                    setup.append(("AUTH", *self.auth))
                if self.db:
                    setup.append(("SELECT", self.db))
                if self.client_name:
                    setup.append(("CLIENT", "SETNAME", self.client_name))
                for cmd, reply in zip(setup, await asyncio.gather(*(protocol.send(cmd) for cmd in setup))):
                    if reply not in (b"OK", "OK"):
                        raise ResponseError(f"Redis answered {cmd[0]!s} with {reply!r}, not OK")
        except BaseException as exc:
            if protocol is not None:
                protocol.close()  # half set up (refused AUTH, a timeout): not kept, not leaked
            if not isinstance(exc, (OSError, TimeoutError)):
                raise
            raise ConnectionError(f"cannot connect to Redis at {self._where()}: {exc!r}") from exc
        assert protocol is not None
        self._protocol = protocol
        return protocol

    def close(self) -> None:
        if self._protocol is not None:
            self._protocol.close()
            self._protocol = None


async def _gather(*futures: asyncio.Future[Any]) -> list[Any]:
    """The replies (an error reply as its exception); a shared future (a batch's WAIT) is not cancelled with
    the caller. One future (a call's own reply) is awaited as it is: a caller cancelled meanwhile cancels it, and
    its reply is read and dropped when it comes (no gather and shield per call)."""
    if len(futures) == 1:
        try:
            return [await futures[0]]
        except Exception as exc:  # noqa: BLE001 - returned, as gather's return_exceptions does
            return [exc]
    return await asyncio.gather(*(asyncio.shield(f) for f in futures), return_exceptions=True)


def _checked(protocol: _Protocol, replies: list[Any]) -> list[Any]:
    """``replies``, or the connection's error raised; ``READONLY`` (a primary demoted while this connection stayed
    open: the command did not run) closes the connection and raises ConnectionError."""
    for reply in replies:
        if isinstance(reply, ResponseError) and str(reply).startswith("READONLY"):
            protocol.close()
            raise ConnectionError(f"Redis is a replica now: {reply}")
        if isinstance(reply, BaseException) and not isinstance(reply, ResponseError):
            raise reply
    return replies


class _Protocol(asyncio.Protocol):
    """The connection: commands out (one write per event-loop turn), replies in, matched in order."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader(replyError=ResponseError)
        self.waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.out: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None
        self.wait_args: Sequence[Arg] = ()
        # the WAIT that the calls written since the last one share, and the WAIT in flight
        self.wait_next: asyncio.Future[Any] | None = None
        self.wait_sent: asyncio.Future[Any] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is no asyncio.Transport subclass)

    def send(self, args: Sequence[Arg], batched: bool = False) -> asyncio.Future[Any]:
        """The reply's future; ``batched``: written with the loop turn's other calls even when nothing is in
        flight (a call that a ``wait_after`` follows)."""
        fut = asyncio.get_running_loop().create_future()
        if self.lost is not None:
            fut.set_exception(ConnectionError(f"Redis connection lost: {self.lost!r}"))
            return fut
        if (
            not batched and not self.waiting and self.transport is not None
        ):  # nothing in flight (light load): no batch to wait for
            self.transport.write(pack(args))
        else:  # with replies pending, the calls of this loop turn go out together
            if not self.out:
                asyncio.get_running_loop().call_soon(self._flush)
            self.out.append(pack(args))
        self.waiting.append(fut)
        return fut

    def wait_after(self, args: Sequence[Arg]) -> asyncio.Future[Any]:
        """The reply of ``args`` (``WAIT replicas timeout``) written after the calls made so far: group commit, one
        ``WAIT`` in flight at a time. The calls written while one is in flight share the next, sent when it
        answers; when it answers that too few replicas acknowledged, they get that answer without another wait
        (the replica is away: each would block the connection for the whole timeout)."""
        if self.lost is not None:
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(ConnectionError(f"Redis connection lost: {self.lost!r}"))
            return fut
        if self.wait_next is None:
            self.wait_args, self.wait_next = args, asyncio.get_running_loop().create_future()
        return self.wait_next

    def _send_wait(self) -> None:
        """Write the pending ``WAIT`` if none is in flight and the calls it follows are written."""
        if self.wait_next is None or self.wait_sent is not None or self.out or self.lost is not None:
            return
        assert self.transport is not None
        fut, self.wait_next, self.wait_sent = self.wait_next, None, self.wait_next
        fut.add_done_callback(self._wait_answered)
        self.transport.write(pack(self.wait_args))
        self.waiting.append(fut)

    def _wait_answered(self, fut: asyncio.Future[Any]) -> None:
        self.wait_sent = None
        acked = fut.result() if not fut.cancelled() and fut.exception() is None else None
        if self.wait_next is not None and isinstance(acked, int) and acked < int(self.wait_args[1]):
            self.wait_next.set_result(acked)  # too few replicas now: no second wait
            self.wait_next = None
        self._send_wait()

    def _flush(self) -> None:
        if self.out and self.transport is not None and self.lost is None:
            self.transport.write(b"".join(self.out))
        self.out.clear()
        self._send_wait()

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            fut = self.waiting.popleft()
            if fut.done():  # its caller was cancelled: the reply is read and dropped
                continue
            if isinstance(reply, ResponseError):
                fut.set_exception(reply)
            else:
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or self.lost or ConnectionError("closed by the server")
        err = ConnectionError(f"Redis connection lost: {self.lost!r}")
        if self.wait_next is not None and not self.wait_next.done():
            self.wait_next.set_exception(err)
        self.wait_next = None
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(err)

    def close(self) -> None:
        """Close; calls made from now on fail at once (those in flight fail when the transport reports it)."""
        if self.lost is None:
            self.lost = ConnectionError("closed by this client")
        if self.transport is not None:
            self.transport.close()


def pack(args: Sequence[Arg]) -> bytes:
    """One command in RESP (hiredis's packer, in C: a float as its ``repr``, like redis-py)."""
    packed: bytes = hiredis.pack_command(tuple(args))  # type: ignore[arg-type]  # (its stub types a 1-tuple)
    return packed
