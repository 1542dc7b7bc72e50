"""Request tracing with OpenTelemetry: off unless an OTLP endpoint is configured (``--otlp-endpoint``, or the
standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``). Off, nothing of OpenTelemetry
is imported and the request path is untouched: the spans come from a middleware and from wrappers that
:meth:`Tracing.instrument` puts around the gateway's own steps once, at start-up, only when tracing is on.

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

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flying.messages import split_engine_rid

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

    from gateway.service import Gateway

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


class Tracing:
    """Spans for the gateway's requests, made by ``provider``'s tracer (:meth:`from_config` builds the OTLP one;
    tests give an SDK provider with an in-memory exporter)."""

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

    # -- the steps' spans --------------------------------------------------------------------------------------
    def instrument(self, gw: Gateway) -> None:
        """Wrap the gateway's steps (admission, the wait for an assignment, the upstream calls, the requests'
        ends) in spans. Called once, before the gateway serves."""
        gw.admit = self._admission(gw.admit)
        waiting, upstream, queue = gw.waiting, gw.upstream, gw.waiting.queue
        waiting.wait_assignment = self._queued(waiting.wait_assignment)  # type: ignore[method-assign]
        gw.wait_assignment = waiting.wait_assignment
        waiting.retry_or_fail = self._requeued(waiting.retry_or_fail)  # type: ignore[method-assign]
        upstream.open_stream = self._relayed(upstream.open_stream, stream=True)  # type: ignore[method-assign]
        upstream.post = self._relayed(upstream.post, stream=False)  # type: ignore[method-assign]
        queue.finish = self._finished(queue.finish)  # type: ignore[method-assign]
        queue.finish_nowait = self._finished_nowait(queue.finish_nowait)  # type: ignore[method-assign]
        gw.early.take_back = self._taken_back(gw.early.take_back)  # type: ignore[method-assign]
        gw.early.send = self._sending_early(gw.early.send)  # type: ignore[method-assign]

    def _admission(self, admit: Callable) -> Callable:
        @functools.wraps(admit)
        async def traced(req, priority, request_id=None):
            if not self._recording():
                return await admit(req, priority, request_id)
            span = self.tracer.start_span("flying.admission")
            try:
                adm = await admit(req, priority, request_id)
            except BaseException as exc:
                self._failed(span, exc)
                raise
            rec = adm.record
            span.set_attributes(
                {
                    "flying.request_id": rec.id,
                    "flying.priority": rec.priority,
                    "flying.prompt_tokens": rec.prompt_tokens,
                    "flying.max_tokens": rec.max_tokens,
                }
            )
            span.end()
            return adm

        return traced

    def _queued(self, wait_assignment: Callable) -> Callable:
        @functools.wraps(wait_assignment)
        async def traced(adm, fut, disconnected):
            rec = adm.record
            flight = self._flights.get(rec.id)
            if flight is None and not self._recording():
                return await wait_assignment(adm, fut, disconnected)
            if flight is None:  # its first wait (enqueued): followed until its end is recorded
                flight = self._flights[rec.id] = _Flight(_ns(rec.enqueued_at))
                flight.relay = self._early.pop(rec.id, None)  # (a stream sent early, answering already)
                self._bound()
            attrs = {
                "flying.request_id": rec.id,
                "flying.priority": rec.priority,
                "flying.attempt": flight.attempt,
            }
            try:
                a = await wait_assignment(adm, fut, disconnected)
            except BaseException as exc:
                self._failed(
                    self.tracer.start_span("flying.queue", start_time=flight.since_ns, attributes=attrs), exc
                )
                raise
            now = time.time_ns()
            dispatched = min(max(flight.since_ns, _ns(rec.enqueued_at + a.queue_ms / 1000)), now)
            queued = self.tracer.start_span("flying.queue", start_time=flight.since_ns, attributes=attrs)
            queued.set_attribute("flying.queue_ms", a.queue_ms)
            queued.end(end_time=dispatched)
            attrs |= {"flying.engine": a.engine, "server.address": a.url}
            self.tracer.start_span("flying.dispatch", start_time=dispatched, attributes=attrs).end(
                end_time=now
            )
            return a

        return traced

    def _requeued(self, retry_or_fail: Callable) -> Callable:
        @functools.wraps(retry_or_fail)
        async def traced(
            adm, a, why, cause="before_first_event", engine_fault=True, counted=True, died=False
        ):
            flight = self._flights.get(adm.record.id)
            if flight is not None:
                self._end_relay(flight, "failed", f"re-dispatched: {why}")
                flight.since_ns, flight.attempt = time.time_ns(), flight.attempt + 1
            return await retry_or_fail(
                adm, a, why, cause, engine_fault=engine_fault, counted=counted, died=died
            )

        return traced

    def _relayed(self, call: Callable, stream: bool) -> Callable:
        """An upstream call in a CLIENT span whose context goes to the engine as ``traceparent``; a stream's span
        stays open until its request's end is recorded (:meth:`_finished`)."""

        @functools.wraps(call)
        async def traced(url: str, path: str, body: dict, headers: dict[str, str] | None = None):
            carrier: dict[str, str] = dict(headers or {})
            if not self._recording():  # not sampled: the engine still joins the trace
                self.propagator.inject(carrier)
                return await call(url, path, body, headers=carrier)
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
            self.propagator.inject(carrier, context=self._trace.set_span_in_context(span))
            try:
                resp = await call(url, path, body, headers=carrier)
            except BaseException as exc:
                self._failed(span, exc)
                raise
            span.set_attribute("http.response.status_code", resp.status_code)
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
                if resp.status_code >= 400:
                    span.set_status(self._trace.StatusCode.ERROR)
                span.end()
            return resp

        return traced

    def _sending_early(self, send: Callable) -> Callable:
        @functools.wraps(send)
        def traced(rec, call):
            early = send(rec, call)
            if early is not None and self._recording():
                self._sent_early.add(rec.id)
                while len(self._sent_early) > MAX_OPEN:
                    self._sent_early.pop()
            return early

        return traced

    def _taken_back(self, take_back: Callable) -> Callable:
        """An early request the admission declined: its stream's relay span ends as ``taken_back``."""

        @functools.wraps(take_back)
        def traced(early, rec, declined: bool = False):
            if early is not None:
                self._sent_early.discard(rec.id)
                if (span := self._early.pop(rec.id, None)) is not None:
                    span.set_attribute("flying.outcome", "taken_back")
                    span.end()
            return take_back(early, rec, declined)

        return traced

    def _finished(self, finish: Callable) -> Callable:
        @functools.wraps(finish)
        async def traced(rid: str, state: str, error: str = ""):
            if (flight := self._flights.pop(rid, None)) is not None:
                self._end_relay(flight, state, error)
            return await finish(rid, state, error)

        return traced

    def _finished_nowait(self, finish_nowait: Callable) -> Callable:
        @functools.wraps(finish_nowait)
        def traced(rid: str, state: str, error: str = ""):
            if (flight := self._flights.pop(rid, None)) is not None:
                self._end_relay(flight, state, error)
            return finish_nowait(rid, state, error)

        return traced

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
