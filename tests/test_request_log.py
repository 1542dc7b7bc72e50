"""gateway.request_log: the request id (the client's when valid), echoed on every /v1 response, one log line."""

from __future__ import annotations

import logging

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from gateway.request_log import RequestLog, info, request_id


@pytest.mark.parametrize("good", ["a", "req_01.2:3-x", "A" * 128, "3f2a9c1e-59f1-4d0a-8c2b-6f0e8b1d2c3a"])
def test_a_valid_client_id_is_kept(good):
    assert request_id(good) == good


@pytest.mark.parametrize(
    "bad", [None, "", "A" * 129, "has space", "new\nline", "semi;colon", "ü", "a/b", "a*"]
)
def test_an_invalid_or_missing_id_is_replaced(bad):
    rid = request_id(bad)
    assert rid != bad and len(rid) == 32 and int(rid, 16) >= 0


async def served(request: Request):
    state = info(request.scope)
    state.priority, state.engine, state.queue_ms = "high", 3, 12.34
    return JSONResponse({"id": state.request_id})


async def refused(request: Request):
    return JSONResponse({"error": "no"}, status_code=429)


async def streamed(request: Request):
    async def body():
        yield b"a"
        yield b"b"

    return StreamingResponse(body())


async def broken(request: Request):
    raise RuntimeError("bug")


@pytest.fixture
def client():
    routes = [Route(f"/v1/{f.__name__}", f) for f in (served, refused, streamed, broken)]
    app = Starlette(routes=routes + [Route("/health", served)], middleware=[Middleware(RequestLog)])
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "flying.gateway.requests"]


def test_the_client_id_is_used_echoed_and_logged_once(client, caplog):
    caplog.set_level(logging.INFO, "flying.gateway.requests")
    resp = client.get("/v1/served", headers={"X-Request-Id": "client-7"})
    assert resp.json() == {"id": "client-7"} and resp.headers["x-request-id"] == "client-7"
    [rec] = lines(caplog)
    assert rec.request_id == "client-7" and rec.status == 200 and rec.priority == "high" and rec.engine == 3
    assert rec.getMessage().startswith(
        "request client-7 GET /v1/served status=200 priority=high engine=3 queue_ms=12.3"
    )


def test_errors_streams_and_bugs_are_logged_with_their_status(client, caplog):
    caplog.set_level(logging.INFO, "flying.gateway.requests")
    assert client.get("/v1/refused", headers={"X-Request-Id": "bad id"}).status_code == 429
    assert client.get("/v1/streamed").content == b"ab"
    assert client.get("/v1/broken").status_code == 500
    statuses = [(r.status, r.priority, r.engine) for r in lines(caplog)]
    assert statuses == [(429, "-", None), (200, "-", None), (500, "-", None)]
    assert all(len(r.request_id) == 32 for r in lines(caplog)), "the invalid id was replaced"


def test_only_the_api_is_logged(client, caplog):
    caplog.set_level(logging.INFO, "flying.gateway.requests")
    resp = client.get("/health")
    assert "x-request-id" not in resp.headers and not lines(caplog)
