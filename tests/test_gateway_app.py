"""Gateway HTTP edge with a real Redis and no workers: validation, error shapes, 503, queue-full, health."""

from __future__ import annotations

import time

import pytest
from starlette.testclient import TestClient

from flying.messages import Heartbeat, encode
from gateway.app import create_app
from gateway.config import GatewayConfig


class CountWords:
    def chat_ids(self, req):
        return [1] * (sum(len(m.text().split()) for m in req.messages) + 3)

    def completion(self, req):
        return len(req.prompt) if isinstance(req.prompt, list) else len(req.prompt.split())


@pytest.fixture
def client(redis_server, keys):
    cfg = GatewayConfig(
        model_path="unused",
        redis_url=redis_server.url,
        key_prefix=keys.prefix,
        max_queue=2,
        queue_timeout_s=1.0,
        no_worker_grace_s=0.5,
    )
    with TestClient(create_app(cfg, count_tokens=CountWords())) as c:
        yield c


def fake_worker(sync_redis, keys, engine=0, context_len=64, kv=100):
    hb = Heartbeat(
        engine=engine,
        url="http://127.0.0.1:9",
        pid=1,
        model="tiny-llama",
        launch_id="L",
        context_len=context_len,
        max_total_tokens=kv,
        free_kv_tokens=kv,
        ts=time.time(),
    )
    sync_redis.set(keys.worker(engine), encode(hb), px=60_000)
    sync_redis.sadd(keys.workers, engine)
    sync_redis.set(keys.ready(engine), "L")


def ok_body(**kw):
    return {"model": "tiny-llama", "messages": [{"role": "user", "content": "hello there"}], **kw}


def assert_error(resp, status, code=None, param=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code:
        assert err["code"] == code
    if param:
        assert err["param"] == param


def test_no_live_workers_is_503(client):
    assert_error(client.post("/v1/chat/completions", json=ok_body()), 503, "no_live_workers")


def test_unknown_model_is_404(client, sync_redis, keys):
    fake_worker(sync_redis, keys)
    assert_error(
        client.post("/v1/chat/completions", json=ok_body(model="gpt-9")), 404, "model_not_found", "model"
    )


def test_context_too_long_states_the_limit(client, sync_redis, keys):
    fake_worker(sync_redis, keys, context_len=64, kv=100)
    resp = client.post("/v1/chat/completions", json=ok_body(max_tokens=60))
    assert_error(resp, 400, "context_length_exceeded", "max_tokens")
    assert "64" in resp.json()["error"]["message"]
    long = ok_body(messages=[{"role": "user", "content": "word " * 80}])
    assert_error(client.post("/v1/chat/completions", json=long), 400, "context_length_exceeded", "messages")


def test_non_positive_max_tokens(client, sync_redis, keys):
    fake_worker(sync_redis, keys)
    assert_error(client.post("/v1/chat/completions", json=ok_body(max_tokens=0)), 400, param="max_tokens")
    assert_error(client.post("/v1/chat/completions", json=ok_body(max_tokens=-5)), 400, param="max_tokens")


def test_unassigned_request_times_out_with_504_and_leaves_the_queue(client, sync_redis, keys):
    fake_worker(sync_redis, keys)  # live but no router runs: nothing gets assigned
    assert_error(client.post("/v1/chat/completions", json=ok_body(max_tokens=4)), 504, "queue_timeout")
    assert sync_redis.zcard(keys.queue) == 0


def test_queue_full_is_429(client, sync_redis, keys):
    fake_worker(sync_redis, keys)
    sync_redis.zadd(keys.queue, {"x1": 1, "x2": 2})
    resp = client.post("/v1/chat/completions", json=ok_body(max_tokens=4))
    assert_error(resp, 429, "rate_limit_exceeded")
    assert int(resp.headers["retry-after"]) >= 1


def test_routes_methods_body_size(client):
    assert_error(client.get("/v1/nope"), 404)
    assert_error(client.post("/v1/chat/completions/", json=ok_body(), follow_redirects=False), 404)
    assert_error(client.get("/v1/chat/completions"), 405)
    assert_error(client.post("/v1/chat/completions", content=b"x" * (5 * 1024 * 1024)), 413)


def test_two_different_priority_headers_are_a_400(client):
    headers = [("X-Priority", "high"), ("X-Priority", "low")]
    resp = client.post("/v1/chat/completions", json=ok_body(), headers=headers)
    assert_error(resp, 400)
    assert resp.json()["error"]["param"] == "X-Priority" and "send one X-Priority header" in resp.text


def test_a_gzip_body_is_read_and_other_encodings_are_a_415(client):
    import gzip
    import json

    body = json.dumps({"model": "tiny-llama", "messages": [], "max_tokens": 4}).encode()
    sent = client.post(
        "/v1/chat/completions", content=gzip.compress(body), headers={"content-encoding": "gzip"}
    )
    assert_error(sent, 400)  # the body was read: its empty messages are what is wrong
    assert "messages must contain at least one message" in sent.json()["error"]["message"]
    assert_error(client.post("/v1/chat/completions", content=body, headers={"content-encoding": "br"}), 415)
    assert_error(
        client.post("/v1/chat/completions", content=b"not gzip", headers={"content-encoding": "gzip"}), 400
    )
    for broken in (
        gzip.compress(body)[:-6],
        gzip.compress(body) + gzip.compress(body),
        gzip.compress(body) + b"x",
    ):
        resp = client.post("/v1/chat/completions", content=broken, headers={"content-encoding": "gzip"})
        assert_error(resp, 400)
        assert "not one whole gzip stream" in resp.text  # cut short, two streams, trailing bytes
    bomb = gzip.compress(b" " * (5 * 1024 * 1024))  # a few kB that unpack beyond the body limit
    assert_error(client.post("/v1/chat/completions", content=bomb, headers={"content-encoding": "gzip"}), 413)


def test_health_and_models(client, sync_redis, keys):
    assert client.get("/health").json()["live_workers"] == []
    fake_worker(sync_redis, keys, context_len=64, kv=100)
    time.sleep(0.3)  # the gateway caches the worker view for 250 ms
    assert client.get("/health").json()["live_workers"] == [0]
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == "tiny-llama" and card["max_model_len"] == 64


def test_health_is_degraded_without_a_live_engine_or_a_router(redis_server, sync_redis, keys):
    """No engine: /health 503 degraded with Retry-After. An engine and a router lease: 200. The lease gone for
    longer than the grace: /health degraded again and new requests 503 no_router with Retry-After."""
    cfg = GatewayConfig(
        model_path="unused", redis_url=redis_server.url, key_prefix=keys.prefix, no_router_grace_s=0.5,
        monitor_s=0.05,
    )  # fmt: skip
    with TestClient(create_app(cfg, count_tokens=CountWords())) as c:
        resp = c.get("/health")
        assert resp.status_code == 503 and resp.headers["retry-after"] == "2"
        assert resp.json()["status"] == "degraded" and resp.json()["reasons"] == ["no live engine"]
        fake_worker(sync_redis, keys)
        sync_redis.set(keys.router_lease, "r1", px=60_000)
        time.sleep(0.2)
        assert c.get("/health").json()["status"] == "ok"
        sync_redis.delete(keys.router_lease)
        time.sleep(0.8)
        resp = c.get("/health")
        assert resp.status_code == 503 and "no router" in resp.json()["reasons"][0]
        resp = c.post("/v1/chat/completions", json=ok_body(max_tokens=4))
        assert_error(resp, 503, "no_router")
        assert resp.headers["retry-after"] == "2"
        sync_redis.set(keys.router_lease, "r2", px=60_000)  # a standby took over
        time.sleep(0.2)
        assert c.get("/health").status_code == 200


async def test_a_stream_whose_client_left_before_it_started_is_still_cleaned_up():
    """The relay's own cleanup runs only once it has started; a client gone before that gets ``unstarted``."""
    import asyncio

    from gateway.api.replies import RelayResponse
    from gateway.http.disconnect import watch_disconnect

    ran, dropped = [], []

    async def relay():
        ran.append(1)
        yield b"data: x\n\n"

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        await asyncio.sleep(10)  # the client is gone: the start of the response never gets out

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    response = RelayResponse(
        relay(), {}, lambda: dropped.append(1), asyncio.ensure_future(watch_disconnect(receive))
    )
    await asyncio.wait_for(response(scope, receive, send), 5)
    assert dropped == [1] and ran == []

    async def fast_send(message):
        pass

    async def never():
        await asyncio.sleep(10)

    dropped.clear()
    response = RelayResponse(
        relay(), {}, lambda: dropped.append(1), asyncio.ensure_future(watch_disconnect(never))
    )
    await asyncio.wait_for(response(scope, never, fast_send), 5)
    assert dropped == [] and ran == [1], "a stream that ran cleans up itself"


def test_a_body_declared_as_something_other_than_json_is_a_415(client, sync_redis, keys):
    import json

    fake_worker(sync_redis, keys)
    body = json.dumps(ok_body(max_tokens=4)).encode()
    for media in ("text/plain", "text/plain; charset=utf-8", "multipart/form-data; boundary=x"):
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
            resp = client.post(path, content=body, headers={"content-type": media})
            assert_error(resp, 415, code="unsupported_media_type")
            assert "application/json" in resp.json()["error"]["message"]
    assert sync_redis.zcard(keys.queue) == 0, "nothing was queued"
    # JSON by any of its names, no type, or curl -d's default is read (empty messages: what is wrong)
    for media in ("application/json", "application/json; charset=utf-8", "application/vnd.api+json", None,
                  "application/x-www-form-urlencoded"):  # fmt: skip
        headers = {"content-type": media} if media else {}
        bad = json.dumps({"model": "tiny-llama", "messages": []}).encode()
        assert_error(client.post("/v1/chat/completions", content=bad, headers=headers), 400)


def test_unknown_stream_options_are_a_400_naming_them(client):
    resp = client.post(
        "/v1/chat/completions", json=ok_body(stream=True, stream_options={"include_usage": True, "usage": 1})
    )
    assert_error(resp, 400, param="stream_options.usage")
    assert "stream_options.usage" in resp.json()["error"]["message"]
