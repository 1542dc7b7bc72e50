"""Early dispatch (gateway.early_dispatch) against a real Redis and the real router: at light load a request goes
to its engine while its admission runs; one the admission declines is taken back (aborted on that engine) and
served the usual way under a fresh id; a declined one stops early dispatch for a while."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from flying.messages import FastTarget, QueuedRequest
from gateway.api.schemas import ChatCompletionRequest, decode
from gateway.http.disconnect import ClientGone
from gateway.service import Gateway
from tests.test_gateway_service import EVENTS, chat_chunks, serve_chat, sse, stream_through
from tests.test_gateway_service import gateway as gateway  # noqa: PLC0414 - the fixture, used by name

OK = {"choices": [{"index": 0, "message": {"content": "one two"}}]}


async def observed_targets(gw: Gateway, aredis, keys) -> None:
    """Until the gateway's view holds the router's fast-path targets (the router publishes them in its rounds)."""
    for _ in range(200):
        if await aredis.exists(keys.fast_path):
            await gw.observe()
            if gw.cluster.fast:
                return
        await asyncio.sleep(0.02)
    raise AssertionError("the router never published fast-path targets")


def recording(calls: list[tuple[str, dict]]):
    def engine(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        calls.append((request.url.path, body))
        return httpx.Response(200, json={} if request.url.path == "/abort_request" else OK)

    return engine


async def test_an_early_request_leaves_for_its_engine_before_its_admission_for_redis(
    gateway, aredis, keys, monkeypatch
):
    """The engine's round trip is the longer one: it starts first, and covers the admission's work and trip."""
    await observed_targets(gateway, aredis, keys)
    order: list[str] = []
    post, admit = gateway.upstream.post, gateway.waiting.queue.admit

    async def posting(*args, **kw):
        order.append("engine")
        return await post(*args, **kw)

    async def admitting(*args, **kw):
        order.append("admission")
        return await admit(*args, **kw)

    monkeypatch.setattr(gateway.upstream, "post", posting)
    monkeypatch.setattr(gateway.waiting.queue, "admit", admitting)
    reply = await serve_chat(gateway, recording([]))
    assert reply.status == 200 and gateway.early.sent == 1
    assert order == ["engine", "admission"]


async def test_a_request_goes_early_and_is_served_once(gateway, aredis, keys):
    await observed_targets(gateway, aredis, keys)
    calls: list[tuple[str, dict]] = []
    reply = await serve_chat(gateway, recording(calls))
    assert reply.status == 200 and reply.body["choices"][0]["message"]["content"] == "one two"
    assert (gateway.early.sent, gateway.early.declined) == (1, 0)
    assert [path for path, _ in calls] == ["/v1/chat/completions"], "one engine request, nothing aborted"
    assert calls[0][1]["rid"] == f"{reply.assignment.id}~0"
    for _ in range(100):  # its end is recorded after the answer
        if await aredis.hget(keys.request(reply.assignment.id), "state") == b"done":
            break
        await asyncio.sleep(0.02)
    assert await aredis.hget(keys.request(reply.assignment.id), "state") == b"done"
    assert await aredis.scard(keys.inflight(0)) == 0


async def test_a_stream_goes_early(gateway, aredis, keys):
    await observed_targets(gateway, aredis, keys)
    events, calls = await stream_through(gateway, [sse(EVENTS)])
    assert events == chat_chunks() and len(calls) == 1
    assert gateway.early.sent == 1


async def test_a_declined_request_is_taken_back_and_served_under_a_fresh_id(gateway, aredis, keys):
    """The gateway's view is stale (it names an engine the router does not list): the admission declines, the
    early request is aborted on that engine, and the request is admitted again under a fresh id (no suffix of
    the first: the client sees an id like any other) and served once. For a while after, nothing goes early."""
    await observed_targets(gateway, aredis, keys)
    url = gateway.cluster.fast[0].url
    gateway.cluster.fast = [FastTarget(engine=5, url=url, cap=8, max_kv=10_000)]
    gateway.cluster.observed_at = time.monotonic()
    calls: list[tuple[str, dict]] = []
    reply = await serve_chat(gateway, recording(calls), request_id="mine")
    assert reply.status == 200 and re.fullmatch(r"[0-9a-f]{32}", reply.assignment.id)
    for _ in range(100):  # the abort is sent in the background
        if len(calls) == 3:
            break
        await asyncio.sleep(0.02)
    by_path = sorted((path, body["rid"]) for path, body in calls)
    assert by_path == sorted(
        [
            ("/abort_request", "mine~0"),
            ("/v1/chat/completions", "mine~0"),
            ("/v1/chat/completions", f"{reply.assignment.id}~0"),
        ]
    )
    # SGLang's abort also ends every rid that begins with the one it names: not the request admitted again
    assert not f"{reply.assignment.id}~0".startswith("mine~0")
    assert (gateway.early.sent, gateway.early.declined) == (1, 1)
    assert await aredis.exists(keys.request("mine")) == 0, "the declined admission wrote nothing"
    assert await aredis.hget(keys.stats, "admitted") == b"1"
    await serve_chat(gateway, recording(calls))
    assert gateway.early.sent == 1, "backing off after a decline"


async def test_only_what_the_fast_path_would_take_goes_early(gateway, aredis, keys):
    """High priority (with DP targets), a request too large for any target, a non-empty queue, a stale view:
    nothing goes early."""
    await observed_targets(gateway, aredis, keys)
    early, cluster = gateway.early, gateway.cluster
    short = QueuedRequest(
        id="s", priority="normal", model="m", prompt_tokens=4, max_tokens=4, gateway="g", enqueued_at=0
    )
    assert early.target(short) is not None
    assert early.target(QueuedRequest(**{**_fields(short), "priority": "high"})) is None, "DP targets only"
    huge = QueuedRequest(**{**_fields(short), "prompt_tokens": 10**7})
    assert early.target(huge) is None
    cluster.depth = 3
    assert early.target(short) is None
    cluster.depth, cluster.observed_at = 0, time.monotonic() - 5
    assert early.target(short) is None
    early.enabled, cluster.observed_at = False, time.monotonic()
    assert early.target(short) is None


async def test_a_constrained_request_goes_early_only_to_a_groups_leader(gateway, aredis, keys):
    """A bound group's follower cannot hand a grammar to its leader: a leader-only request skips it."""
    early, cluster = gateway.early, gateway.cluster
    cluster.depth, cluster.observed_at = 0, time.monotonic()
    follower = FastTarget(engine=1, url="http://e1", epoch=4, cap=8, max_kv=10_000, follower=True)
    cluster.fast = [follower]
    rec = QueuedRequest(id="j", model="m", prompt_tokens=4, max_tokens=4, gateway="g", enqueued_at=0)
    assert early.target(rec) == follower
    pinned = QueuedRequest(**{**_fields(rec), "leader_only": True})
    assert early.target(pinned) is None
    leader = FastTarget(engine=0, url="http://e0", epoch=4, cap=8, max_kv=10_000)
    cluster.fast = [follower, leader]
    assert early.target(pinned) == leader


async def test_a_high_priority_request_goes_early_to_a_bound_group(gateway, aredis, keys):
    early, cluster = gateway.early, gateway.cluster
    cluster.depth, cluster.observed_at = 0, time.monotonic()
    member = FastTarget(engine=1, url="http://e1", epoch=4, cap=8, max_kv=10_000, follower=True)
    cluster.fast = [FastTarget(engine=3, url="http://e3", cap=8, max_kv=10_000), member]
    high = QueuedRequest(id="h", priority="high", model="m", prompt_tokens=4, max_tokens=4, gateway="g", enqueued_at=0)  # fmt: skip
    assert early.target(high) == member


def _fields(rec: QueuedRequest) -> dict:
    return {f: getattr(rec, f) for f in rec.__struct_fields__}


async def test_a_client_that_leaves_during_the_admission_has_its_early_request_stopped(gateway, aredis, keys):
    await observed_targets(gateway, aredis, keys)
    calls: list[tuple[str, dict]] = []
    gateway.engine.answer = recording(calls)
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
    adm = await gateway.admit(decode(json.dumps(body).encode(), ChatCompletionRequest), "normal")
    left = asyncio.get_running_loop().create_future()
    left.set_result(None)
    with pytest.raises(ClientGone):
        await gateway.serve(adm, left)
    assert gateway.early.sent == 1
    rid = adm.record.id
    for _ in range(100):
        if ("/abort_request", {"rid": f"{rid}~0"}) in calls and await aredis.scard(keys.inflight(0)) == 0:
            break
        await asyncio.sleep(0.02)
    assert ("/abort_request", {"rid": f"{rid}~0"}) in calls, calls
    assert await aredis.hget(keys.request(rid), "state") == b"cancelled"
    assert await aredis.scard(keys.inflight(0)) == 0


async def test_a_declined_stream_is_taken_back_and_streamed_once(gateway, aredis, keys):
    await observed_targets(gateway, aredis, keys)
    url = gateway.cluster.fast[0].url
    gateway.cluster.fast = [FastTarget(engine=5, url=url, cap=8, max_kv=10_000)]
    gateway.cluster.observed_at = time.monotonic()
    events, calls = await stream_through(gateway, [sse(EVENTS), sse(EVENTS), sse(EVENTS), sse(EVENTS)])
    assert events == chat_chunks()
    for _ in range(100):
        if sum(path == "/abort_request" for path, _ in calls) >= 1:
            break
        await asyncio.sleep(0.02)
    streams = [body["rid"] for path, body in calls if path == "/v1/completions"]
    aborted = [body["rid"] for path, body in calls if path == "/abort_request"]
    first = streams[0].removesuffix("~0")
    assert len(streams) == 2 and aborted[0] == streams[0] and streams[0] == f"{first}~0"
    assert re.fullmatch(r"[0-9a-f]{32}~0", streams[1]) and not streams[1].startswith(first)
    assert not streams[1].startswith(aborted[0]), (
        "the abort (a prefix in SGLang) does not reach the new stream"
    )
    assert (gateway.early.sent, gateway.early.declined) == (1, 1)
