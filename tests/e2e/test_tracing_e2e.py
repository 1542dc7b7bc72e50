"""Tracing end to end: a real gateway process started with ``--otlp-endpoint`` exports its spans over OTLP/HTTP
to a collector (a tiny one here: an HTTP server that keeps what is POSTed to /v1/traces), in the trace of the
client's ``traceparent``, and the engine (loadgen's fake engine, its request heads kept) gets a ``traceparent`` of
that trace."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from flying.procs import free_port
from loadgen import fake_server
from tests.stack import gateway_process

pytestmark = pytest.mark.e2e
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


class Collector(ThreadingHTTPServer):
    """An OTLP/HTTP collector that keeps every export request it is sent."""

    def __init__(self) -> None:
        self.exports: list[ExportTraceServiceRequest] = []
        super().__init__(("127.0.0.1", free_port()), _Receive)

    def spans(self) -> list[tuple[str, str, str]]:
        """(service.name, span name, trace id) of every span received."""
        out = []
        for export in self.exports:
            for rs in export.resource_spans:
                service = next(
                    a.value.string_value for a in rs.resource.attributes if a.key == "service.name"
                )
                out += [(service, s.name, s.trace_id.hex()) for ss in rs.scope_spans for s in ss.spans]
        return out


class _Receive(BaseHTTPRequestHandler):
    server: Collector

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["content-length"]))
        if self.path == "/v1/traces":
            export = ExportTraceServiceRequest()
            export.ParseFromString(body)
            self.server.exports.append(export)
        self.send_response(200 if self.path == "/v1/traces" else 404)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[Collector]:
    server = Collector()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


class _Heads(fake_server._Conn):
    """loadgen's fake engine, keeping the bytes of every request it gets."""

    received: bytearray

    def data_received(self, data: bytes) -> None:
        self.received += data
        super().data_received(data)


@pytest.fixture
def engine() -> Iterator[tuple[str, bytearray]]:
    """The fake engine in a thread of its own: (its URL, the bytes it received)."""
    received = bytearray()
    port, loop = free_port(), asyncio.new_event_loop()

    def conn() -> _Heads:
        c = _Heads(0.0, 0.0, fake_server.EngineState())
        c.received = received
        return c

    server = loop.run_until_complete(loop.create_server(conn, "127.0.0.1", port))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", received
    loop.call_soon_threadsafe(server.close)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_spans_reach_the_collector_and_the_engine_joins_the_clients_trace(
    redis_server, keys, tiny_model, tmp_path, collector, engine
):
    engine_url, received = engine
    args = ("--otlp-endpoint", f"http://127.0.0.1:{collector.server_port}", "--otel-service-name", "gw-e2e")
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # export every 0.1 s (default 5 s)
    with gateway_process(
        redis_server.url, keys, tiny_model, tmp_path, env, args, engine_url=engine_url
    ) as url:
        body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        for stream in (False, True):
            r = httpx.post(f"{url}/v1/chat/completions", json=body | {"stream": stream},
                           headers={"traceparent": TRACEPARENT}, timeout=30)  # fmt: skip
            assert r.status_code == 200, r.text
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(collector.spans()) < 10:
            time.sleep(0.1)
    spans = collector.spans()
    names = sorted(name for _, name, _ in spans)
    assert names == sorted(["POST /v1/chat/completions", "flying.admission", "flying.queue", "flying.dispatch", "flying.relay"] * 2)  # fmt: skip
    assert {(service, trace) for service, _, trace in spans} == {("gw-e2e", TRACE_ID)}
    assert bytes(received).lower().count(f"traceparent: 00-{TRACE_ID}-".encode()) == 2
