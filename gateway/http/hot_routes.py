"""The completion endpoints' short way through the app. Starlette sends every request through its router (a
regular-expression match per route) and an exception layer that builds a ``Request`` and wraps ``send`` in a
closure, before the endpoint; on the hot path that cost about as much as the gateway's own middleware
(25 us a request on a 2-core machine). :class:`HotRoutesApp` sends a ``POST`` to one of its hot paths straight to
its endpoint, inside the same user middleware and the same last-resort error layer (500) as every other request;
the endpoint maps its own errors with the app's exception handlers (:class:`HandledRoute`). Any other request
(another path or method: 404, 405) takes Starlette's usual way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from starlette.applications import Starlette
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

Endpoint = Callable[[Request], Awaitable[Response]]
Handler = Callable[[Request, Exception], Awaitable[Response]]


class HandledRoute:
    """An endpoint as a plain ASGI app whose exceptions become responses through ``handlers`` (looked up along the
    exception's class hierarchy, as Starlette does); one without a handler propagates (to the 500 layer)."""

    def __init__(self, endpoint: Endpoint, handlers: dict[type[BaseException], Handler]) -> None:
        self.endpoint, self.handlers = endpoint, handlers

    def handler(self, exc: Exception) -> Handler | None:
        return next((self.handlers[c] for c in type(exc).__mro__ if c in self.handlers), None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            response = await self.endpoint(request)
        except Exception as exc:
            handler = self.handler(exc)
            if handler is None:
                raise
            response = await handler(request, exc)
            exc.__traceback__ = None  # a reused exception instance would gather tracebacks
        await response(scope, receive, send)


class HotRoutesApp(Starlette):
    """A Starlette app whose ``hot`` endpoints (exact path -> endpoint, ``POST`` only) skip its router and its
    exception layer: they run inside the user middleware and the 500 layer, with the app's other exception
    handlers applied by :class:`HandledRoute`. Their ordinary routes stay in ``routes`` (for other methods)."""

    def __init__(self, *, hot: Mapping[str, Endpoint], **kwargs) -> None:
        super().__init__(**kwargs)
        self.hot = hot

    def build_middleware_stack(self) -> ASGIApp:
        full = super().build_middleware_stack()
        handlers = {k: v for k, v in self.exception_handlers.items() if k not in (500, Exception)}
        last_resort = self.exception_handlers.get(500) or self.exception_handlers.get(Exception)
        hot: dict[str, ASGIApp] = {}
        for path, endpoint in self.hot.items():
            app: ASGIApp = HandledRoute(endpoint, handlers)
            for cls, args, kwargs in reversed(self.user_middleware):
                app = cls(app, *args, **kwargs)
            hot[path] = ServerErrorMiddleware(app, handler=last_resort, debug=self.debug)
        return _Dispatch(full, hot)


class _Dispatch:
    """``POST`` to a hot path: its own stack; anything else: ``full``."""

    __slots__ = ("full", "hot")

    def __init__(self, full: ASGIApp, hot: dict[str, ASGIApp]) -> None:
        self.full, self.hot = full, hot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and (app := self.hot.get(scope["path"])):
            await app(scope, receive, send)
        else:
            await self.full(scope, receive, send)
