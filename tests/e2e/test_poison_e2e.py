"""A request that crashes the engine running it (a worker test hook crashes SGLang's scheduler running a batch that
holds a request with a marked stop string): the engine's crash report names it, so it stops at that one engine with
a clear 500, while the streams that merely shared the engine are re-dispatched and finish. Three CPU engines in DP,
the real ``openai`` client."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from devstack.cluster import Cluster, ClusterConfig
from flying import settings
from flying.messages import CrashReport, decode

pytestmark = pytest.mark.e2e
MARKER = "<poison-stop>"


@pytest.fixture(scope="module")
def crashing(tiny_model, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(settings.TEST_CRASH_STOP, MARKER)  # the workers inherit it
        config = ClusterConfig(
            model_path=tiny_model, num_engines=3, log_dir=tmp_path_factory.mktemp("poison"), max_total_tokens=4096,
            bindable=False, router_args=("--manual",),
        )  # fmt: skip
        with Cluster(config, progress=print) as c:
            mp.delenv(settings.TEST_CRASH_STOP)
            yield c


async def one_stream(client: openai.AsyncOpenAI, i: int, started: asyncio.Event) -> str:
    stream = await client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": f"story number {i}"}], max_tokens=48,
        temperature=0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    reason = None
    async for chunk in stream:
        started.set()
        if chunk.choices and chunk.choices[0].finish_reason:
            reason = chunk.choices[0].finish_reason
    return reason or ""


async def poison(client: openai.AsyncOpenAI) -> openai.APIStatusError:
    try:
        await client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "crash"}], max_tokens=8, stop=[MARKER]
        )
    except openai.APIStatusError as exc:
        return exc
    raise AssertionError("the poison request was answered")


async def run(url: str) -> tuple[list[str | BaseException], openai.APIStatusError]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=240)
    started = [asyncio.Event() for _ in range(20)]
    streams = [asyncio.create_task(one_stream(client, i, started[i])) for i in range(20)]
    # the streams spread over the engines and decode first: the poison request's prefill is a batch of its own
    await asyncio.wait([asyncio.create_task(e.wait()) for e in started], timeout=120)
    bad = await poison(client)
    done = await asyncio.gather(*streams, return_exceptions=True)
    await client.close()
    return done, bad


def test_a_poison_request_stops_at_the_engine_it_crashed_and_the_other_streams_finish(crashing):
    t0 = time.monotonic()
    done, bad = asyncio.run(run(crashing.config.gateway_url))
    assert bad.status_code == 500, bad
    err = bad.body["error"] if isinstance(bad.body, dict) and "error" in bad.body else bad.body
    assert err["type"] == "server_error" and err["code"] == "request_crashed_engines", err
    assert done == ["length"] * 20, done  # every stream finished, re-dispatched where its engine died
    r, keys = crashing.client(), crashing.keys
    dead = [i for i in crashing.workers if r.exists(keys.crash(i))]
    assert len(dead) == 1, f"engines {dead} crashed: the poison request was tried again"
    crashing.workers[dead[0]].wait(timeout=30)  # (its launcher exits with it)
    alive = [i for i, p in crashing.workers.items() if p.poll() is None]
    assert len(alive) == 2, f"engines {alive} alone are alive: one died another way"
    report = decode(r.get(keys.crash(dead[0])), CrashReport)
    assert len(report.batch) == 1 and report.error.startswith("RuntimeError"), report
    rid = report.batch[0].split("~")[0]
    assert r.hget(keys.request(rid), "state") == b"failed"
    records = [r.hgetall(k) for k in r.scan_iter(f"{keys.prefix}:req:*")]
    states = [rec[b"state"] for rec in records]
    assert states.count(b"failed") == 1 and states.count(b"done") == 20, states
    assert all(rec[b"suspect"] == b"0" for rec in records), (
        "the streams it held outside that batch: not suspect"
    )
    gateway_log = crashing.log("gateway").read_text()
    assert "its crash report names it" in gateway_log and "not tried again" in gateway_log, "logged, and why"
    print(f"{len(dead)} engine died; {time.monotonic() - t0:.1f} s")
