"""The gateway's OpenTelemetry spans (gateway.tracing), caught by the SDK's in-memory exporter: their names and
parents, the client's ``traceparent`` as the request's parent, the relay's context sent to the engine as its
``traceparent``; nothing of it when tracing is off. The real app, real Redis, the real router in a thread, the
SGLang-like engine (as in tests.test_gateway_openai)."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from starlette.testclient import TestClient

from flying.messages import Assignment, QueuedRequest, engine_rid, split_engine_rid
from gateway import tracing
from gateway.admission import Admitted
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.tracing import Tracing
from tests import test_gateway_openai as stack
from tests.stack import CountWords, RouterThread, announce_engine

engine, http = stack.engine, stack.http  # the fixtures of tests.test_gateway_openai (http: tracing off)
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}
STEPS = ["flying.admission", "flying.queue", "flying.dispatch", "flying.relay"]


@pytest.fixture
def traced(redis_server, sync_redis, keys, engine):
    """A gateway whose spans go to an in-memory exporter: (its client, the exporter)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine.calls.clear()
    engine.traceparents.clear()
    announce_engine(sync_redis, keys, url=engine.url)
    cfg = GatewayConfig(model_path="unused", redis_url=redis_server.url, key_prefix=keys.prefix)
    app = create_app(cfg, count_tokens=CountWords(), tracing=Tracing(provider))
    with RouterThread(redis_server.url, keys.prefix), TestClient(app, raise_server_exceptions=False) as http:
        yield http, exporter


def spans_of(exporter: InMemorySpanExporter, relays: int = 1) -> dict[str, list[ReadableSpan]]:
    """The finished spans by name, once ``relays`` relay spans have ended (a stream's ends after its response)."""
    deadline = time.monotonic() + 5
    while True:
        by_name: dict[str, list[ReadableSpan]] = {}
        for s in exporter.get_finished_spans():
            by_name.setdefault(s.name, []).append(s)
        if len(by_name.get("flying.relay", [])) >= relays or time.monotonic() > deadline:
            return by_name
        time.sleep(0.02)


def span_id(span: ReadableSpan) -> str:
    assert span.context is not None
    return format(span.context.span_id, "016x")


def trace_id(span: ReadableSpan) -> str:
    assert span.context is not None
    return format(span.context.trace_id, "032x")


def parent_id(span: ReadableSpan) -> str | None:
    return format(span.parent.span_id, "016x") if span.parent is not None else None


@pytest.mark.parametrize("early", [False, True], ids=["after-admission", "early-allowed"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_requests_steps_are_spans_under_the_clients_traceparent(traced, engine, stream, early):
    http, exporter = traced
    http.app.state.gateway.early.enabled = early
    r = http.post(
        "/v1/chat/completions", json=CHAT | {"stream": stream}, headers={"traceparent": TRACEPARENT}
    )
    assert r.status_code == 200
    spans = spans_of(exporter)
    (root,) = spans["POST /v1/chat/completions"]
    assert root.kind is SpanKind.SERVER and parent_id(root) == CLIENT_SPAN
    assert root.attributes is not None and root.attributes["http.response.status_code"] == 200
    assert root.attributes["flying.request_id"] == r.headers["x-request-id"]
    admission, queue, dispatch, relay = (spans[name][0] for name in STEPS)
    for step in (admission, queue, dispatch, relay):
        assert trace_id(step) == TRACE_ID and parent_id(step) == span_id(root), step.name
    assert relay.kind is SpanKind.CLIENT
    assert relay.attributes is not None and relay.attributes["flying.request_id"] == r.headers["x-request-id"]
    assert admission.start_time <= queue.start_time <= queue.end_time == dispatch.start_time
    if (
        early
    ):  # sent early (gateway.early_dispatch), the relay overlaps the queue's admission, never the admission
        assert admission.end_time <= relay.start_time <= relay.end_time
    else:
        assert dispatch.end_time <= relay.start_time <= relay.end_time
    if stream:  # a stream's relay span lasts until its end is recorded (sent early too)
        assert relay.attributes["flying.outcome"] == "done"
    assert engine.traceparents == [f"00-{TRACE_ID}-{span_id(relay)}-01"]


def test_without_a_traceparent_the_request_starts_a_trace_the_engine_joins(traced, engine):
    http, exporter = traced
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
    spans = spans_of(exporter)
    (root,), (relay,) = spans["POST /v1/chat/completions"], spans["flying.relay"]
    assert root.parent is None
    (sent,) = engine.traceparents  # (its flags: sampled, and a random trace id)
    assert sent is not None and sent.startswith(f"00-{trace_id(root)}-{span_id(relay)}-")


def test_each_prompt_of_a_list_has_its_own_queue_and_relay_spans(traced, engine):
    http, exporter = traced
    body = {"model": "tiny-llama", "prompt": ["one", "two words"], "max_tokens": 2}
    assert http.post("/v1/completions", json=body, headers={"traceparent": TRACEPARENT}).status_code == 200
    spans = spans_of(exporter, relays=2)
    (root,) = spans["POST /v1/completions"]
    for name in STEPS:
        assert len(spans[name]) == 2, name
        assert {parent_id(s) for s in spans[name]} == {span_id(root)}
    assert sorted(engine.traceparents) == sorted(
        f"00-{TRACE_ID}-{span_id(s)}-01" for s in spans["flying.relay"]
    )


def test_a_refused_request_has_its_admission_span_in_error(traced):
    http, exporter = traced
    r = http.post(
        "/v1/chat/completions", json=CHAT | {"model": "other"}, headers={"traceparent": TRACEPARENT}
    )
    assert r.status_code == 404
    names = {s.name: s for s in exporter.get_finished_spans()}
    assert set(names) == {"POST /v1/chat/completions", "flying.admission"}
    assert not names["flying.admission"].status.is_ok


def test_off_the_engine_gets_no_traceparent(http, engine):
    http.post("/v1/chat/completions", json=CHAT, headers={"traceparent": TRACEPARENT})
    assert engine.traceparents == [None]


def test_off_neither_the_sdk_nor_the_exporter_is_imported():
    # (redis-py imports opentelemetry's API and SDK metrics for its own, optional, metrics when installed)
    code = "import sys, gateway.main, gateway.app; print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk.trace', 'opentelemetry.exporter'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_endpoint_is_off_and_a_base_url_gets_the_traces_path(monkeypatch):
    assert Tracing.from_config(None) is None and Tracing.from_config("") is None
    assert tracing.traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert tracing.traces_url("http://c:4318/v1/traces") == "http://c:4318/v1/traces"
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318")
    assert tracing.endpoint_from_env() == "http://c:4318"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://t:4318/v1/traces")
    assert tracing.endpoint_from_env() == "http://t:4318/v1/traces"


class _Steps:
    """A fake serving path that calls its observer at the stages the gateway's components do (gateway.observer):
    an admission that records, an assignment at once, an engine that answers 200 (``engine``: what it saw)."""

    def __init__(self, observer: Tracing, engine=None) -> None:
        self.obs = observer
        self.waiting = self.upstream = self.queue = self.early = self
        self.finished: list[tuple[str, str]] = []
        self.taken_back: list[str] = []
        self.engine = engine

    def take_back(self, early, rec, declined=False):
        if early is not None:
            self.obs.taken_back(rec)
            self.taken_back.append(rec.id)

    def send(self, rec, call):
        self.obs.sent_early(rec)
        return object()  # (sent early: the test then calls open_stream itself)

    async def admit(self, req, priority, request_id=None):
        started = time.time_ns()
        record = QueuedRequest(id=request_id, priority=priority, model="m", prompt_tokens=1, max_tokens=1,
                               gateway="g", enqueued_at=time.time())  # fmt: skip
        self.obs.admitted(record, started)
        return Admitted(record, "/v1/completions", {"rid": engine_rid(request_id)}, stream=True)

    async def wait_assignment(self, adm, fut, disconnected):
        a = Assignment(id=adm.record.id, engine=3, url="http://e3", queue_ms=0.5)
        self.obs.assigned(adm.record, a)
        return a

    async def retry_or_fail(
        self, adm, a, why, cause="before_first_event", engine_fault=True, counted=True, died=False
    ):
        self.obs.requeued(adm.record, why)
        adm.next_attempt((split_engine_rid(adm.body["rid"])[1] or 0) + 1)  # as the waiting room does
        return None

    async def open_stream(self, url, path, body, headers=None):
        headers = dict(headers or {})
        handle = self.obs.relaying(body, url, path, True, headers)
        if self.engine is not None:
            self.engine(headers)
        self.obs.relayed(handle, body, True, 200)
        return SimpleNamespace(status_code=200)

    async def finish(self, rid, state, error=""):
        self.obs.finished(rid, state, error)
        self.finished.append((rid, state))

    def finish_nowait(self, rid, state, error=""):
        self.obs.finished(rid, state, error)
        self.finished.append((rid, state))


def instrumented_steps() -> tuple[InMemorySpanExporter, _Steps, Tracing]:
    """A fake serving path observed by a sampling tracer whose spans land in the returned exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    traced = Tracing(provider)
    return exporter, _Steps(traced), traced


async def test_a_re_dispatched_stream_has_a_failed_relay_then_a_second_attempt():
    exporter, steps, traced = instrumented_steps()
    with traced.tracer.start_as_current_span("request"):
        adm = await steps.admit(None, "normal", "r1")
        for attempt in (1, 2):
            a = await steps.waiting.wait_assignment(adm, None, None)
            await steps.upstream.open_stream(a.url, adm.path, adm.body)
            if attempt == 1:
                await steps.waiting.retry_or_fail(adm, a, "engine 3 failed before its first event")
    await steps.queue.finish("r1", "done")  # (a stream's end is recorded after its response)
    assert steps.finished == [("r1", "done")]
    spans = exporter.get_finished_spans()
    steps_then = ["flying.queue", "flying.dispatch", "flying.relay", "flying.queue", "flying.dispatch"]
    assert [s.name for s in spans] == ["flying.admission", *steps_then, "request", "flying.relay"]
    relays = [s for s in spans if s.name == "flying.relay"]
    assert [(s.attributes or {}).get("flying.outcome") for s in relays] == ["failed", "done"]
    assert not relays[0].status.is_ok and relays[1].status.is_unset
    assert [(s.attributes or {})["flying.attempt"] for s in spans if s.name == "flying.queue"] == [1, 2]
    assert [(s.attributes or {})["flying.attempt"] for s in relays] == [1, 2], (
        "each attempt's relay, counted alike"
    )
    second = [s for s in spans if s.name == "flying.queue"][1]
    assert second.start_time >= relays[0].end_time, "the second wait starts when the first relay failed"  # type: ignore[operator]


async def test_an_unsampled_request_has_no_step_spans_and_still_sends_its_traceparent():
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    sent: list[dict[str, str] | None] = []
    traced = Tracing(provider)
    steps = _Steps(traced, engine=sent.append)
    with traced.tracer.start_as_current_span("request") as root:
        adm = await steps.admit(None, "normal", "r1")
        a = await steps.waiting.wait_assignment(adm, None, None)
        await steps.upstream.open_stream(a.url, adm.path, adm.body)
    await steps.queue.finish("r1", "done")
    assert exporter.get_finished_spans() == () and not traced._flights
    ctx = root.get_span_context()
    assert sent == [{"traceparent": f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"}]
    assert not ctx.trace_flags.sampled


async def test_a_request_ended_without_awaiting_its_record_ends_its_relay_span():
    """The gateway records a request's end on the auto-pipelined connection without awaiting it
    (``finish_nowait``): the stream's relay span ends there too."""
    exporter, steps, traced = instrumented_steps()
    with traced.tracer.start_as_current_span("request"):
        adm = await steps.admit(None, "normal", "r1")
        a = await steps.waiting.wait_assignment(adm, None, None)
        await steps.upstream.open_stream(a.url, adm.path, adm.body)
        assert "flying.relay" not in [s.name for s in exporter.get_finished_spans()], "open while it streams"
        steps.queue.finish_nowait("r1", "done")
    assert [s.name for s in exporter.get_finished_spans()].count("flying.relay") == 1


async def test_a_stream_sent_early_keeps_its_relay_span_open_until_its_end_or_its_take_back():
    """Sent early (gateway.early_dispatch), a stream's answer can come before its queue wait is traced: its relay
    span still ends when the request's end is recorded; one the admission declined ends as ``taken_back``."""
    exporter, steps, traced = instrumented_steps()
    with traced.tracer.start_as_current_span("request"):
        used = await steps.admit(None, "normal", "used")
        steps.early.send(used.record, None)
        await steps.upstream.open_stream("http://e3", used.path, used.body)  # before its admission's reply
        await steps.waiting.wait_assignment(used, None, None)
        declined = await steps.admit(None, "normal", "declined")
        steps.early.send(declined.record, None)
        await steps.upstream.open_stream("http://e3", declined.path, declined.body)
        steps.early.take_back(object(), declined.record, declined=True)
    assert steps.taken_back == ["declined"]
    relays = {
        s.attributes["flying.request_id"]: s
        for s in exporter.get_finished_spans()
        if s.name == "flying.relay"
    }
    assert list(relays) == ["declined"] and relays["declined"].attributes["flying.outcome"] == "taken_back"
    steps.queue.finish_nowait("used", "done")
    relays = [s for s in exporter.get_finished_spans() if s.name == "flying.relay"]
    assert [(s.attributes["flying.request_id"], s.attributes["flying.outcome"]) for s in relays] == [
        ("declined", "taken_back"),
        ("used", "done"),
    ]
    assert not traced._early and not traced._flights and not traced._sent_early
