"""Client connections whose response head goes out with the first part of its body: a non-streaming answer, or a
stream's first events (at hand when its head is sent), leaves in one ``send`` instead of two. uvicorn writes the
head when the application starts the response and each body chunk as it comes; on loopback TCP each write is a
packet whose delivery, and the client's wake-up, cost more than the write itself.

:func:`corked` makes a uvicorn protocol class whose transport is a :class:`CorkedTransport`: a response head
(a write that starts with ``HTTP/``) is held until the next write, which takes it along, or until the end of the
loop turn (one ``call_soon``) when none follows; the body's writes go out at once, as before. Closes see a held
head out first, aborts drop it; everything else is the real transport's.
"""

from __future__ import annotations

import asyncio
from typing import Any


class CorkedTransport:
    """``transport`` with each response head written together with the write that follows it."""

    __slots__ = ("_transport", "_head", "_loop")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._head: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._head is not None:
            data, self._head = self._head + bytes(data), None
        elif bytes(data[:5]) == b"HTTP/":
            self._head = bytes(data)
            self._loop.call_soon(self.flush)
            return
        self._transport.write(data)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        """Write a held head (a no-op when none is, or the connection is closing)."""
        if self._head is not None:
            head, self._head = self._head, None
            if not self._transport.is_closing():
                self._transport.write(head)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._head = None
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._head or b"")

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading, ...
        return getattr(self._transport, name)


def corked(protocol: type) -> type:
    """``protocol`` (a uvicorn HTTP protocol class) with a :class:`CorkedTransport` on each connection."""

    class Corked(protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:
            loop = getattr(self, "loop", None) or asyncio.get_running_loop()
            super().connection_made(CorkedTransport(transport, loop))

    Corked.__name__ = Corked.__qualname__ = f"Corked{protocol.__name__}"
    return Corked
