"""The relay: a request forwarded to its engine and the answer brought back. Non-streaming, the engine's JSON
(:meth:`Relay.forward`); streaming, nothing goes to the client before the engine's first event
(:meth:`Relay.first_event`: an engine that fails before it is replaced), then the events as they come
(:meth:`Relay.relay`), continued on another engine if this one fails mid-stream (:mod:`gateway.resume`). A client
that leaves has its request aborted on the engine and its slot freed (:meth:`Relay.drop` if it left before its
stream started). Unless ``raw_engine_fields``, the events lose SGLang's fields beyond OpenAI's on the way
(:mod:`gateway.api.engine_fields`)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
from collections.abc import AsyncGenerator, Awaitable

import httpx
import msgspec

from flying.messages import GROUP_LOST, Assignment, GaveUp, engine_gave_up, uncounted
from flying.queue import RequestQueue
from gateway.admission import Admitted
from gateway.api import engine_fields
from gateway.api.errors import APIError, PoisonRequest, WorkerFailed
from gateway.background import Background
from gateway.http.disconnect import CancelOnDisconnect, ClientGone
from gateway.http.upstream import StreamBroken, StreamResponse, Upstream, WorkerUnavailable
from gateway.waiting import WaitingRoom

log = logging.getLogger("flying.gateway")
DONE = b"data: [DONE]\n\n"  # a stream's last event
_encode = msgspec.json.Encoder().encode


class Relay:
    """Forwards admitted requests to the engines through ``upstream``; a failed engine's request goes back to
    the ``waiting`` room. ``raw_engine_fields``: relay the engines' events as they are (SGLang's extra fields
    included)."""

    def __init__(
        self,
        upstream: Upstream,
        waiting: WaitingRoom,
        background: Background,
        raw_engine_fields: bool = False,
    ) -> None:
        self.clean = not raw_engine_fields
        self.upstream = upstream
        self.waiting = waiting
        self.queue: RequestQueue = waiting.queue
        self.background = background

    async def forward(
        self,
        adm: Admitted,
        a: Assignment,
        disconnected: asyncio.Future[None],
        sent: Awaitable[StreamResponse] | None = None,
    ):
        """Non-streaming: the engine's (status, JSON body); ``sent``: its answer on the way already (early
        dispatch). Raises WorkerUnavailable or ClientGone."""
        call = sent if sent is not None else self.upstream.post(a.url, adm.path, adm.body)
        resp = await self._unless_gone(adm, a, call, disconnected)
        if resp.status_code == GROUP_LOST.status:  # the engine cannot serve it (its TP group lost a member)
            parked = uncounted(resp.text)
            raise WorkerUnavailable(
                f"engine {a.engine} answered 503: {resp.text[:200]}", engine_fault=False, counted=not parked
            )
        if resp.status_code >= 500:
            self.waiting.engine_failed(a.engine, f"answered {resp.status_code}")
        try:
            payload = resp.json()
        except ValueError:
            error = f"engine {a.engine} answered {resp.status_code} with a body that is not JSON: {resp.text[:120]!r}"
            await self.queue.finish(adm.record.id, "failed", error)
            raise WorkerFailed(error) from None
        if resp.status_code == 200 and (gave := engine_gave_up(payload)):  # SGLang's answer to an abort there
            raise gave_up(a, gave, "ended the request")
        state = "done" if resp.status_code == 200 else "failed"
        self.waiting.finish_soon(adm.record.id, state, "" if state == "done" else resp.text[:200])
        return resp.status_code, payload

    async def first_event(
        self, adm: Admitted, a: Assignment, resp, disconnected: asyncio.Future[None]
    ) -> list[str]:
        """Streaming: wait for the engine's first SSE event before the client gets anything, so an engine that
        dies (or a group that loses a member) before it can still be replaced: raises WorkerUnavailable and the
        request is re-dispatched; ClientGone if the client leaves meanwhile. Returns the lines of the batch that
        event arrived in, from that event on (the rest follow from ``resp.batch()``)."""

        async def read() -> list[str]:
            try:
                while (batch := await resp.batch()) is not None:
                    for i, line in enumerate(batch):
                        if line.startswith("data:"):
                            return batch[i:]
            except Exception as exc:  # noqa: BLE001 - any upstream failure before the first event: try another
                raise WorkerUnavailable(
                    f"engine {a.engine} failed before its first event: {exc!r}", died=True
                ) from exc
            raise WorkerUnavailable(f"engine {a.engine} closed the stream before its first event", died=True)

        try:
            first = await self._unless_gone(adm, a, read(), disconnected)
            if gave := unavailable(first[0]):
                raise gave_up(a, gave, "ended the stream before a token")
        except BaseException:
            with contextlib.suppress(Exception):
                await resp.aclose()
            raise
        return first

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
            self.background.spawn(self._abandon(adm, a, "client disconnected"))
            raise ClientGone(adm.record.id) from None
        finally:
            watch.close()
            if inspect.iscoroutine(coro) and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
                coro.close()  # never started (the client had left already)
            elif isinstance(coro, asyncio.Future) and not coro.done():
                coro.cancel()  # an answer sent for early, never awaited (the client had left already)

    async def relay(
        self, adm: Admitted, a: Assignment, resp, first: list[str]
    ) -> AsyncGenerator[bytes, None]:
        """Streaming: the engine's SSE events from ``first`` (:meth:`first_event`'s) on, those that arrived
        together in one chunk, the last ending with ``DONE``. A resumable stream whose engine fails after its
        first event continues on another (:mod:`gateway.resume`); any other broken stream ends with an error
        event."""
        state, error, batch = "cancelled", "client disconnected", first
        stream_id = engine_fields.StreamId(adm.record.id, adm.service_tier)
        try:
            while True:
                try:
                    while True:
                        out, done, gave = self._convert(adm, batch, stream_id)
                        if out:
                            yield out
                        if gave:
                            raise gave_up(a, gave, "ended the stream")
                        if done:
                            break
                        batch = await self._next(a, resp)
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
                    a, resp, batch = await self._resume(adm, a, exc)
        except Exception as exc:  # noqa: BLE001 - any upstream failure that cannot be resumed: an error event
            state, error = "failed", mid_stream_error(a, exc)
            yield (
                sse_error(exc if isinstance(exc, (WorkerFailed, PoisonRequest)) else WorkerFailed(error))
                + DONE
            )
        finally:  # started first: an await here may be cancelled again (the client left)
            if state == "cancelled":
                self.background.spawn(self._abandon(adm, a, error))
            else:
                self.waiting.finish_soon(adm.record.id, state, error)
            if state == "done":
                resp.finish()  # its connection goes back to the pool once the response's end is in
            else:
                with contextlib.suppress(Exception):
                    await resp.aclose()

    @staticmethod
    async def _next(a: Assignment, resp) -> list[str]:
        """The stream's next batch of lines; WorkerUnavailable if the engine fails or closes it before its end."""
        try:
            batch = await resp.batch()
        except (httpx.HTTPError, StreamBroken) as exc:
            raise WorkerUnavailable(f"engine {a.engine} failed mid-stream: {exc!r}", died=True) from exc
        if batch is None:
            raise WorkerUnavailable(f"engine {a.engine} closed the stream early", died=True)
        return batch

    def _convert(
        self, adm: Admitted, batch: list[str], stream_id: engine_fields.StreamId
    ) -> tuple[bytes, bool, GaveUp | None]:
        """One batch of the engine's lines as the client gets them: (the bytes to write, whether the stream ended
        (``[DONE]``), whether and why the engine gave up on the request: then the bytes are what came before)."""
        out: list[bytes] = []
        for line in batch:
            if not line.startswith("data:"):
                continue
            if line.strip() == "data: [DONE]":
                out.append(DONE)
                return b"".join(out), True, None
            if adm.resume is None:
                if self.clean:
                    chunk, event = engine_fields.clean_sse(line, stream_id)
                    gave = engine_gave_up(event)
                else:
                    chunk, gave = (line + "\n\n").encode(), unavailable(line)
                out.append(chunk)
                if gave:
                    return b"".join(out), False, gave
                continue
            event, data = adm.resume.event(line[5:].strip())
            if gave := engine_gave_up(event):
                return b"".join(out), False, gave
            if data is not None:
                out += (b"data: ", self._cleaned(event, data), b"\n\n")
        return b"".join(out), False, None

    def _cleaned(self, event, data: bytes) -> bytes:
        """A resumable stream's event as the client gets it: encoded again only if SGLang's fields were in it."""
        if self.clean and isinstance(event, dict) and "error" not in event and engine_fields.strip(event):
            return _encode(event)
        return data

    async def _resume(self, adm: Admitted, a: Assignment, exc: WorkerUnavailable):
        """Continue a broken stream elsewhere: back in the queue (bounded by ``max_attempts``, else WorkerFailed),
        then the remaining tokens from a new engine. Returns (assignment, response, first batch)."""
        assert adm.resume is not None, "only a resumable stream is resumed"
        log.warning(
            "request %s: %s; resuming after %d tokens",
            adm.record.id,
            exc,
            len(adm.resume.generated),
            extra={"request_id": adm.record.id},
        )
        fut = await self.waiting.retry_or_fail(
            adm,
            a,
            str(exc),
            cause="mid_stream",
            engine_fault=exc.engine_fault,
            counted=exc.counted,
            died=exc.died,
        )
        never = asyncio.get_running_loop().create_future()  # a client that leaves cancels this generator
        a = await self.waiting.wait_assignment(adm, fut, never)
        body = adm.resume.continuation()  # (under the attempt's rid, set by retry_or_fail)
        resp = await self.upstream.open_stream(a.url, adm.path, body)
        if resp.status_code != 200:
            await resp.aread()
            self.waiting.engine_failed(a.engine, f"answered {resp.status_code}")
            raise WorkerUnavailable(f"engine {a.engine} answered {resp.status_code}: {resp.text[:200]}")
        return a, resp, await self.first_event(adm, a, resp, never)

    async def _abandon(self, adm: Admitted, a: Assignment, why: str) -> None:
        """The client left: free its slot in Redis and stop it on the engine, both at once (an engine busy with
        many aborts must not hold the slot)."""
        await asyncio.gather(
            self.upstream.abort(a.url, *adm.engine_rids()),
            self.waiting.finish_surely(adm.record.id, "cancelled", why),
        )

    def drop(self, adm: Admitted, a: Assignment, resp) -> None:
        """A stream whose client left before it started: close the engine's stream, abort it there, free its
        slot (what the relay does when it ends)."""
        self.background.spawn(resp.aclose())
        self.background.spawn(self._abandon(adm, a, "client disconnected before its stream started"))


def mid_stream_error(a: Assignment, exc: Exception) -> str:
    """What a client whose stream broke for good is told: the engine's failure, or the resume's, in words."""
    if isinstance(exc, WorkerUnavailable):
        return str(exc)  # it names the engine and what went wrong
    why = exc.message if isinstance(exc, APIError) else repr(exc)
    return f"engine {a.engine} failed mid-stream: {why}"


def gave_up(a: Assignment, gave: GaveUp, what: str) -> WorkerUnavailable:
    """The re-dispatch an engine's giving up calls for: no fault of the engine's when its group lost a member."""
    return WorkerUnavailable(
        f"engine {a.engine} {what}: {gave.why}", engine_fault=not gave.group_lost, counted=not gave.parked
    )


def unavailable(line: str) -> GaveUp | None:
    """Whether and why an SSE line says the engine gave up on the request: see engine_gave_up."""
    with contextlib.suppress(ValueError):  # (msgspec.DecodeError is one)
        return engine_gave_up(msgspec.json.decode(line[5:]))
    return None


def sse_error(err) -> bytes:
    return b"data: " + json.dumps(err.body()).encode() + b"\n\n"
