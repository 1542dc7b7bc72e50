"""gateway.http.cork: the writes of one loop turn leave together at its end (one packet for a whole short answer), and
before a close; a later turn's writes leave in a send of their own; a real uvicorn serves through it."""

from __future__ import annotations

import asyncio
import socket
import time

import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from gateway.http.connections import ConnectionLimits, guarded_protocol
from gateway.http.cork import CorkedTransport, corked
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


async def test_the_writes_of_a_loop_turn_leave_together_at_its_end():
    t = Recorder()
    c = CorkedTransport(t, asyncio.get_running_loop())  # type: ignore[arg-type]
    c.write(b"HTTP/1.1 200 OK\r\n\r\n")
    assert t.writes == [] and c.get_write_buffer_size() == 19
    c.write(b"body")
    c.write(memoryview(b"more"))
    assert t.writes == []
    await asyncio.sleep(0)
    assert t.writes == [b"HTTP/1.1 200 OK\r\n\r\nbodymore"]
    c.write(b"later")  # a later turn's events: a send of their own, at that turn's end
    await asyncio.sleep(0)
    assert t.writes == [b"HTTP/1.1 200 OK\r\n\r\nbodymore", b"later"] and c.get_write_buffer_size() == 0
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


def test_a_complete_response_leaves_before_the_rest_of_its_loop_turn():
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
        await send({"type": "http.response.body", "body": b"hello"})
        time.sleep(0.5)  # the turn's work after the answer (the request log, metrics, ...), blocking here

    protocol = corked(guarded_protocol(ConnectionLimits()))

    def make_server(config: uvicorn.Config) -> uvicorn.Server:
        config.http = protocol
        return uvicorn.Server(config)

    with (
        ServerThread(app, health_path="/", make_server=make_server) as server,
        socket.create_connection(("127.0.0.1", server.port)) as s,
    ):
        time.sleep(0.6)  # the health check's own turn is over
        started = time.monotonic()
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = b""
        while not answer.endswith(b"hello"):
            answer += s.recv(65536)
        assert time.monotonic() - started < 0.4, "the answer waited for the turn's end"
        assert answer.startswith(b"HTTP/1.1 200 OK")
