"""The gateway's own HTTP/1.1 stream client against raw asyncio servers: keep-alive reuse, a pooled connection the
engine closed while idle, content-length answers, a stream cut short, an engine that is not there."""

from __future__ import annotations

import asyncio

import pytest

from flying.procs import free_port
from gateway.http.upstream import StreamBroken, Upstream, WorkerUnavailable
from tests.stack import read_request

SSE = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n%s0\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def serve(answer: bytes, close_after: bool):
    """A server answering every request with ``answer``; ``close_after``: then it closes the connection (as an
    idle keep-alive timeout would)."""
    return await scripted([(0, answer)], close_after)


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
    port = free_port()
    with pytest.raises(WorkerUnavailable) as exc:
        await up.open_stream(f"http://127.0.0.1:{port}", "/v1/completions", {})
    assert str(exc.value) == "the engine refused the connection"  # clients see it: no address in it
    await up.close()


async def scripted(steps: list[tuple[float, bytes]], close_after: bool = False):
    """A server that answers each request with ``steps``: (seconds to wait, bytes to write), in order;
    ``close_after``: then it closes the connection."""
    conns = []

    async def handle(reader, writer):
        conns.append(writer)
        while await read_request(reader) is not None:
            for delay, data in steps:
                await asyncio.sleep(delay)
                if writer.is_closing():
                    return
                writer.write(data)
            if close_after:  # close() sends what was written first
                writer.close()
                return

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", conns


HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


async def test_lines_that_arrive_together_come_as_one_batch():
    steps = [
        (0, HEAD + chunk(b"data: 1\n\n") + chunk(b"data: 2\n\n")),
        (0.1, chunk(b"data: 3\n\n") + b"0\r\n\r\n"),
    ]
    server, url, _ = await scripted(steps)
    up = Upstream(read_timeout_s=5)
    resp = await up.open_stream(url, "/v1/completions", {})
    batches = [[line for line in b if line] async for b in resp.aiter_batches()]
    assert batches == [["data: 1", "data: 2"], ["data: 3"]]
    assert len(up._idle[up._key(url)]) == 1, "read to its end: pooled"
    await up.close()
    server.close()


async def test_a_stream_finished_after_its_last_event_is_pooled_once_its_end_arrives(monkeypatch):
    """``finish()`` at ``[DONE]``: the connection goes back to the pool when the terminating chunk comes, and the
    next stream reuses it; if the end does not come within DRAIN_S the connection is closed, not pooled."""
    steps = [(0, HEAD + chunk(b"data: [DONE]\n\n")), (0.1, b"0\r\n\r\n")]
    server, url, conns = await scripted(steps)
    up = Upstream(read_timeout_s=5)
    for _ in range(2):
        resp = await up.open_stream(url, "/v1/completions", {})
        async for batch in resp.aiter_batches():
            if "data: [DONE]" in batch:
                break
        resp.finish()
        assert not up._idle.get(up._key(url)), "its end has not arrived yet"
        await asyncio.sleep(0.3)
        assert len(up._idle[up._key(url)]) == 1
    assert len(conns) == 1, "the second stream reused the connection"
    await up.close()
    server.close()

    monkeypatch.setattr("gateway.http.upstream.DRAIN_S", 0.1)
    server, url, conns = await scripted([(0, HEAD + chunk(b"data: [DONE]\n\n")), (1.0, b"0\r\n\r\n")])
    up = Upstream(read_timeout_s=5)
    resp = await up.open_stream(url, "/v1/completions", {})
    resp.finish()
    await asyncio.sleep(0.3)
    assert not up._idle.get(up._key(url)), "no end within DRAIN_S: closed"
    await up.open_stream(url, "/v1/completions", {})
    assert len(conns) == 2, "a fresh connection"
    await up.close()
    server.close()


async def test_a_malformed_chunk_breaks_the_stream():
    server, url, _ = await scripted([(0, HEAD + chunk(b"data: 1\n\n") + b"zz\r\nnot a chunk\r\n")])
    up = Upstream(read_timeout_s=5)
    resp = await up.open_stream(url, "/v1/completions", {})
    got = []
    with pytest.raises(StreamBroken):
        async for line in resp.aiter_lines():
            got.append(line)
    assert got == ["data: 1", ""], "what came before the bad chunk is delivered"
    await up.close()
    server.close()


async def test_what_arrives_while_the_reader_is_away_is_still_read_even_with_the_end():
    """The rest of a stream and its end arrive while the reader is busy with an earlier batch (relaying it to a
    slow client): it still gets every line."""
    server, url, _ = await scripted(
        [(0, HEAD + chunk(b"data: 1\n\n")), (0.05, chunk(b"data: 2\n\n") + b"0\r\n\r\n")]
    )
    up = Upstream(read_timeout_s=5)
    resp = await up.open_stream(url, "/v1/completions", {})
    got = []
    async for batch in resp.aiter_batches():
        got += [line for line in batch if line]
        await asyncio.sleep(0.2)
    assert got == ["data: 1", "data: 2"]
    await up.close()
    server.close()


@pytest.mark.parametrize("answered", [False, True], ids=["before-headers", "mid-body"])
async def test_a_request_cancelled_midway_closes_its_connection(answered):
    """A non-streaming request whose client left (its task cancelled) before its answer was read to the end: the
    connection is closed, not left open outside the pool."""
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n12345"
    server, url, conns = await scripted([(0, head if answered else b""), (30, b"67890")])
    up = Upstream(read_timeout_s=60)
    task = asyncio.ensure_future(up.post(url, "/v1/completions", {}))
    while not conns:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)
    assert not any(up._idle.values())
    assert await asyncio.wait_for(_closed(conns[0]), 2)
    await up.close()
    server.close()


async def _closed(writer) -> bool:
    """Whether the peer closed: the server's end of the connection reads EOF (the reader behind a writer of
    ``asyncio.start_server``'s)."""
    reader = writer._protocol._stream_reader
    return await reader.read() == b""


async def test_a_flood_of_aborts_goes_out_a_few_at_a_time_and_every_one_arrives():
    """A batch of prompts x n choices whose client left is one abort per choice: thousands at once starved the
    gateway's event loop in httpx's pool; they go out at most ABORTS_AT_ONCE at a time."""
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    from gateway.http.upstream import ABORTS_AT_ONCE
    from tests.stack import ServerThread

    seen: list[str] = []
    now = peak = 0

    async def abort(request):
        nonlocal now, peak
        now += 1
        peak = max(peak, now)
        await asyncio.sleep(0.01)
        seen.append((await request.json())["rid"])
        now -= 1
        return Response()

    routes = [Route("/abort_request", abort, methods=["POST"]), Route("/health", lambda _: Response())]
    with ServerThread(Starlette(routes=routes)) as server:
        up = Upstream(read_timeout_s=5)
        rids = [f"r~0_{i}" for i in range(400)]
        await up.abort(server.url, *rids)
        await up.close()
    assert sorted(seen) == sorted(rids) and peak <= ABORTS_AT_ONCE <= 32


async def test_an_engine_that_takes_no_aborts_holds_up_no_other_engines_aborts():
    """Aborts wait their turn per engine: a stalled engine's own queue of aborts does not hold another's."""
    import time

    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    from tests.stack import ServerThread

    async def slow(request):
        await asyncio.sleep(10)  # longer than an abort is waited for
        return Response()

    async def fast(request):
        return Response()

    health = Route("/health", lambda _: Response())
    with (
        ServerThread(Starlette(routes=[Route("/abort_request", slow, methods=["POST"]), health])) as stalled,
        ServerThread(Starlette(routes=[Route("/abort_request", fast, methods=["POST"]), health])) as fine,
    ):
        up = Upstream(read_timeout_s=5)
        stuck = asyncio.create_task(up.abort(stalled.url, *(f"s~0_{i}" for i in range(100))))
        await asyncio.sleep(0.2)
        t0 = time.perf_counter()
        await up.abort(fine.url, *(f"f~0_{i}" for i in range(50)))
        assert time.perf_counter() - t0 < 1.5, "the healthy engine's aborts waited behind the stalled one's"
        stuck.cancel()
        await up.close()


def test_why_an_engine_cannot_be_reached_names_no_address():
    from gateway.http.upstream import unreachable

    assert unreachable(OSError(113, "Connect call failed ('10.0.0.5', 30001)")) == (
        "the engine could not be reached (No route to host)"
    )
    assert unreachable(ConnectionRefusedError(111, "Connect call failed ('10.0.0.5', 30001)")) == (
        "the engine refused the connection"
    )
