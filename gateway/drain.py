"""Graceful drain: on SIGTERM a gateway stops admitting (``/health`` 503 "draining", new requests 503 with
``Retry-After``), lets the requests it holds finish within a grace period, then exits."""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import uvicorn

log = logging.getLogger("flying.gateway")


class Drain:
    """Counts the HTTP requests in progress (streams included, to their last byte) and holds the drain state."""

    def __init__(self) -> None:
        self.active = 0
        self.draining = False
        self.deadline = 0.0

    def begin(self, grace_s: float) -> None:
        if not self.draining:
            self.draining, self.deadline = True, time.monotonic() + grace_s
            log.warning("draining: %d requests in progress, at most %.0f s", self.active, grace_s)

    def done(self) -> bool:
        return self.draining and (self.active == 0 or time.monotonic() > self.deadline)


class CountRequests:
    """ASGI middleware: every HTTP request is counted in the ``Drain`` while it runs, its stream included."""

    def __init__(self, app, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.drain.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.active -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains (``Drain``) before the usual shutdown; a second one
    exits at once."""

    def __init__(self, config: uvicorn.Config, drain: Drain, grace_s: float) -> None:
        super().__init__(config)
        self.drain, self.grace_s = drain, grace_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining:
            self.force_exit = sig == signal.SIGINT
            self.should_exit = True
            return
        self.drain.begin(self.grace_s)

    async def on_tick(self, counter: int) -> bool:
        if self.drain.done():
            if self.drain.active:
                log.warning("drain grace over: %d requests still in progress are cut off", self.drain.active)
            self.should_exit = True
        return await super().on_tick(counter)
