"""The HTTP responses that carry an engine's answer to the client: a JSON reply (:func:`json_reply`) and a relayed
stream (:class:`RelayResponse`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING

import msgspec
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.api import engine_fields
from gateway.http.disconnect import CancelOnDisconnect
from gateway.relay import DONE

if TYPE_CHECKING:
    from gateway.service import Gateway, Reply

_encode = msgspec.json.Encoder().encode


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


class RelayResponse(StreamingResponse):
    """A stream relayed as the engine's events come, each chunk in one write, the last with the response's end.
    A client that leaves (``disconnected``) cancels the relay at once, so its cleanup (the engine's abort, the
    slot freed in Redis) runs then; one that leaves before the relay started gets ``unstarted`` instead."""

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
