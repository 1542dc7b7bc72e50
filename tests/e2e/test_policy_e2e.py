"""The bind/release policy live: 4 CPU workers, the router deciding on its own (no flyctl).

A high-priority request binds a group that is released after it; a prompt larger than one engine's KV is served
by a group; a burst brings every engine back to DP (load groups formed while idle are released, their requests
continuing in DP); a router kill -9 in the middle of a burst with binds going on loses no request."""

from __future__ import annotations

import asyncio
import functools
import time

import httpx
import openai
import pytest

from flying import control
from tests.e2e.conftest import KV_TOKENS, four_engines
from tests.e2e.test_switching import wait_mode

pytestmark = pytest.mark.e2e
MODEL = "tiny-llama"
# CPU-sized group capacity, quick releases; POLICY binds no load groups (priority and long-context groups only)
# unless a test asks for them
BASE = (
    "--max-inflight-per-worker",
    "4",
    "--tp-inflight-per-engine",
    "4",
    "--sp-inflight-per-engine",
    "4",
    "--ack-timeout-s",
    "5",
)
POLICY = (*BASE, "--max-width", "1")
LOAD_ADAPTING = BASE


def restart_router(c, args) -> None:
    c.kill_router()
    c.start_router(args)


@pytest.fixture(scope="module")
def policy(tiny_model, tmp_path_factory):
    """Four engines, the router deciding on its own."""
    with four_engines(tiny_model, tmp_path_factory, "policy", POLICY) as c:
        yield c


@pytest.fixture
def oai(policy):
    return openai.OpenAI(base_url=policy.config.gateway_url + "/v1", api_key="unused", max_retries=0)


def request_hash(c, rid: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in c.client().hgetall(c.keys.request(rid)).items()}


def groups(c):
    return control.groups(c.client(), c.keys)


def wait_groups_gone(c, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not groups(c) and all(hb.mode == "dp" for hb in control.status(c.client(), c.keys).values()):
            return
        time.sleep(0.1)
    raise AssertionError(f"groups not released after {timeout_s} s: {groups(c)}")


def router_log(c) -> str:
    return c.log("router").read_text()


@functools.cache
def long_prompt(model_path, tokens: int) -> str:
    """A prompt of about ``tokens`` tokens (within a few) for the tiny model's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    words = [f"river {i} meets the sea;" for i in range(tokens)]
    lo, hi = 1, len(words)
    while lo < hi:  # the most words that stay within ``tokens``
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(tok(" ".join(words[:mid]))["input_ids"]) <= tokens else (lo, mid - 1)
    return " ".join(words[:lo])


def test_high_priority_request_binds_a_group_released_after_it(policy, oai):
    wait_groups_gone(policy)
    raw = oai.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me about the river."}],
        max_tokens=12,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Priority": "high"},
    )
    assert raw.parse().usage.completion_tokens == 12
    h = request_hash(policy, raw.headers["x-request-id"])
    assert int(h["epoch"]) > 0, f"served in DP: {h}"  # dispatched to a TP group's leader
    assert "(priority, hard preemption;" in router_log(policy)
    wait_groups_gone(policy, timeout_s=15)  # a second without TP work: released, every engine back in DP
    assert "no TP work" in router_log(policy)


def test_prompt_larger_than_one_engines_kv_is_served_by_a_group(policy, oai):
    wait_groups_gone(policy)
    prompt = long_prompt(policy.config.model_path, KV_TOKENS + 150)
    raw = oai.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=8, extra_body={"ignore_eos": True}
    )
    resp = raw.parse()
    assert resp.usage.prompt_tokens + 8 > KV_TOKENS, "the prompt must not fit one engine"
    assert resp.usage.completion_tokens == 8
    h = request_hash(policy, raw.headers["x-request-id"])
    assert int(h["epoch"]) > 0, f"served in DP: {h}"
    assert "(long, " in router_log(policy)
    with pytest.raises(openai.BadRequestError) as err:  # longer than the widest group's pooled KV: a 400
        oai.completions.create(
            model=MODEL, prompt=long_prompt(policy.config.model_path, 4 * KV_TOKENS + 100), max_tokens=8
        )
    assert str(4 * KV_TOKENS) in str(err.value)
    wait_groups_gone(policy, timeout_s=15)


async def burst(url: str, n: int, high_every: int = 0, max_tokens: int = 12) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=300) as client:

        def post(i: int):
            headers = {"X-Priority": "high"} if high_every and i % high_every == 0 else {}
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"count to {i}"}],
                "max_tokens": max_tokens,
                "ignore_eos": True,
            }
            return client.post(url + "/v1/chat/completions", json=body, headers=headers)

        return await asyncio.gather(*(post(i) for i in range(n)))


def test_burst_returns_every_engine_to_dp(policy):
    """Idle, the router forms load groups (light load); a burst makes it busy: the load groups are released
    (requests they were running continue in DP on the members that own them) and the rest of the burst is served
    in DP."""
    restart_router(policy, LOAD_ADAPTING)
    try:
        deadline = time.monotonic() + 30
        while not any(g.reason == "load" and g.state == "bound" for g in groups(policy)):
            assert time.monotonic() < deadline, "no load group formed at light load"
            time.sleep(0.1)

        async def scenario():
            task = asyncio.create_task(burst(policy.config.gateway_url, 32))
            await asyncio.to_thread(wait_mode, policy, range(4), "dp", 20)
            return time.time(), await task

        all_dp_at, responses = asyncio.run(scenario())
        assert [x.status_code for x in responses] == [200] * 32
        assert all(x.json()["usage"]["completion_tokens"] == 12 for x in responses)  # retracted ones too
        assert "load rose" in router_log(policy)
        rows = [request_hash(policy, x.headers["x-request-id"]) for x in responses]
        late = [h for h in rows if float(h["assigned_at"]) > all_dp_at]  # (none where a busy machine saw
        # every engine in DP only after the router had assigned the whole burst)
        assert all(h.get("epoch", "0") == "0" for h in late), "TP work dispatched after the burst began"
    finally:
        restart_router(policy, POLICY)
        wait_groups_gone(policy)


def test_router_kill_9_mid_burst_with_binds_loses_nothing(policy):
    r = policy.client()
    before = int(r.hget(policy.keys.stats, "assigned") or 0)

    async def scenario():
        task = asyncio.create_task(burst(policy.config.gateway_url, 30, high_every=5))
        await asyncio.sleep(0.7)
        policy.kill_router()
        waiting = r.zcard(policy.keys.queue)
        await asyncio.sleep(1.0)
        policy.start_router(POLICY)
        return waiting, await task

    waiting, responses = asyncio.run(scenario())
    assert waiting > 0, "the kill must hit while requests wait in the queue"
    assert [x.status_code for x in responses] == [200] * 30
    assert all(x.json()["usage"]["completion_tokens"] == 12 for x in responses)
    assert int(r.hget(policy.keys.stats, "assigned")) - before == 30, "each request assigned exactly once"
    records = groups(policy)
    members = [m for g in records for m in g.members]
    assert len(members) == len(set(members)), f"overlapping groups after the restart: {records}"
    wait_groups_gone(policy)


@pytest.mark.skip(
    reason="the planner, predicting with the CPU engines' measured steps (a 4-wide TP step about 130 ms against "
    "20 ms in DP), keeps this scenario's engines in DP, so the adoption this test drives never happens live; the "
    "fallback is covered against the policy and the workers' fakes (tests/test_policy.py, tests/test_releases.py)"
)
def test_requests_an_adoption_paused_instead_of_moving_resume(policy):
    """The end of a burst: light load, and the block adopts its engines' DP requests, but a long prompt's KV
    belongs to the prefix tree (only what follows it frees), so no member can hold the slices it would receive: the
    workers bind hard and pause them. The router sees them in the heartbeats (``paused``): the group is released
    after max_defer_s and they finish in DP, instead of waiting forever in a group that counted them as its own."""
    # two an engine (one runs: its KV holds one; one waits), so that at the adoption every member holds a long
    # prompt in its tree and none has room for the others' slices
    args = (*LOAD_ADAPTING, "--max-defer-s", "2", "--horizon-s", "2", "--max-inflight-per-worker", "2")
    restart_router(policy, args)
    try:
        long = long_prompt(policy.config.model_path, 370)

        async def scenario():
            async with httpx.AsyncClient(timeout=90) as client:
                body = {"model": MODEL, "max_tokens": 120, "ignore_eos": True}
                longs = [
                    client.post(
                        policy.config.gateway_url + "/v1/completions", json=body | {"prompt": f"{i}: {long}"}
                    )
                    for i in range(8)
                ]
                return await asyncio.wait_for(asyncio.gather(*longs), 60)  # paused for good: never

        longs = asyncio.run(scenario())  # (8 at once: busy, served in DP; then light, and the block adopts)
        assert [x.status_code for x in longs] == [200] * 8, [
            x.text[:300] for x in longs if x.status_code != 200
        ]
        assert all(x.json()["usage"]["completion_tokens"] == 120 for x in longs)
        log = router_log(policy)
        assert "(load, adoption," in log and "their adoption paused" in log, "the adoption did not fall back"
        assert "DP work deferred for 2 s" in log
    finally:
        restart_router(policy, POLICY)
        wait_groups_gone(policy)
