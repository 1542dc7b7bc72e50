"""The gateway's streaming path against a real Redis and the real router; the engine is an httpx mock that breaks
its stream on purpose (the one thing a live SGLang engine cannot be made to do on cue)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from flying.messages import Heartbeat, encode
from gateway.app import dispatch
from gateway.config import GatewayConfig
from gateway.schemas import ChatCompletionRequest, decode
from gateway.service import Gateway
from router.config import RouterConfig
from router.dispatcher import Dispatcher
from router.policy import PolicyConfig

EVENTS = [{"choices": [{"index": 0, "delta": {"content": w}}]} for w in ("one", "two", "three")]


class CountWords:
    def chat(self, req):
        return sum(len(m.text().split()) for m in req.messages) + 3


async def sse(events, fail_after: int | None = None):
    for i, e in enumerate(events):
        if i == fail_after:
            raise httpx.ReadError("connection reset by peer")
        yield f"data: {json.dumps(e)}\n\n".encode()
    if fail_after is None:
        yield b"data: [DONE]\n\n"


async def empty():
    return
    yield b""


@pytest.fixture
async def gateway(redis_server, aredis, keys):
    hb = Heartbeat(
        engine=0, url="http://e0", pid=1, model="tiny-llama", launch_id="L", context_len=4096,
        max_total_tokens=4096, free_kv_tokens=4096, ts=time.time(),
    )  # fmt: skip
    await aredis.set(keys.worker(0), encode(hb), px=60_000)
    await aredis.sadd(keys.workers, 0)
    await aredis.set(keys.ready(0), "L")
    policy = PolicyConfig(load_adaptation=False, priority=False, long_context=False)
    router = Dispatcher(RouterConfig(key_prefix=keys.prefix, policy=policy), aredis)
    stop = asyncio.Event()
    task = asyncio.create_task(router.run(stop))
    cfg = GatewayConfig(model_path="unused", redis_url=redis_server.url, key_prefix=keys.prefix)
    gw = Gateway(cfg, aredis, CountWords())
    await gw.start()
    yield gw
    await gw.stop()
    stop.set()
    await asyncio.wait_for(task, 5)


async def stream_through(gw: Gateway, responses: list) -> tuple[list[dict], list]:
    """One streaming chat request through admission, the router and ``dispatch``; the engine answers its n-th
    call with ``responses[n]`` (an async byte iterator)."""
    calls = []

    def engine(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(200, content=responses[len(calls) - 1])

    await gw.upstream.client.aclose()
    gw.upstream.client = httpx.AsyncClient(transport=httpx.MockTransport(engine))
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    adm = await gw.admit(decode(json.dumps(body).encode(), ChatCompletionRequest), "chat", "normal")
    connected = asyncio.create_task(asyncio.Event().wait())
    try:
        resp = await asyncio.wait_for(dispatch(gw, adm, connected), 10)
        chunks = [c async for c in resp.body_iterator]
    finally:
        connected.cancel()
    lines = b"".join(chunks).decode().split("\n\n")
    return [json.loads(x[5:]) for x in lines if x.startswith("data:") and x != "data: [DONE]"], calls


GROUP_LOST = "tensor-parallel group lost a member; request aborted"
ABORTED = {
    "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "abort"}]
}  # SGLang, no token yet
ERROR_503 = {"error": {"message": GROUP_LOST, "type": "SERVICE_UNAVAILABLE", "param": None, "code": 503}}


@pytest.mark.parametrize(
    "broken",
    [lambda: sse(EVENTS, fail_after=0), empty, lambda: sse([ABORTED]), lambda: sse([ERROR_503])],
    ids=["reset", "closed", "aborted", "503"],
)
async def test_a_stream_that_breaks_before_its_first_event_is_redispatched(gateway, aredis, keys, broken):
    events, calls = await stream_through(gateway, [broken(), sse(EVENTS)])
    assert events == EVENTS, "the client sees the second engine's stream only, whole"
    assert len(calls) == 2
    assert int(await aredis.hget(keys.stats, "requeued")) == 1
    await asyncio.sleep(0.1)  # the finish is recorded in the background
    assert await aredis.scard(keys.inflight(0)) == 0


async def test_a_stream_that_breaks_after_its_first_event_ends_with_an_error_event(gateway, aredis, keys):
    events, calls = await stream_through(gateway, [sse(EVENTS, fail_after=2)])
    assert events[:2] == EVENTS[:2]
    assert events[2]["error"]["code"] == "worker_failed" and len(events) == 3
    assert len(calls) == 1, "tokens were already sent: no re-dispatch"
    assert not await aredis.hget(keys.stats, "requeued")


async def test_a_non_streaming_request_answered_503_is_redispatched(gateway, aredis, keys):
    """A TP group that loses a member aborts its requests with 503 (worker_ext.sglang_patches): nothing reached
    the client yet, so the request goes to another engine instead of failing."""
    answers = [
        httpx.Response(503, json={"object": "error", "message": GROUP_LOST, "code": 503}),
        httpx.Response(200, json={"choices": [{"index": 0, "message": {"content": "one two"}}]}),
    ]
    calls = []

    def engine(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return answers[len(calls) - 1]

    await gateway.upstream.client.aclose()
    gateway.upstream.client = httpx.AsyncClient(transport=httpx.MockTransport(engine))
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
    adm = await gateway.admit(decode(json.dumps(body).encode(), ChatCompletionRequest), "chat", "normal")
    connected = asyncio.create_task(asyncio.Event().wait())
    try:
        resp = await asyncio.wait_for(dispatch(gateway, adm, connected), 10)
    finally:
        connected.cancel()
    assert resp.status_code == 200 and json.loads(resp.body)["choices"][0]["message"]["content"] == "one two"
    assert len(calls) == 2
    assert int(await aredis.hget(keys.stats, "requeued")) == 1


async def test_an_engine_abort_after_the_first_event_ends_with_an_error_event(gateway, aredis, keys):
    """SGLang ends a TP request whose group lost a member with an abort chunk; after tokens were sent the client
    gets that chunk and then an OpenAI-shaped error, not a silent finish_reason nobody knows."""
    aborted = {"choices": [{"index": 0, "delta": {"content": " two"}, "finish_reason": "abort"}]}
    events, calls = await stream_through(gateway, [sse([EVENTS[0], aborted])])
    assert events[:2] == [EVENTS[0], aborted]
    assert events[2]["error"]["code"] == "worker_failed" and len(events) == 3
    assert len(calls) == 1
    await asyncio.sleep(0.1)
    assert await aredis.hget(keys.stats, "failed") == b"1" and not await aredis.hget(keys.stats, "completed")
