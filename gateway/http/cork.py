"""Client connections whose writes of one event-loop turn leave in one ``send``: a response head with the first part
of its body, a stream's last events with the chunked encoding's terminator, a non-streaming answer whole. uvicorn
writes the head when the application starts the response, each body chunk as it comes and the terminator on its
own; on loopback TCP each write is a packet whose delivery, and the client's wake-up, cost more than the write
itself.

:func:`corked` makes a uvicorn protocol class whose transport is a :class:`CorkedTransport`: the first write of a
loop turn is held and a flush scheduled at the turn's end (one ``call_soon``); the turn's later writes join it,
and a response's completion flushes at once (its last bytes do not wait for the turn's other work). A stream's
events that arrive in separate turns still leave in separate sends, so nothing waits for later events. Closes see
held bytes out first, aborts drop them; everything else is the real transport's.
"""

from __future__ import annotations

import asyncio
from typing import Any


class CorkedTransport:
    """``transport`` with the writes of each loop turn written together at the turn's end."""

    __slots__ = ("_transport", "_held", "_loop")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._held: bytearray | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._held is not None:
            self._held += data
        else:
            self._held = bytearray(data)
            self._loop.call_soon(self.flush)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        """Write what is held (a no-op when nothing is, or the connection is closing)."""
        if self._held is not None:
            held, self._held = self._held, None
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._held or b"")

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading, ...
        return getattr(self._transport, name)


def corked(protocol: type) -> type:
    """``protocol`` (a uvicorn HTTP protocol class) with a :class:`CorkedTransport` on each connection."""

    class Corked(protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:
            loop = getattr(self, "loop", None) or asyncio.get_running_loop()
            super().connection_made(CorkedTransport(transport, loop))

        def on_response_complete(self) -> None:
            # A response's last bytes leave as soon as it is complete, not after the turn's remaining work (the
            # request log, metrics, the request's end to Redis).
            flush = getattr(self.transport, "flush", None)
            if flush is not None:
                flush()
            super().on_response_complete()

    Corked.__name__ = Corked.__qualname__ = f"Corked{protocol.__name__}"
    return Corked
