"""A client that leaves: the request's disconnect watcher (:func:`watcher`: the future its connection completes
when it closes, set in the scope by :class:`gateway.http.connections.GuardedProtocol`; elsewhere a task per request,
:func:`watch_disconnect`) and :class:`CancelOnDisconnect`, which turns the watcher's completion into a cancel of the task serving the request
(no task of its own per awaited step), told apart from any other cancel."""

from __future__ import annotations

import asyncio

from starlette.types import Receive, Scope


class ClientGone(Exception):
    """The client disconnected while its request waited."""


DISCONNECTED = "flying.disconnected"  # the scope key of the connection's future


def watcher(scope: Scope, receive: Receive) -> asyncio.Future[None]:
    """The request's disconnect watcher: a future that completes when the client goes away, and that the request
    cancels when it ends. The connection's own (no task, no ``receive`` call per request) where the server made
    one; else a task watching ``receive``."""
    fut = scope.get(DISCONNECTED)
    if fut is not None and not fut.cancelled():
        return fut
    return asyncio.create_task(watch_disconnect(receive))


async def watch_disconnect(receive: Receive) -> None:
    """Completes when the ASGI server reports that the client went away."""
    while True:
        if (await receive())["type"] == "http.disconnect":
            return


class CancelOnDisconnect:
    """While open, the completion of ``disconnected`` (the client left) cancels the task that opened it, at whatever
    it awaits; ``disconnected`` being cancelled (the request's normal end) does not. A client already gone when it
    opens sets :attr:`gone` at once and cancels nothing (:meth:`check` raises then). The use::

        watch = CancelOnDisconnect(disconnected)
        try:
            watch.check()
            ...  # awaits
        except asyncio.CancelledError:
            if not watch.caught():
                raise  # a cancel of someone else's
            ...  # the client left
        finally:
            watch.close()
    """

    __slots__ = ("task", "disconnected", "gone", "_active", "_cancelled")

    def __init__(self, disconnected: asyncio.Future[None]) -> None:
        task = asyncio.current_task()
        assert task is not None, "opened outside a task"
        self.task = task
        self.disconnected = disconnected
        self._cancelled = False
        self._active = not disconnected.done()
        self.gone = not self._active and not disconnected.cancelled()
        if self._active:
            disconnected.add_done_callback(self._left)

    def _left(self, disconnected: asyncio.Future[None]) -> None:
        # (a callback already scheduled runs even once removed: hence the flag)
        if self._active and not disconnected.cancelled():
            self.gone = self._cancelled = True
            self.task.cancel()

    def check(self) -> None:
        """Raise CancelledError if the client had left before this opened (what a cancel would have raised)."""
        if self.gone:
            raise asyncio.CancelledError

    def caught(self) -> bool:
        """In an ``except CancelledError``: True if it is the client's leaving, whose cancel is then taken back
        (the task goes on, not cancelling); False for any other cancel, to re-raise."""
        if not self.gone:
            return False
        if self._cancelled:
            self._cancelled = False
            self.task.uncancel()
        return True

    def close(self) -> None:
        """From now on a disconnect cancels nothing (idempotent)."""
        if self._active:
            self._active = False
            self.disconnected.remove_done_callback(self._left)
