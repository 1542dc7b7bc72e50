"""A request that crashes the engine running it (a worker test hook crashes SGLang's scheduler on a marked stop
string): it stops at its second engine with a clear 500, while the streams that merely shared those engines are
re-dispatched and finish. Three CPU engines in DP, the real ``openai`` client."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from devstack.cluster import Cluster, ClusterConfig
from flying import settings

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


async def one_stream(client: openai.AsyncOpenAI, i: int) -> str:
    stream = await client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": f"story number {i}"}], max_tokens=48,
        temperature=0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    reason = None
    async for chunk in stream:
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
    streams = [asyncio.create_task(one_stream(client, i)) for i in range(20)]
    await asyncio.sleep(0.5)  # the streams spread over the engines first
    bad = await poison(client)
    done = await asyncio.gather(*streams, return_exceptions=True)
    await client.close()
    return done, bad


def test_a_poison_request_stops_at_its_second_engine_and_the_other_streams_finish(crashing):
    t0 = time.monotonic()
    done, bad = asyncio.run(run(crashing.config.gateway_url))
    assert bad.status_code == 500, bad
    err = bad.body["error"] if isinstance(bad.body, dict) and "error" in bad.body else bad.body
    assert err["type"] == "server_error" and err["code"] == "request_crashed_engines", err
    assert done == ["length"] * 20, done  # every stream finished, re-dispatched where its engine died
    dead = [i for i, p in crashing.workers.items() if p.poll() is not None]
    assert 1 <= len(dead) <= 2, f"engines {dead} died: the poison request was tried on a third"
    r = crashing.client()
    states = [r.hget(crashing.keys.request(k.decode().split(":")[-1]), "state") for k in r.scan_iter(
        f"{crashing.keys.prefix}:req:*")]  # fmt: skip
    assert states.count(b"failed") == 1 and states.count(b"done") == 20, states
    assert "not tried again" in crashing.log("gateway").read_text(), "the gateway logs what it ended, and why"
    print(f"{len(dead)} engines died; {time.monotonic() - t0:.1f} s")
