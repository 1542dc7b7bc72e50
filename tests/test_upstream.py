"""The gateway's own HTTP/1.1 stream client against raw asyncio servers: keep-alive reuse, a pooled connection the
engine closed while idle, content-length answers, a stream cut short, an engine that is not there."""

from __future__ import annotations

import asyncio

import pytest

from flying.procs import free_port
from gateway.upstream import StreamBroken, Upstream, WorkerUnavailable

SSE = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n%s0\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def serve(answer: bytes, close_after: bool):
    """A server answering every request with ``answer``; ``close_after``: then it closes the connection (as an
    idle keep-alive timeout would)."""
    conns = []

    async def handle(reader, writer):
        conns.append(writer)
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            n = next(
                int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")
            )
            await reader.readexactly(n)
            writer.write(answer)
            await writer.drain()
            if close_after:
                writer.close()
                return

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", conns


async def lines(up: Upstream, url: str) -> list[str]:
    resp = await up.open_stream(url, "/v1/completions", {"prompt": [1]})
    assert resp.status_code == 200
    return [line async for line in resp.aiter_lines() if line]


@pytest.mark.parametrize("close_after", [False, True], ids=["keep-alive", "closed-while-idle"])
async def test_streams_reuse_a_connection_or_replace_a_stale_one(close_after):
    server, url, conns = await serve(SSE % (chunk(b"data: one\n\ndata: t") + chunk(b"wo\n\n")), close_after)
    up = Upstream(read_timeout_s=5)
    for _ in range(3):
        assert await lines(up, url) == ["data: one", "data: two"]
        await asyncio.sleep(0.05)
    assert len(conns) == (3 if close_after else 1)
    await up.close()
    server.close()


async def test_a_content_length_answer_and_a_stream_cut_short():
    body = b'{"error": "nope"}'
    server, url, _ = await serve(
        b"HTTP/1.1 400 Bad\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body), False
    )
    up = Upstream(read_timeout_s=5)
    resp = await up.open_stream(url, "/v1/completions", {})
    assert resp.status_code == 400 and await resp.aread() == body and resp.json() == {"error": "nope"}
    server.close()
    server, url, _ = await serve(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunk(b"data: a\n\n"), True
    )
    with pytest.raises(StreamBroken):
        await lines(up, url)
    server.close()
    with pytest.raises(WorkerUnavailable):
        await up.open_stream(f"http://127.0.0.1:{free_port()}", "/v1/completions", {})
    await up.close()
