"""Request tracing with OpenTelemetry: off unless an OTLP endpoint is configured (``--otlp-endpoint``, or the
standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``). Off, nothing of OpenTelemetry
is imported and the request path calls no one: the spans come from a middleware and from the serving path's
observer hooks (gateway.observer), which :class:`Tracing` implements when tracing is on.

The spans of one request, in the client's trace when it sends a W3C ``traceparent`` (else a new trace):

    POST /v1/chat/completions   SERVER  the whole exchange, to the response's last byte
      flying.admission                  validation, tokenization, the queue record
      flying.queue                      in the global queue: enqueued -> the router's dispatch (one per attempt)
      flying.dispatch                   the router's dispatch -> its assignment at the gateway
      flying.relay              CLIENT  the upstream call: sent to the engine -> the answer's end; its context is
                                        the ``traceparent`` header the engine gets

A request re-dispatched after an engine failed has a ``flying.relay`` ending in an error, then a second
``flying.queue``, ``flying.dispatch`` and ``flying.relay``; a prompt list on ``/v1/completions`` has one set per
prompt. Times come from the gateway's clock, the router's dispatch from the assignment's ``queue_ms``. Spans are
exported in batches from a thread of their own (OpenTelemetry's BatchSpanProcessor; ``OTEL_BSP_*`` tune it) to the
collector's OTLP/HTTP endpoint.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flying.messages import Assignment, QueuedRequest, split_engine_rid
from gateway.observer import Observer

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

DEFAULT_SERVICE_NAME = "flying-gateway"
TRACES_PATH = "/v1/traces"
MAX_OPEN = 65536  # relay spans held until their request's end is recorded; beyond, the oldest are ended
_PROPAGATED = (b"traceparent", b"tracestate")  # W3C trace context headers


def endpoint_from_env() -> str | None:
    """The OTLP/HTTP traces URL the standard variables name (None: tracing off)."""
    if url := os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return url
    return os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None


def service_name_from_env() -> str:
    return os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME


def traces_url(endpoint: str) -> str:
    """A collector's base URL (``http://collector:4318``) made its traces URL; one ending in /v1/traces as is."""
    base = endpoint.rstrip("/")
    return base if base.endswith(TRACES_PATH) else base + TRACES_PATH


def _ns(t: float) -> int:
    return int(t * 1e9)


@dataclass
class _Flight:
    """One request between its enqueue and its end: where its current queue wait began, its attempt, and its
    upstream call while one is open."""

    since_ns: int
    attempt: int = 1
    relay: Span | None = field(default=None)


class Tracing(Observer):
    """Spans for the gateway's requests, made by ``provider``'s tracer (:meth:`from_config` builds the OTLP one;
    tests give an SDK provider with an in-memory exporter); the serving path calls it as its observer."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer: Tracer = provider.get_tracer("flying.gateway")
        self.propagator = TraceContextTextMapPropagator()
        self._context, self._trace = context, trace
        self._flights: dict[str, _Flight] = {}
        # streams sent early (gateway.early_dispatch): their ids, and the relay spans of those whose answer came
        # before their queue wait was traced
        self._sent_early: set[str] = set()
        self._early: dict[str, Span] = {}

    @classmethod
    def from_config(cls, endpoint: str | None, service_name: str = DEFAULT_SERVICE_NAME) -> Tracing | None:
        """The exporting setup for ``endpoint`` (an OTLP/HTTP collector); None (tracing off) without one."""
        if not endpoint:
            return None
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
        return cls(provider)

    def shutdown(self) -> None:
        """Export what is pending and stop the exporter."""
        self.provider.shutdown()

    # -- the request's span ------------------------------------------------------------------------------------
    def start_request(self, scope: Scope) -> tuple[Span, object]:
        """The server span of a request (a child of the client's ``traceparent``), made current."""
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in _PROPAGATED}
        parent = self.propagator.extract(carrier)
        method, path = scope["method"], scope["path"]
        span = self.tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=self._trace.SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path, "http.route": path},
        )
        return span, self._context.attach(self._trace.set_span_in_context(span))

    def end_request(self, span: Span, token: object, status: int, request_id: str) -> None:
        span.set_attribute("http.response.status_code", status)
        if request_id:
            span.set_attribute("flying.request_id", request_id)
        if status >= 500:
            span.set_status(self._trace.StatusCode.ERROR)
        span.end()
        self._context.detach(token)  # type: ignore[arg-type]

    # -- the steps' spans (gateway.observer's hooks) ----------------------------------------------------------
    def admitted(self, rec: QueuedRequest, started_ns: int) -> None:
        if self._recording():
            span = self.tracer.start_span("flying.admission", start_time=started_ns)
            span.set_attributes(
                {
                    "flying.request_id": rec.id,
                    "flying.priority": rec.priority,
                    "flying.prompt_tokens": rec.prompt_tokens,
                    "flying.max_tokens": rec.max_tokens,
                }
            )
            span.end()

    def admission_failed(self, exc: BaseException, started_ns: int) -> None:
        if self._recording():
            self._failed(self.tracer.start_span("flying.admission", start_time=started_ns), exc)

    def _flight(self, rec: QueuedRequest) -> _Flight | None:
        """``rec``'s flight, begun at its first wait's end (followed until its end is recorded); None when it has
        none and its request is not sampled."""
        flight = self._flights.get(rec.id)
        if flight is None and self._recording():
            flight = self._flights[rec.id] = _Flight(_ns(rec.enqueued_at))
            flight.relay = self._early.pop(rec.id, None)  # (a stream sent early, answering already)
            self._bound()
        return flight

    def _queue_attrs(self, rec: QueuedRequest, flight: _Flight) -> dict[str, Any]:
        return {
            "flying.request_id": rec.id,
            "flying.priority": rec.priority,
            "flying.attempt": flight.attempt,
        }

    def assigned(self, rec: QueuedRequest, a: Assignment) -> None:
        if (flight := self._flight(rec)) is None:
            return
        attrs = self._queue_attrs(rec, flight)
        now = time.time_ns()
        dispatched = min(max(flight.since_ns, _ns(rec.enqueued_at + a.queue_ms / 1000)), now)
        queued = self.tracer.start_span("flying.queue", start_time=flight.since_ns, attributes=attrs)
        queued.set_attribute("flying.queue_ms", a.queue_ms)
        queued.end(end_time=dispatched)
        attrs |= {"flying.engine": a.engine, "server.address": a.url}
        self.tracer.start_span("flying.dispatch", start_time=dispatched, attributes=attrs).end(end_time=now)

    def wait_failed(self, rec: QueuedRequest, exc: BaseException) -> None:
        if (flight := self._flight(rec)) is not None:
            attrs = self._queue_attrs(rec, flight)
            self._failed(
                self.tracer.start_span("flying.queue", start_time=flight.since_ns, attributes=attrs), exc
            )

    def requeued(self, rec: QueuedRequest, why: str) -> None:
        if (flight := self._flights.get(rec.id)) is not None:
            self._end_relay(flight, "failed", f"re-dispatched: {why}")
            flight.since_ns, flight.attempt = time.time_ns(), flight.attempt + 1

    def relaying(self, body: dict, url: str, path: str, stream: bool, headers: dict[str, str]) -> Span | None:
        """A CLIENT span whose context goes to the engine as ``traceparent`` (not sampled: the engine still joins
        the trace); a stream's span stays open until its request's end is recorded (:meth:`finished`)."""
        if not self._recording():
            self.propagator.inject(headers)
            return None
        rid, attempt = split_engine_rid(str(body.get("rid", "")))
        span = self.tracer.start_span(
            "flying.relay",
            kind=self._trace.SpanKind.CLIENT,
            attributes={
                "flying.request_id": rid,
                "flying.attempt": (attempt or 0) + 1,  # as the queue span counts: 1 the first
                "server.address": url,
                "url.path": path,
                "http.request.method": "POST",
                "flying.stream": stream,
            },
        )
        self.propagator.inject(headers, context=self._trace.set_span_in_context(span))
        return span

    def relay_failed(self, handle: Span | None, exc: BaseException) -> None:
        if handle is not None:
            self._failed(handle, exc)

    def relayed(self, handle: Span | None, body: dict, stream: bool, status: int) -> None:
        if handle is None:
            return
        span = handle
        span.set_attribute("http.response.status_code", status)
        rid, _ = split_engine_rid(str(body.get("rid", "")))
        flight = self._flights.get(rid)
        early = rid in self._sent_early
        self._sent_early.discard(rid)
        if stream and flight is not None:
            if flight.relay is not None:  # an early stream's, not used: this one replaces it
                self._end_relay(flight, "taken_back", "")
            flight.relay = span
        elif stream and early:  # its queue wait is traced next (or it is taken back)
            self._early[rid] = span
            while len(self._early) > MAX_OPEN:
                self._early.pop(next(iter(self._early))).end()
        else:
            if status >= 400:
                span.set_status(self._trace.StatusCode.ERROR)
            span.end()

    def sent_early(self, rec: QueuedRequest) -> None:
        if self._recording():
            self._sent_early.add(rec.id)
            while len(self._sent_early) > MAX_OPEN:
                self._sent_early.pop()

    def taken_back(self, rec: QueuedRequest) -> None:
        """An early request the admission declined: its stream's relay span ends as ``taken_back``."""
        self._sent_early.discard(rec.id)
        if (span := self._early.pop(rec.id, None)) is not None:
            span.set_attribute("flying.outcome", "taken_back")
            span.end()

    def finished(self, rid: str, state: str, error: str) -> None:
        if (flight := self._flights.pop(rid, None)) is not None:
            self._end_relay(flight, state, error)

    def _failed(self, span: Span, exc: BaseException) -> None:
        span.record_exception(exc)
        span.set_status(self._trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:200])
        span.end()

    def _recording(self) -> bool:
        """Whether the current request's span records (is sampled): its steps' spans are made only then."""
        return self._trace.get_current_span().is_recording()

    def _end_relay(self, flight: _Flight, state: str, error: str) -> None:
        span, flight.relay = flight.relay, None
        if span is None:
            return
        span.set_attribute("flying.outcome", state)
        if state == "failed":
            span.set_status(self._trace.StatusCode.ERROR, error[:200])
        span.end()

    def _bound(self) -> None:
        """Requests whose end was never recorded (Redis away for good) do not pile up."""
        while len(self._flights) > MAX_OPEN:
            self._end_relay(self._flights.pop(next(iter(self._flights))), "unknown", "")


class TraceRequests:
    """ASGI middleware: each ``/v1/*`` request in a server span (:meth:`Tracing.start_request`), ended with the
    response's status when the response ends."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app, self.tracing = app, tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        span, token = self.tracing.start_request(scope)
        seen: dict[str, Any] = {"status": 500, "id": ""}

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                seen["id"] = next(
                    (v.decode() for k, v in message.get("headers", ()) if k == b"x-request-id"), ""
                )
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except BaseException as exc:
            span.record_exception(exc)
            raise
        finally:
            self.tracing.end_request(span, token, seen["status"], seen["id"])
