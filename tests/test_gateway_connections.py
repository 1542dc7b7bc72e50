"""Limits at the door (gateway.http.connections), each held by a real gateway process to hostile input sent over a raw
socket: header bytes and fields (431), URL length (414), body size (413), a slow head (408), a silent or idle
keep-alive connection (closed), and open connections beyond the cap (503 with Retry-After). One gateway serves
those tests (small limits, 1 s timeouts). A second one, stopped (SIGSTOP) while busy as an overloaded box stalls
it, shows that its timers never drop a request that arrived during the stall."""

from __future__ import annotations

import json
import select
import socket
import time
import uuid
from collections.abc import Iterator

import httpx
import psutil
import pytest

from flying.keys import Keys
from gateway.api.errors import HeadersTooLarge
from gateway.config import GatewayConfig
from gateway.http.connections import ConnectionLimits, raw_response
from tests.stack import gateway_on_port, gateway_process

MAX_CONNECTIONS = 8
ARGS = ("--max-header-bytes", "4096", "--max-header-count", "20", "--max-url-bytes", "1024",
        "--header-timeout-s", "1", "--body-timeout-s", "1", "--keep-alive-timeout-s", "1", "--max-connections", str(MAX_CONNECTIONS))  # fmt: skip


@pytest.fixture(scope="module")
def gateway(redis_server, tiny_model, tmp_path_factory) -> Iterator[tuple[str, int]]:
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    logs = tmp_path_factory.mktemp("door")
    with gateway_process(redis_server.url, keys, tiny_model, logs, args=ARGS) as url:
        yield url, int(url.rsplit(":", 1)[1])


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def answer(s: socket.socket) -> bytes:
    """Everything the gateway sends until it closes the connection."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def one_response(s: socket.socket) -> bytes:
    """One whole response (by its content-length), leaving the connection open."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += s.recv(65536)
    head, body = raw.split(b"\r\n\r\n", 1)
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def request(path: str = "/health", headers: dict[str, str] | None = None) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "Host: gw", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


@pytest.mark.slow
def test_a_request_within_the_limits_is_served(gateway):
    url, port = gateway
    fields = {f"X-F{i}": "v" * 100 for i in range(15)}  # 15 fields, about 1.6 KB
    assert httpx.get(f"{url}/health", headers=fields).status_code == 200


@pytest.mark.slow
def test_a_megabyte_header_is_a_431_while_it_arrives(gateway):
    _, port = gateway
    with connect(port) as s:
        s.sendall(request(headers={"X-Big": "a" * 1_000_000}))
        raw = answer(s)
    assert status(raw) == 431 and b"request_header_fields_too_large" in raw and b"connection: close" in raw


@pytest.mark.slow
def test_too_many_header_fields_is_a_431(gateway):
    _, port = gateway
    with connect(port) as s:
        s.sendall(request(headers={f"X-F{i}": "v" for i in range(21)}))
        raw = answer(s)
    assert status(raw) == 431 and b"more than 20 header fields" in raw


@pytest.mark.slow
def test_a_long_url_is_a_414(gateway):
    _, port = gateway
    with connect(port) as s:
        s.sendall(request("/health?" + "q" * 2000))
        raw = answer(s)
    assert status(raw) == 414 and b"uri_too_long" in raw


@pytest.mark.slow
def test_a_body_beyond_the_limit_is_a_413(gateway):
    url, _ = gateway
    big = b"x" * (GatewayConfig(model_path="m").max_body_bytes + 1)
    r = httpx.post(f"{url}/v1/chat/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413


@pytest.mark.slow
def test_a_slow_head_is_a_408_after_the_header_timeout(gateway):
    _, port = gateway
    with connect(port) as s:
        t0 = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\nX-Slow: ")
        raw = answer(s)
        took = time.monotonic() - t0
    assert status(raw) == 408 and 0.9 < took < 4.0, took


@pytest.mark.slow
def test_a_body_shorter_than_its_content_length_is_a_408_after_the_body_timeout(gateway):
    """A client that declares more than it sends no longer holds the request open for ever."""
    _, port = gateway
    with connect(port) as s:
        t0 = time.monotonic()
        s.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n'
                  b'Content-Length: 100\r\n\r\n{"a":1}')  # fmt: skip
        raw = one_response(s)
        took = time.monotonic() - t0
    body = json.loads(raw.split(b"\r\n\r\n", 1)[1])
    assert status(raw) == 408 and 0.9 < took < 4.0, took
    assert body["error"]["code"] == "request_timeout" and "7 of the 100 bytes" in body["error"]["message"]
    assert b"connection: close" in raw.lower()


@pytest.mark.slow
def test_a_silent_connection_and_an_idle_keep_alive_one_are_closed(gateway):
    _, port = gateway
    with connect(port) as silent, connect(port) as idle:
        t0 = time.monotonic()
        idle.sendall(request())
        assert status(one_response(idle)) == 200
        assert answer(silent) == b"" and answer(idle) == b""
        assert time.monotonic() - t0 < 4.0


@pytest.mark.slow
def test_connections_beyond_the_cap_get_503_with_retry_after_not_a_hang(gateway):
    url, port = gateway
    time.sleep(2.5)  # the other tests' connections are gone
    held = [connect(port) for _ in range(MAX_CONNECTIONS)]
    try:
        with connect(port) as extra:
            extra.sendall(request())
            raw = answer(extra)
        assert status(raw) == 503 and b"retry-after: 1" in raw.lower() and b"too_many_connections" in raw
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 5
    while httpx.get(f"{url}/health").status_code != 200:  # served again once they are closed
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_the_limits_are_validated_and_a_refusal_is_a_whole_response():
    with pytest.raises(ValueError, match="max_header_count must be >= 1"):
        ConnectionLimits(max_header_count=0)
    with pytest.raises(ValueError, match="header_timeout_s must be > 0"):
        GatewayConfig(model_path="m", header_timeout_s=0)
    raw = raw_response(HeadersTooLarge("too big"))
    head, body = raw.split(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ") and f"content-length: {len(body)}".encode() in head


STALL_TIMEOUT_S = 1.0  # the stalled gateway's keep-alive and header timeouts


@pytest.fixture(scope="module")
def stalled_gateway(redis_server, tiny_model, tmp_path_factory) -> Iterator[tuple[int, psutil.Process]]:
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    logs = tmp_path_factory.mktemp("stall")
    timeouts = ("--keep-alive-timeout-s", str(STALL_TIMEOUT_S), "--header-timeout-s", str(STALL_TIMEOUT_S))
    with gateway_process(redis_server.url, keys, tiny_model, logs, args=timeouts) as url:
        port = url.rsplit(":", 1)[1]
        yield int(port), gateway_on_port(port)


def response_or_error(s: socket.socket) -> int | str:
    """The status of the one response on ``s``, or how the connection failed (closed, reset)."""
    raw = b""
    try:
        while b"\r\n\r\n" not in raw:
            if not (chunk := s.recv(65536)):
                return "closed without an answer"
            raw += chunk
    except OSError as exc:
        return repr(exc)
    return status(raw)


@pytest.mark.slow
def test_requests_that_arrive_while_the_gateway_is_stalled_are_answered_not_reset(stalled_gateway):
    """Keep-alive connections reused, and silent connections that send their request, while the gateway's event
    loop is stalled past both timeouts: on resuming it runs the due timers before it reads the sockets, and
    must answer every such request (before: it closed the connections, and their clients saw resets)."""
    port, gw = stalled_gateway
    reused = [connect(port) for _ in range(100)]
    for s in reused:
        s.sendall(request())
        assert status(one_response(s)) == 200
    silent = [connect(port) for _ in range(100)]
    time.sleep(0.2)  # accepted: their header timers run
    busy = [connect(port) for _ in range(4)]
    for s in busy:
        s.sendall(
            request() * 300
        )  # pipelined: the gateway is busy when it stops, not waiting for the sockets
    gw.suspend()
    try:
        time.sleep(STALL_TIMEOUT_S + 0.5)  # every timer is due
        # what an HTTP client's pool does before reusing a connection: one the gateway closed before it stopped
        # (a slow start) is readable (its end) and not reused
        reused = [s for s in reused if not select.select([s], [], [], 0)[0]]
        for s in reused + silent:
            s.sendall(request())
    finally:
        gw.resume()
    assert len(reused) >= 50, "too few connections were still open when the gateway stopped"
    outcomes = [response_or_error(s) for s in reused + silent]
    errors = [o for o in outcomes if o != 200]
    assert not errors, f"{len(errors)} of {len(outcomes)} requests got no answer: {sorted(set(errors))}"
    for s in reused + silent + busy:
        s.close()
