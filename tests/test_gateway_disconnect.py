"""CancelOnDisconnect: a client's leaving cancels the task at whatever it awaits, and only that cancel is caught
and taken back; the request's normal end (the watcher cancelled) and any other cancel are not the client's."""

from __future__ import annotations

import asyncio

import pytest
import uvicorn

from flying.procs import free_port
from gateway.http.connections import ConnectionLimits, guarded_protocol
from gateway.http.disconnect import CancelOnDisconnect, watch_disconnect, watcher


async def guarded(disconnected: asyncio.Future[None], step) -> str:
    """``step`` awaited under the watch: "gone" if the client left, else what it returned."""
    watch = CancelOnDisconnect(disconnected)
    try:
        watch.check()
        return await step
    except asyncio.CancelledError:
        if not watch.caught():
            raise
        assert asyncio.current_task().cancelling() == 0, "the cancel is taken back"
        return "gone"
    finally:
        watch.close()


async def test_a_disconnect_cancels_the_awaited_step_and_is_caught():
    disconnected = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(guarded(disconnected, asyncio.sleep(10, "slept")))
    await asyncio.sleep(0)
    disconnected.set_result(None)
    assert await asyncio.wait_for(task, 2) == "gone"


async def test_a_client_gone_before_it_opens_is_gone_at_once_and_nothing_is_cancelled():
    disconnected = asyncio.get_running_loop().create_future()
    disconnected.set_result(None)
    step = asyncio.sleep(10)
    assert await asyncio.wait_for(guarded(disconnected, step), 2) == "gone"
    step.close()


async def test_the_watcher_cancelled_is_the_requests_end_not_a_disconnect():
    disconnected = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(guarded(disconnected, asyncio.sleep(0.05, "slept")))
    await asyncio.sleep(0)
    disconnected.cancel()
    assert await asyncio.wait_for(task, 2) == "slept"
    already = asyncio.get_running_loop().create_future()
    already.cancel()
    assert await guarded(already, asyncio.sleep(0, "slept")) == "slept"


async def test_another_cancel_is_not_caught():
    disconnected = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(guarded(disconnected, asyncio.sleep(10)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not disconnected.done()


async def test_once_closed_a_disconnect_cancels_nothing():
    disconnected = asyncio.get_running_loop().create_future()
    watch = CancelOnDisconnect(disconnected)
    watch.close()
    watch.close()  # idempotent
    disconnected.set_result(None)
    await asyncio.sleep(0.01)
    assert not watch.gone and asyncio.current_task().cancelling() == 0


async def test_a_disconnect_whose_callback_is_pending_at_close_cancels_nothing():
    """The watcher completed but its callback had not run yet when the watch closed (the response's last chunk
    went out): a callback already scheduled runs even once removed, and does nothing."""
    disconnected = asyncio.get_running_loop().create_future()
    watch = CancelOnDisconnect(disconnected)
    disconnected.set_result(None)
    watch.close()
    await asyncio.sleep(0.01)
    assert not watch.gone and not watch.caught()
    assert asyncio.current_task().cancelling() == 0


async def test_watch_disconnect_ends_on_the_servers_disconnect_message():
    messages = iter([{"type": "http.request"}, {"type": "http.disconnect"}])

    async def receive():
        return next(messages)

    await asyncio.wait_for(watch_disconnect(receive), 2)


async def test_the_gateways_connections_complete_the_requests_watcher_when_the_client_leaves():
    """Served by the gateway's protocol, a request's watcher is its connection's future (no task): a client that
    closes its connection mid-request completes it; a request that was answered has its own, cancelled by it, and
    the next request on the connection gets a fresh one."""
    seen: list[asyncio.Future[None]] = []
    left = asyncio.get_running_loop().create_future()

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        disconnected = watcher(scope, receive)
        seen.append(disconnected)
        if scope["path"] == "/answer":
            disconnected.cancel()  # the request's end, as the gateway's handlers do
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        await asyncio.wait_for(asyncio.shield(disconnected), 5)
        left.set_result(not isinstance(disconnected, asyncio.Task))

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                            http=guarded_protocol(ConnectionLimits()))  # fmt: skip
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /answer HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        writer.write(b"POST /wait HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        while len(seen) < 2:
            await asyncio.sleep(0.01)
        assert seen[0] is not seen[1] and seen[0].cancelled() and not seen[1].done()
        writer.close()
        assert await asyncio.wait_for(left, 5) is True, "the connection's own future, not a task"
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_a_real_gateway_mid_request_has_its_request_cancelled(
    redis_server, tiny_model, tmp_path, stream
):
    """A gateway process (its own protocol: the connection's future is the watcher) against a slow engine (50 ms a
    token): a client that closes its connection mid-answer, streamed or not, has its request ended as cancelled
    long before the engine would have finished it (10 s)."""
    import socket
    import time
    import uuid

    import redis

    from flying.keys import Keys
    from loadgen.fake_server import start_process
    from tests.stack import gateway_process

    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    engine, engine_url = start_process(tmp_path / "engine.log", itl_ms=50)
    try:
        with gateway_process(redis_server.url, keys, tiny_model, tmp_path, engine_url=engine_url) as url:
            body = (
                b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, '
                b'"stream": ' + (b"true" if stream else b"false") + b"}"
            )
            head = f"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nx-request-id: leaver-{stream}\r\n"
            s = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=5)
            s.sendall(
                f"{head}content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body
            )
            if stream:
                assert s.recv(65536).startswith(b"HTTP/1.1 200"), "the stream began"
            else:
                time.sleep(0.5)  # on the engine now, its answer 10 s away
            s.close()
            left, r = time.monotonic(), redis.Redis.from_url(redis_server.url)
            while (state := r.hget(keys.request(f"leaver-{stream}"), "state")) != b"cancelled":
                assert time.monotonic() - left < 5, f"state {state!r} 5 s after the client left"
                time.sleep(0.05)
    finally:
        engine.kill()
        engine.wait(10)
