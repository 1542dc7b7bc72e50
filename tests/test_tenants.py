"""Tenants: the key file (plain or TOML), priorities, per-gateway concurrency, the shared token buckets in the
admission script (real Redis), the 429/403 they give through the waiting room and the middleware, and a reload."""

from __future__ import annotations

import hashlib
import signal
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from flying.keys import Keys
from flying.queue import Charge, RequestQueue, TenantLimit, TenantLimited
from gateway import tenants as tenancy
from gateway.api.errors import QueueFullError
from gateway.auth import RequireKey
from gateway.metrics import GatewayMetrics
from gateway.tenants import OverPriority, PriorityNotAllowed, Tenant, Tenants, read_book
from tests.stack import gateway_on_port, gateway_process
from tests.test_gateway_waiting import admitted, room  # noqa: F401 - the fixture
from tests.test_queue import mk

TOML = """
over_priority = "refuse"

[[tenant]]
name = "team-a"
key = "ka"
max_priority = "normal"
requests_per_s = 2
tokens_per_min = 600
max_concurrent = 1

[[tenant]]
name = "team-b"
key_sha256 = "{sha}"
max_priority = "low"
over_priority = "lower"
"""


def key_file(tmp_path, text: str = TOML, name: str = "keys.toml"):
    f = tmp_path / name
    f.write_text(text.replace("{sha}", hashlib.sha256(b"kb").hexdigest()))
    return f


def test_a_toml_file_names_each_keys_tenant_and_limits(tmp_path):
    book = read_book("plain1", str(key_file(tmp_path)))
    a, b, plain = book.find("ka"), book.find("kb"), book.find("plain1")
    assert a == Tenant("team-a", "normal", 2, 600, 1, OverPriority.REFUSE)
    assert b is not None and (b.name, b.max_priority, b.over_priority) == (
        "team-b",
        "low",
        OverPriority.LOWER,
    )
    assert plain == Tenant(f"key-{hashlib.sha256(b'plain1').hexdigest()[:8]}")
    assert book.find("nope") is None and "ka" not in repr(book), "only digests are held"


def test_a_plain_list_file_still_works(tmp_path):
    book = read_book(None, str(key_file(tmp_path, "k1\n# comment\nk2  # trailing\n", "keys")))
    assert book.find("k1") and book.find("k2") and not book.find("# comment")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[tenant]]\nname = "x"\n', "tenant 1 needs exactly one of key, key_sha256"),
        ('[[tenant]]\nname = "x"\nkey = "k"\nmax_priority = "urgent"\n', "max_priority must be high"),
        ('[[tenant]]\nname = "x"\nkey = "k"\nrequests_per_s = 0\n', "requests_per_s must be > 0"),
        ('[[tenant]]\nname = "x"\nkey = "k"\nrate = 1\n', "unexpected keyword argument 'rate'"),
        ('over_priority = "drop"\n', "over_priority must be lower or refuse"),
        ('[[tenant]]\nname = "a:inflight"\nkey = "k"\n', "use letters, digits"),
        ("[[tenant]\n", "keys.toml"),
    ],
)
def test_a_bad_key_file_is_a_value_error_naming_the_problem(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        read_book(None, str(key_file(tmp_path, text)))


def test_a_priority_above_the_tenants_is_lowered_or_refused():
    lower = Tenant("t", max_priority="normal")
    assert [lower.priority(p) for p in ("high", "normal", "low")] == ["normal", "normal", "low"]
    with pytest.raises(PriorityNotAllowed, match="priority normal at most; the request asks for high"):
        Tenant("t", max_priority="normal", over_priority=OverPriority.REFUSE).priority("high")
    assert Tenant("t").priority("high") == "high"


def test_reload_swaps_the_keys_and_a_bad_file_keeps_the_old_ones(tmp_path):
    f = key_file(tmp_path)
    ts = Tenants(None, str(f))
    assert ts.book.find("ka")
    f.write_text('[[tenant]]\nname = "c"\nkey = "kc"\n')
    assert ts.reload() and ts.book.find("kc") and not ts.book.find("ka")
    f.write_text("[[tenant]\n")
    assert not ts.reload() and ts.book.find("kc")


def test_concurrency_is_counted_per_tenant():
    ts, t = Tenants(), Tenant("t", max_concurrent=2)
    assert ts.enter(t) and ts.enter(t) and not ts.enter(t)
    ts.leave(t)
    assert ts.enter(t)
    ts.leave(t), ts.leave(t)
    assert ts.in_progress == {}


async def test_the_buckets_are_shared_by_gateways_and_a_refusal_takes_nothing(aredis, keys):
    one, two = RequestQueue(aredis, keys), RequestQueue(aredis, keys)  # two gateways
    rps = Charge("a", requests_per_s=2, tokens=10)
    await one.admit(mk("r1"), charge=rps)
    await two.admit(mk("r2"), charge=rps)
    with pytest.raises(TenantLimited) as refused:
        await one.admit(mk("r3"), charge=rps)
    assert refused.value.limit is TenantLimit.REQUESTS_PER_S and 0 < refused.value.retry_after_s <= 0.5
    assert await aredis.exists(keys.request("r3")) == 0
    tpm = Charge("b", tokens_per_min=600, tokens=400)
    await one.admit(mk("t1"), charge=tpm)
    with pytest.raises(TenantLimited) as refused:
        await two.admit(mk("t2"), charge=tpm)
    assert refused.value.limit is TenantLimit.TOKENS_PER_MIN and 19 < refused.value.retry_after_s <= 20
    assert await aredis.hgetall(keys.tenant("a")) == {
        b"requests": b"2",
        b"tokens": b"20",
        b"refused_requests_per_s": b"1",
        b"finish:1": b"3",  # where team a's next normal request starts at the latest
    }
    assert await aredis.smembers(keys.tenants) == {b"a", b"b"}
    time.sleep(0.5)  # half a second refills one request
    await two.admit(mk("r4"), charge=rps)


async def test_a_tenant_over_its_rate_gets_a_429_naming_the_limit(room, aredis, keys):  # noqa: F811
    r = room()
    tenant = Tenant("team-a", requests_per_s=1)
    token = tenancy.current.set(tenant)
    try:
        await r.enqueue(admitted("a"))
        with pytest.raises(
            QueueFullError, match=r"tenant team-a is over its requests_per_s limit \(1\); retry"
        ):
            await r.enqueue(admitted("b"))
    finally:
        tenancy.current.reset(token)
    m = r.metrics
    assert m.tenant_requests.labels("team-a")._value.get() == 1
    assert m.tenant_tokens.labels("team-a")._value.get() == 8
    assert m.tenant_rejected.labels("team-a", "requests_per_s")._value.get() == 1


def test_the_middleware_serves_as_the_keys_tenant_within_its_concurrency(tmp_path):
    async def who(request):
        t = tenancy.current.get()
        return JSONResponse({"tenant": t.name if t else None})

    ts, metrics = Tenants(None, str(key_file(tmp_path))), GatewayMetrics()
    app = Starlette(
        routes=[Route("/v1/who", who)], middleware=[Middleware(RequireKey, tenants=ts, metrics=metrics)]
    )
    client = TestClient(app)
    assert client.get("/v1/who", headers={"Authorization": "Bearer kb"}).json() == {"tenant": "team-b"}
    assert client.get("/v1/who", headers={"Authorization": "Bearer zz"}).status_code == 401
    ts.in_progress["team-a"] = 1  # team-a's one request in progress
    busy = client.get("/v1/who", headers={"Authorization": "Bearer ka"})
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
    assert "max_concurrent" in busy.json()["error"]["message"]
    assert metrics.tenant_rejected.labels("team-a", "max_concurrent")._value.get() == 1
    assert metrics.rejected.labels("429", "rate_limit_exceeded")._value.get() == 1
    assert ts.in_progress == {"team-a": 1}, "the refused request left no count behind"


@pytest.mark.slow
def test_a_gateway_process_refuses_a_priority_above_the_tenants_and_reloads_its_keys_on_sighup(
    redis_server, sync_redis, keys, tiny_model, tmp_path
):
    f = key_file(tmp_path)
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with gateway_process(
        redis_server.url, keys, tiny_model, tmp_path, args=("--api-key-file", str(f))
    ) as url:
        a, b = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
        high = httpx.post(f"{url}/v1/chat/completions", json=body, headers={**a, "X-Priority": "high"})
        assert high.status_code == 403 and high.json()["error"]["code"] == "priority_not_allowed"
        deadline = time.monotonic() + 5  # (counted in Redis in the background)
        while sync_redis.hget(keys.tenant("team-a"), "refused_max_priority") != b"1":
            assert time.monotonic() < deadline, "the refusal is counted in the tenant's Redis counters"
            time.sleep(0.05)
        assert httpx.post(
            f"{url}/v1/chat/completions", json=body, headers={**b, "X-Priority": "high"}
        ).is_success
        f.write_text('[[tenant]]\nname = "c"\nkey = "kc"\nmax_priority = "low"\nover_priority = "refuse"\n')
        gw = gateway_on_port(url.rsplit(":", 1)[1])
        gw.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/v1/models", headers=a).status_code != 401:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer kc"}).status_code == 200
        metrics = httpx.get(f"{url}/metrics").text
        c = {"Authorization": "Bearer kc"}
        plain = httpx.post(f"{url}/v1/chat/completions", json=body, headers=c)
        assert plain.is_success, (
            "asking for no priority runs at the tenant's highest, not the refused default"
        )
        refused = httpx.post(f"{url}/v1/chat/completions", json=body, headers={**c, "X-Priority": "normal"})
        assert refused.status_code == 403 and refused.json()["error"]["param"] == "X-Priority"
        tier = httpx.post(f"{url}/v1/chat/completions", json={**body, "service_tier": "default"}, headers=c)
        assert tier.status_code == 403 and tier.json()["error"]["param"] == "service_tier", (
            "where it was asked"
        )
    assert 'flying_gateway_tenant_rejected_total{reason="max_priority",tenant="team-a"} 1.0' in metrics
    assert 'flying_gateway_tenant_requests_total{tenant="team-b"} 1.0' in metrics
    lowered = (
        'flying_gateway_tenant_priority_lowered_total{granted="low",requested="high",tenant="team-b"} 1.0'
    )
    assert lowered in metrics, "team-b's high request ran at its highest, low"
    assert (
        'flying_gateway_requests_total{priority="low",route="/v1/chat/completions",status="200"} 1.0'
        in metrics
    )
    log = (tmp_path / "gateway.log").read_text()
    assert "API keys reloaded: 1 keys" in log and "Bearer" not in log, "keys stay out of the log"
    assert "status=200 priority=low requested_priority=high" in log


async def steady_waits(q: RequestQueue, flood: int) -> list[int]:
    """Dispatch rounds that each of tenant B's requests waits (one every 4th round; tenant C one in each of the
    other rounds) while the router assigns one request per round, after tenant A put ``flood`` requests in the
    queue at the start."""
    waits, sent = [], {}
    for i in range(flood):
        await q.admit(mk(f"a{i}"), charge=Charge("a"))
    for t in range(120):
        tenant = "b" if t % 4 == 0 else "c"
        rid = f"{tenant}{t}"
        await q.admit(mk(rid), charge=Charge(tenant))
        sent[rid] = t
        (head,) = await q.peek(1)
        assert await q.assign(head, 0, "http://e0")
        if head.id.startswith("b"):
            waits.append(t - sent[head.id] + 1)
    return waits


async def test_a_tenant_that_floods_its_class_does_not_delay_another_tenant(aredis, keys):
    """Fair sharing inside a class: with tenant A's 200 requests queued ahead, tenant B's steady requests wait
    as many dispatch rounds as without them (arrival order would make each wait some 200 rounds)."""
    alone = await steady_waits(RequestQueue(aredis, keys), flood=0)
    flooded = await steady_waits(RequestQueue(aredis, Keys(keys.prefix + "-f")), flood=200)
    assert len(flooded) >= len(alone) - 1 and len(alone) == 30
    assert sum(flooded) / len(flooded) <= 1.2 * sum(alone) / len(alone), (alone, flooded)
