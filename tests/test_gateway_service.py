"""The gateway's streaming path against a real Redis and the real router; the engine is an httpx mock that breaks
its stream on purpose (the one thing a live SGLang engine cannot be made to do on cue). A streaming chat request
travels upstream as a token-id completion (gateway.resume): the mock answers in SGLang's completion chunks with
``token_ids``, and the client gets chat chunks."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest

from flying.messages import GROUP_LOST as LOST
from flying.messages import GROUP_PARKED, Assignment, CrashReport, Heartbeat, encode
from gateway.api import engine_fields
from gateway.api.errors import NoRouter, PoisonRequest, WorkerFailed
from gateway.api.schemas import ChatCompletionRequest, decode
from gateway.config import GatewayConfig
from gateway.http.disconnect import ClientGone
from gateway.service import Gateway
from router.config import MANUAL_OFF, RouterConfig
from router.dispatcher import Dispatcher
from router.policy import PolicyConfig
from tests.stack import read_request

PROMPT = [1, 1, 1, 1]  # CountWords' chat template: one word, plus 3
WORDS = ("one", "two", "three")
# what SGLang streams for a completion with return_token_ids: ids per chunk, the prompt's in the first
EVENTS = [
    {"id": f"c{i}", "object": "text_completion", "choices": [{"index": 0, "text": w, "token_ids": [10 + i]}]}
    for i, w in enumerate(WORDS)
]
EVENTS[0]["choices"][0]["prompt_token_ids"] = PROMPT
EVENTS[-1]["choices"][0]["finish_reason"] = "length"


def chat_chunks(words=WORDS) -> list[dict]:
    """What the client gets: chat chunks under the first event's id, the role first, at the tier served."""
    out = []
    for i, w in enumerate(words):
        delta = {"role": "assistant", "content": w} if i == 0 else {"content": w}
        finish = "length" if i == len(WORDS) - 1 else None
        out.append({"id": "c0", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], "service_tier": "default"})  # fmt: skip
    return out


class CountWords:
    def chat_ids(self, req):
        return [1] * (sum(len(m.text().split()) for m in req.messages) + 3)

    def completion(self, req):
        return len(req.prompt) if isinstance(req.prompt, list) else len(req.prompt.split())


def sse(events, fail_after: int | None = None):
    """The engine's answer: ``events`` then [DONE]; with ``fail_after``, that many events, then a connection
    reset."""
    return (events, "done") if fail_after is None else (events[:fail_after], "reset")


def cut(events):
    """The events, then the connection closes without the stream's end (an engine process that exited)."""
    return events, "cut"


def empty():
    return [], "cut"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class ScriptedEngine:
    """A raw HTTP/1.1 engine that answers its n-th request with ``scripts[n]`` (events, end): SSE events, then
    [DONE] ("done"), a connection reset ("reset"), a close without the stream's end ("cut") or nothing more
    ("hang"). Records
    ``calls`` as (path, JSON body). With ``answer`` set (an httpx-style handler), every request gets that
    handler's response instead (non-streaming answers)."""

    def __init__(self) -> None:
        self.scripts: list = []
        self.calls: list[tuple[str, dict]] = []
        self.answer: Callable[[httpx.Request], httpx.Response] | None = None
        # called with the request's body before its stream breaks (a "reset" or "cut"): what a crash does first
        self.on_break: Callable[[dict], Awaitable[None]] | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (request := await read_request(reader)) is not None:
            head, body = request
            self.calls.append((head.split()[1].decode(), json.loads(body)))
            if self.answer is not None:
                resp = self.answer(httpx.Request("POST", "http://engine" + self.calls[-1][0], content=body))
                writer.write(
                    b"HTTP/1.1 %d -\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (resp.status_code, len(resp.content), resp.content)
                )
                await writer.drain()
                continue
            events, end = self.scripts[len(self.calls) - 1]
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            for e in events:
                writer.write(_chunk(f"data: {json.dumps(e)}\n\n".encode()))
            await writer.drain()
            if end == "done":
                writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                await writer.drain()
                continue
            if end == "hang":  # the first event never comes (until the server closes)
                await asyncio.Event().wait()
            if self.on_break is not None:
                await self.on_break(self.calls[-1][1])
            if end == "reset":
                writer.transport.abort()
            else:
                writer.close()
            return


@pytest.fixture
async def gateway(redis_server, aredis, keys):
    engine = ScriptedEngine()
    server = await asyncio.start_server(engine.handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    hb = Heartbeat(
        engine=0, url=url, pid=1, model="tiny-llama", launch_id="L", context_len=4096,
        max_total_tokens=4096, free_kv_tokens=4096, ts=time.time(),
    )  # fmt: skip
    await aredis.set(keys.worker(0), encode(hb), px=60_000)
    await aredis.sadd(keys.workers, 0)
    await aredis.set(keys.ready(0), "L")
    policy = PolicyConfig(off=MANUAL_OFF)
    router = Dispatcher(RouterConfig(key_prefix=keys.prefix, policy=policy), aredis)
    stop = asyncio.Event()
    task = asyncio.create_task(router.run(stop))
    cfg = GatewayConfig(model_path="unused", redis_url=redis_server.url, key_prefix=keys.prefix)
    gw = Gateway(cfg, aredis, CountWords())
    gw.engine = engine
    await gw.start()
    yield gw
    await gw.stop()
    server.close()
    stop.set()
    await asyncio.wait_for(task, 5)


async def stream_through(gw: Gateway, responses: list, **extra) -> tuple[list[dict], list]:
    """One streaming chat request through admission, the router and ``Gateway.serve``; the engine answers its n-th
    call with ``responses[n]`` (see ScriptedEngine)."""
    gw.engine.scripts = responses
    calls = gw.engine.calls
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "stream": True} | extra
    adm = await gw.admit(decode(json.dumps(body).encode(), ChatCompletionRequest), "normal")
    connected = asyncio.create_task(asyncio.Event().wait())
    try:
        reply = await asyncio.wait_for(gw.serve(adm, connected), 10)
        chunks = [c async for c in reply.stream]
    finally:
        connected.cancel()
    lines = b"".join(chunks).decode().split("\n\n")
    return [json.loads(x[5:]) for x in lines if x.startswith("data:") and x != "data: [DONE]"], calls


GROUP_LOST = LOST.message
ABORTED = {"choices": [{"index": 0, "text": "", "finish_reason": "abort"}]}  # SGLang, no token yet
ERROR_503 = {"error": {"message": GROUP_LOST, "type": "SERVICE_UNAVAILABLE", "param": None, "code": 503}}


@pytest.mark.parametrize(
    "broken, engine_fault",
    [
        (lambda: sse(EVENTS, fail_after=0), True),
        (empty, True),
        (lambda: sse([ABORTED]), True),
        (lambda: sse([ERROR_503]), False),  # its TP group lost a member: the engine itself is fine
    ],
    ids=["reset", "closed", "aborted", "503"],
)
async def test_a_stream_that_breaks_before_its_first_event_is_redispatched(
    gateway, aredis, keys, broken, engine_fault
):
    events, calls = await stream_through(gateway, [broken(), sse(EVENTS)])
    assert events == chat_chunks(), "the client sees the second engine's stream only, whole"
    assert len(calls) == 2
    assert int(await aredis.hget(keys.stats, "requeued")) == 1
    await asyncio.sleep(0.1)  # the finish is recorded in the background
    assert await aredis.scard(keys.inflight(0)) == 0
    counted = await aredis.hget(keys.breakers, "0") is not None
    assert counted == engine_fault, "a lost group is no failure of the engine's own (its breaker)"


def resumed_events(after: int) -> list[dict]:
    """The second engine's answer to prompt + the first ``after`` ids: the rest, with its own id and the longer
    prompt in its first chunk."""
    rest = [json.loads(json.dumps(e)) for e in EVENTS[after:]]
    for e in rest:
        e["id"] = "other"
        e["choices"][0].pop("prompt_token_ids", None)
    rest[0]["choices"][0]["prompt_token_ids"] = PROMPT + [10 + i for i in range(after)]
    return rest


@pytest.mark.parametrize(
    "broken",
    [lambda: sse(EVENTS, fail_after=2), lambda: sse([*EVENTS[:2], ABORTED]), lambda: cut(EVENTS[:2])],
    ids=["reset", "aborted", "closed"],
)
async def test_a_stream_that_breaks_after_tokens_continues_on_another_engine(gateway, aredis, keys, broken):
    """The engine dies (or aborts: its TP group lost a member) after two tokens: the rest comes from another
    engine asked for prompt + those two ids, and the client sees one unbroken stream."""
    events, calls = await stream_through(gateway, [broken(), sse(resumed_events(2))])
    assert events == chat_chunks()
    assert len(calls) == 2 and calls[0][0] == calls[1][0] == "/v1/completions"
    first, second = (body for _, body in calls)
    assert first["prompt"] == PROMPT and first["return_token_ids"] and "messages" not in first
    assert second["prompt"] == PROMPT + [10, 11]
    assert second["max_tokens"] == first["max_tokens"] - 2
    assert first["rid"].endswith("~0") and second["rid"] == first["rid"].removesuffix("~0") + "~1", (
        "a rid of its own: a late abort of the first ends nothing here"
    )
    assert int(await aredis.hget(keys.stats, "requeued")) == 1
    await asyncio.sleep(0.1)
    assert await aredis.hget(keys.stats, "completed") == b"1" and not await aredis.hget(keys.stats, "failed")


async def test_a_resumed_stream_whose_second_engine_dies_too_ends_cleanly_as_a_poison_request(
    gateway, aredis, keys
):
    """Two engines die mid-stream running it: it is not tried on a third (it may be what kills them), an
    OpenAI-shaped error event (``request_crashed_engines``), then [DONE]; nothing hangs."""
    events, calls = await stream_through(
        gateway, [sse(EVENTS, fail_after=1), sse(resumed_events(1), fail_after=1), empty()]
    )
    assert events[0]["choices"][0]["delta"]["content"] == "one"
    assert [e["choices"][0]["delta"]["content"] for e in events[:2]] == ["one", "two"]
    assert events[-1]["error"]["code"] == "request_crashed_engines" and len(calls) == 2
    assert events[-1]["error"]["type"] == "server_error"
    assert await aredis.sismember(keys.suspects, calls[0][1]["rid"].split("~")[0])
    message = events[-1]["error"]["message"]
    assert message.startswith("engine ") and "Error(" not in message, (
        f"in words, not an exception's repr: {message}"
    )
    await asyncio.sleep(0.1)
    assert await aredis.hget(keys.stats, "failed") == b"1"


def reports_crash(
    gw: Gateway, aredis, keys, batch: str = "alone", delay_s: float = 0.0
) -> list[asyncio.Task]:
    """Engine 0 reports its crash before its stream breaks (after ``delay_s``, in the background): its crashing
    batch held the request alone ("alone"), with another ("shared"), or only another ("cleared": it held the
    request outside that batch). Returns the background writes."""
    late: list[asyncio.Task] = []

    async def write(rid: str) -> None:
        await asyncio.sleep(delay_s)
        crashing = {"alone": (rid,), "shared": (rid, "other~0"), "cleared": ("other~0",)}[batch]
        report = CrashReport(
            engine=0, at=time.time(), error="RuntimeError: boom", batch=crashing, held=(rid, "other~0")
        )
        await aredis.set(keys.crash(0), encode(report))

    async def on_break(body: dict) -> None:
        gw.engine.on_break = None  # (the first engine's crash only)
        if delay_s:
            late.append(asyncio.create_task(write(body["rid"])))
        else:
            await write(body["rid"])

    gw.engine.on_break = on_break
    return late


async def test_a_request_its_engines_crash_report_names_alone_is_not_tried_again(gateway, aredis, keys):
    """The engine's crashing batch held this request alone: it crashed the engine, so it ends at once (500
    ``request_crashed_engines``) instead of taking a second engine down."""
    reports_crash(gateway, aredis, keys)
    with pytest.raises(PoisonRequest) as raised:
        await stream_through(gateway, [empty(), sse(EVENTS)])
    assert raised.value.status == 500 and raised.value.code == "request_crashed_engines"
    calls = gateway.engine.calls
    assert len(calls) == 1, "not sent to another engine"
    rid = calls[0][1]["rid"].split("~")[0]
    assert await aredis.hget(keys.request(rid), "state") == b"failed"
    assert not await aredis.sismember(keys.suspects, rid)
    assert gateway.metrics.poison._value.get() == 1
    assert await aredis.hget(keys.stats, "failed") == b"1" and not await aredis.hget(keys.stats, "requeued")


async def test_a_crash_report_written_after_the_stream_broke_still_ends_its_request(gateway, aredis, keys):
    """The report lands after the gateway saw the connection break: read again before the re-dispatch."""
    late = reports_crash(gateway, aredis, keys, delay_s=0.05)
    gateway.waiting.redispatch_delay_s = lambda attempt: 0.3
    with pytest.raises(PoisonRequest):
        await stream_through(gateway, [empty(), sse(EVENTS)])
    assert late and late[0].done() and len(gateway.engine.calls) == 1
    assert gateway.metrics.poison._value.get() == 1


@pytest.mark.parametrize("batch, suspect", [("cleared", False), ("shared", True)])
async def test_a_request_outside_the_crashing_batch_or_sharing_it_is_redispatched(
    gateway, aredis, keys, batch, suspect
):
    """Held outside the crashing batch: not its cause, re-dispatched and not suspect. In the batch with another
    request: either may be the cause, so it is re-dispatched as a suspect (a second death ends it)."""
    reports_crash(gateway, aredis, keys, batch)
    events, calls = await stream_through(gateway, [empty(), sse(EVENTS)])
    assert events == chat_chunks() and len(calls) == 2
    rid = calls[0][1]["rid"].split("~")[0]
    assert await aredis.sismember(keys.suspects, rid) == suspect
    assert gateway.metrics.poison._value.get() == 0


CHAT_EVENTS = [{"choices": [{"index": 0, "delta": {"content": w}}]} for w in WORDS]


async def test_a_stream_that_cannot_resume_ends_with_an_error_event(gateway, aredis, keys):
    """A chat request with log-probabilities keeps SGLang's chat endpoint (no token ids to resume from): after
    its first event, a broken stream ends with an error event."""
    events, calls = await stream_through(gateway, [sse(CHAT_EVENTS, fail_after=2)], logprobs=True)
    assert calls[0][0] == "/v1/chat/completions"
    assert events[:2] == CHAT_EVENTS[:2]
    assert events[2]["error"]["code"] == "worker_failed" and len(events) == 3
    assert events[2]["error"]["message"].count("failed mid-stream") == 1, events[2]["error"]["message"]
    assert len(calls) == 1, "tokens were already sent: no re-dispatch"
    assert not await aredis.hget(keys.stats, "requeued")


async def serve_chat(gateway, engine, priority: str = "normal", request_id: str | None = None):
    """One non-streaming chat request through ``gateway.serve``, with ``engine`` (an httpx-style handler) as every
    engine's answer; returns the Reply."""
    gateway.engine.answer = engine
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
    adm = await gateway.admit(decode(json.dumps(body).encode(), ChatCompletionRequest), priority, request_id)
    connected = asyncio.create_task(asyncio.Event().wait())
    try:
        return await asyncio.wait_for(gateway.serve(adm, connected), 10)
    finally:
        connected.cancel()


@pytest.mark.parametrize(
    "first, engine_fault",
    [
        (httpx.Response(503, json={"object": "error", "message": GROUP_LOST, "code": 503}), False),
        (httpx.Response(200, json={"choices": [{"index": 0, "message": {"content": "one"}, "finish_reason": "abort"}]}), True),
    ],
    ids=["group-lost-503", "aborted-200"],
)  # fmt: skip
async def test_a_non_streaming_request_the_engine_gave_up_on_is_redispatched(
    gateway, aredis, keys, first, engine_fault
):
    """A TP group that loses a member aborts its requests with 503 (worker_ext.sglang_patches); an abort on the
    engine (no status: SGLang's graceful abort) ends one as a 200 whose finish reason is ``abort``, with part of
    the answer. Nothing reached the client yet, so the request goes to an engine again, under a rid of its own."""
    answers = [
        first,
        httpx.Response(200, json={"choices": [{"index": 0, "message": {"content": "one two"}}]}),
    ]
    calls = []

    def engine(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return answers[len(calls) - 1]

    reply = await serve_chat(gateway, engine)
    assert reply.status == 200 and reply.body["choices"][0]["message"]["content"] == "one two"
    assert len(calls) == 2
    rids = [json.loads(c.content)["rid"] for c in calls]
    assert rids == [f"{reply.assignment.id}~0", f"{reply.assignment.id}~1"]
    assert int(await aredis.hget(keys.stats, "requeued")) == 1
    await asyncio.sleep(0.1)
    counted = await aredis.hget(keys.breakers, "0") is not None
    assert counted == engine_fault, "a lost group is no failure of the engine's own (its breaker)"


async def test_a_request_set_aside_by_a_parking_group_is_queued_again_past_its_attempts(
    gateway, aredis, keys
):
    """An engine that parks its group ends a request still in its prefill with the parked 503: nothing failed, so
    the gateway queues it again however often (more than ``max_attempts`` here), and its engine's breaker counts
    nothing."""
    parked = httpx.Response(
        503, json={"object": "error", "message": GROUP_PARKED.message, "type": "503", "code": 503}
    )
    n = gateway.config.max_attempts + 1
    answers = [parked] * n + [
        httpx.Response(200, json={"choices": [{"index": 0, "message": {"content": "ok"}}]})
    ]
    calls = []

    def engine(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return answers[len(calls) - 1]

    reply = await serve_chat(gateway, engine)
    assert reply.status == 200 and len(calls) == n + 1
    assert int(await aredis.hget(keys.request(reply.assignment.id), "parked_attempts")) == n
    assert await aredis.hget(keys.breakers, "0") is None


async def test_every_assignment_is_told_even_when_the_request_then_fails(gateway):
    """The request log names where a request ran (gateway.request_log): each attempt's assignment is told as it
    comes, so a 502 after its attempts are used up still says which engine."""
    gateway.engine.answer = lambda request: httpx.Response(503, json={"message": GROUP_LOST, "code": 503})
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
    adm = await gateway.admit(decode(json.dumps(body).encode(), ChatCompletionRequest), "normal", None)
    seen: list[Assignment] = []
    connected = asyncio.create_task(asyncio.Event().wait())
    try:
        with pytest.raises(WorkerFailed):
            await asyncio.wait_for(gateway.serve(adm, connected, assigned=seen.append), 10)
    finally:
        connected.cancel()
    assert [(a.id, a.engine) for a in seen] == [(adm.record.id, 0)] * gateway.config.max_attempts


async def test_a_client_request_id_is_the_rid_and_a_reused_one_is_made_unique(gateway, aredis, keys):
    """The client's id is the record's and the engine's rid; sent again while its record exists, the request runs
    as ``<id>-<8 hex>`` (gateway.request_log)."""
    rids = []

    def engine(request: httpx.Request) -> httpx.Response:
        rids.append(json.loads(request.content)["rid"])
        return httpx.Response(200, json={"choices": [{"index": 0, "message": {"content": "ok"}}]})

    served = [(await serve_chat(gateway, engine, "high", "client-1")).assignment.id for _ in range(2)]
    assert served[0] == "client-1" and re.fullmatch(r"client-1-[0-9a-f]{8}", served[1]), served
    assert rids == [f"{rid}~0" for rid in served]
    assert await aredis.hget(keys.request(served[1]), "state") == b"done"


def usage_chunk(prompt: int, completion: int, cached: int) -> dict:
    """SGLang's last chunk with stream_options.include_usage and --enable-cache-report."""
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
    return {"id": "u", "object": "text_completion", "choices": [], "usage": usage}


async def test_a_streams_usage_keeps_the_engines_cached_tokens(gateway):
    events, calls = await stream_through(
        gateway, [sse([*EVENTS, usage_chunk(4, 3, 3)])], stream_options={"include_usage": True}
    )
    assert calls[0][1]["stream_options"] == {"include_usage": True}, "asked of the engine as the client asked"
    assert events[:3] == chat_chunks()
    assert events[3]["object"] == "chat.completion.chunk" and events[3]["choices"] == []
    assert events[3]["usage"] == usage_chunk(4, 3, 3)["usage"]


@pytest.mark.parametrize("cached, reported", [(5, 4), (2, 2)], ids=["prompt-and-streamed-ids-cached", "part"])
async def test_a_resumed_streams_usage_counts_the_clients_prompt_and_its_cached_part(
    gateway, cached, reported
):
    """The second engine is asked for prompt + 2 streamed ids (6 tokens, ``cached`` of them in its cache): the
    client's usage is 4 prompt tokens, 3 completion tokens, and at most its 4 prompt tokens cached."""
    rest = [*resumed_events(2), usage_chunk(6, 1, cached)]
    events, _ = await stream_through(
        gateway, [sse(EVENTS, fail_after=2), sse(rest)], stream_options={"include_usage": True}
    )
    assert events[:3] == chat_chunks()
    assert events[3]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                                  "prompt_tokens_details": {"cached_tokens": reported}}  # fmt: skip


async def test_a_non_streaming_answer_keeps_the_engines_cached_tokens(gateway):
    usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 3}}  # fmt: skip
    answer = {"choices": [{"index": 0, "message": {"content": "one two"}}], "usage": usage}
    reply = await serve_chat(gateway, lambda _: httpx.Response(200, json=answer))
    assert reply.status == 200 and reply.body["usage"] == usage


async def test_admission_records_the_prompts_prefix_chain(gateway):
    """The record carries the chain of the prompt's token ids (a chat's rendered template; a completion's ids),
    or of a completion's text: the router's cache-aware dispatch reads it."""
    from flying.prefix import block_hashes
    from gateway.api.schemas import CompletionRequest

    def body(**kw) -> bytes:
        return json.dumps({"model": "tiny-llama"} | kw).encode()

    chat = await gateway.admit(decode(body(messages=[{"role": "user", "content": "w " * 200}]), ChatCompletionRequest), "normal")  # fmt: skip
    assert len(chat.record.chain) == 3 and chat.record.chain == tuple(block_hashes([1] * 203))
    ids = await gateway.admit(decode(body(prompt=list(range(130))), CompletionRequest), "normal")
    assert ids.record.chain == tuple(block_hashes(list(range(130))))
    text = await gateway.admit(decode(body(prompt="x " * 300), CompletionRequest), "normal")
    assert text.record.chain == tuple(block_hashes("x " * 300)) and len(text.record.chain) == 2
    short = await gateway.admit(decode(body(prompt="hello"), CompletionRequest), "normal")
    assert short.record.prefix == ""


@pytest.mark.parametrize("when", ["before", "waiting"], ids=["left-before", "left-while-waiting"])
async def test_a_client_that_leaves_before_the_first_event_is_gone_and_its_request_aborted(
    gateway, aredis, keys, when
):
    """The client leaves before the engine's first event (already gone when the stream opens, or while it waits
    for that event): ClientGone, the engine is told to abort the request, its record is cancelled and its slot
    freed."""
    gateway.engine.scripts = [([], "hang"), sse([])]
    calls = gateway.engine.calls
    for _ in range(100):  # the router's fast-path targets: the request is assigned at admission
        if await aredis.exists(keys.fast_path):
            break
        await asyncio.sleep(0.02)
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    adm = await gateway.admit(decode(json.dumps(body).encode(), ChatCompletionRequest), "normal")
    left = asyncio.get_running_loop().create_future()
    if when == "before":
        left.set_result(None)
    serving = asyncio.create_task(gateway.serve(adm, left))
    if when == "waiting":
        for _ in range(100):
            if calls:
                break
            await asyncio.sleep(0.02)
        assert not serving.done()
        left.set_result(None)
    with pytest.raises(ClientGone):
        await asyncio.wait_for(serving, 5)
    for _ in range(100):
        if len(calls) == 2 and await aredis.hget(keys.request(adm.record.id), "state") == b"cancelled":
            break
        await asyncio.sleep(0.02)
    assert [path for path, _ in calls] == ["/v1/completions", "/abort_request"]
    assert calls[1][1] == {"rid": f"{adm.record.id}~0"}
    assert await aredis.hget(keys.request(adm.record.id), "state") == b"cancelled"
    assert await aredis.scard(keys.inflight(0)) == 0


async def test_requests_waiting_when_the_router_is_gone_end_with_503_no_router(redis_server, aredis, keys):
    """No router holds the lease (none runs): a waiting request ends with 503 no_router and Retry-After once the
    grace is over, as a new request would, not with a 504 at the end of its wait budget."""
    hb = Heartbeat(engine=0, url="http://127.0.0.1:9", pid=1, model="tiny-llama", launch_id="L", context_len=4096,
                   max_total_tokens=4096, free_kv_tokens=4096, ts=time.time())  # fmt: skip
    await aredis.set(keys.worker(0), encode(hb), px=60_000)
    await aredis.sadd(keys.workers, 0)
    await aredis.set(keys.ready(0), "L")
    await aredis.set(keys.router_lease, "r1", px=300)  # a router held the lease: the request is admitted
    cfg = GatewayConfig(model_path="unused", redis_url=redis_server.url, key_prefix=keys.prefix,
                        no_router_grace_s=0.5, monitor_s=0.1, early_dispatch=False)  # fmt: skip
    gw = Gateway(cfg, aredis, CountWords())
    await gw.start()
    try:
        body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
        adm = await gw.admit(decode(json.dumps(body).encode(), ChatCompletionRequest), "normal")
        connected = asyncio.create_task(asyncio.Event().wait())
        t0 = time.monotonic()
        with pytest.raises(NoRouter) as exc:
            await asyncio.wait_for(gw.serve(adm, connected), 10)
        connected.cancel()
        assert exc.value.retry_after_s and time.monotonic() - t0 < 3
        await asyncio.sleep(0.1)
        assert await aredis.zcard(keys.queue) == 0, "its record left the queue"
    finally:
        await gw.stop()


async def test_a_stream_the_engine_refuses_before_its_first_token_is_an_error_answer_not_a_200(
    gateway, aredis, keys
):
    """SGLang refuses some requests only once streaming (a regex it cannot compile, a prompt over its own
    limit): its first event is an error object. Nothing was sent yet, so the client gets that error's status and
    OpenAI's shape, and the request is recorded as failed."""
    refused = {
        "error": {
            "object": "error",
            "message": "Failed to compile regex grammar: unbalanced parenthesis",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }
    gateway.engine.scripts = [sse([refused])]
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    adm = await gateway.admit(decode(json.dumps(body).encode(), ChatCompletionRequest), "normal")
    connected = asyncio.create_task(asyncio.Event().wait())
    try:
        reply = await asyncio.wait_for(gateway.serve(adm, connected), 10)
    finally:
        connected.cancel()
    assert reply.stream is None and reply.status == 400
    error = engine_fields.openai_error_doc(reply.body)["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("Failed to compile regex")
    assert len(gateway.engine.calls) == 1, "an engine's refusal is not re-dispatched"
    await asyncio.sleep(0.1)
    assert await aredis.hget(keys.stats, "failed") == b"1"
