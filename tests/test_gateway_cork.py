"""gateway.cork: a response head leaves with the write after it (one packet for a whole short answer), alone when
none follows in its loop turn, before a close; a real uvicorn serves through it."""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from gateway.connections import ConnectionLimits, guarded_protocol
from gateway.cork import CorkedTransport, corked
from tests.stack import ServerThread


class Recorder:
    """A transport double that records each write as one packet."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default=None):
        return ("peer", name)


async def test_a_head_goes_out_with_the_next_write():
    t = Recorder()
    c = CorkedTransport(t, asyncio.get_running_loop())  # type: ignore[arg-type]
    c.write(b"HTTP/1.1 200 OK\r\n\r\n")
    assert t.writes == [] and c.get_write_buffer_size() == 19
    c.write(b"body")
    c.write(b"more")  # the body's later writes go out at once
    assert t.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody", b"more"]
    await asyncio.sleep(0)
    assert len(t.writes) == 2  # the loop turn's flush found nothing held
    assert c.get_extra_info("peername") == ("peer", "peername")


async def test_a_head_alone_goes_out_at_the_end_of_its_loop_turn_or_at_a_close():
    t = Recorder()
    c = CorkedTransport(t, asyncio.get_running_loop())  # type: ignore[arg-type]
    c.write(b"HTTP/1.1 204 No Content\r\n\r\n")
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert t.writes == [b"HTTP/1.1 204 No Content\r\n\r\n"]
    c.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    c.close()
    assert t.writes[-1] == b"HTTP/1.1 400 Bad Request\r\n\r\n" and t.closed


def test_uvicorn_serves_through_it():
    app = Starlette(routes=[Route("/", lambda r: PlainTextResponse("hello"))])
    protocol = corked(guarded_protocol(ConnectionLimits()))

    def make_server(config: uvicorn.Config) -> uvicorn.Server:
        config.http = protocol  # as gateway.main serves
        return uvicorn.Server(config)

    with (
        ServerThread(app, health_path="/", make_server=make_server) as server,
        socket.create_connection(("127.0.0.1", server.port)) as s,
    ):
        for _ in range(2):  # keep-alive: the second answer is whole too
            s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b"hello"):
                answer += s.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200 OK")
        (conn,) = [
            c
            for c in server.server.server_state.connections
            if c.transport.get_extra_info("peername")[1] == s.getsockname()[1]
        ]
        assert isinstance(conn.transport, CorkedTransport)
