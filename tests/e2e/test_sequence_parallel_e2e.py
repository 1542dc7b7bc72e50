"""Sequence-parallel steps inside a bound group, on real SGLang CPU workers: a prompt prefilled in SP steps (chunked
over several steps, mixed with decodes) gives tp=1's prompt log-probs and greedy text, decodes on in TP, and the
release leaves DP bit-exact; at width 4 against a stock tp=1 server; with adopted requests and a scatter; a request
sent to a follower; the router spreading a group's requests over its members, each kept by its owner on a scatter."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from devstack.cluster import Cluster, ClusterConfig
from flying import control
from tests.e2e.test_switching import generate, prompt_logprobs, wait_mode, worker_url

pytestmark = pytest.mark.e2e
SHORT = [(13 * i + 1) % 900 + 5 for i in range(24)]
LONG = [(7 * i + 3) % 1000 + 5 for i in range(300)]  # five 64-token chunks
CHUNK = 64


class Running:
    """One request in a thread."""

    def __init__(self, url: str, ids: list[int], n: int) -> None:
        self.out: dict = {}
        self.thread = threading.Thread(target=lambda: self.out.update(generate(url, ids, n)))
        self.thread.start()

    def join(self) -> dict:
        self.thread.join(300)
        return self.out


def decode_time(url: str, n: int) -> float:
    t0 = time.monotonic()
    generate(url, SHORT, n)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def chunked(tiny_model, tmp_path_factory):
    """Two engines with small prefill chunks and mixed batches (a chunk and running decodes in one step)."""
    config = ClusterConfig(
        model_path=tiny_model,
        num_engines=2,
        log_dir=tmp_path_factory.mktemp("sp-cluster"),
        max_total_tokens=4096,
        router_args=("--manual",),
        worker_args=("--", "--chunked-prefill-size", str(CHUNK), "--enable-mixed-chunk"),
    )
    with Cluster(config, progress=print) as c:
        yield c


def bind_sp(c, members: tuple[int, ...], threshold: int = 16, adopt: bool = False) -> int:
    epoch = control.bind(c.client(), c.keys, members, adopt=adopt, sp_threshold=threshold)
    wait_mode(c, members, "tp", epoch=epoch)
    return epoch


def release(c, members: tuple[int, ...], epoch: int, scatter: bool = False) -> None:
    control.release(c.client(), c.keys, members, epoch, scatter=scatter)
    wait_mode(c, members, "dp")


def sp_steps(c, engine: int) -> int:
    return control.status(c.client(), c.keys)[engine].steps_sp


def assert_matches(ours: dict, ref: dict, what: str) -> None:
    diffs = [abs(a - b) for a, b in zip(prompt_logprobs(ours), prompt_logprobs(ref))]
    assert len(diffs) == len(prompt_logprobs(ref)) > 200
    assert max(diffs) <= 1e-5, f"{what}: prompt log-probs differ by up to {max(diffs):.2e}"
    assert ours["output_ids"] == ref["output_ids"], f"{what}: greedy text differs"


def test_a_chunked_sp_prefill_matches_tp1_and_the_release_leaves_dp_bit_exact(chunked):
    url = worker_url(chunked, 0)
    ref = generate(url, LONG, 16)  # DP: tp=1's arithmetic, the same chunks
    epoch = bind_sp(chunked, (0, 1))
    before = sp_steps(chunked, 0)
    ours = generate(url, LONG, 16)
    assert sp_steps(chunked, 0) - before >= len(prompt_logprobs(ref)) // CHUNK  # every chunk an SP step
    assert_matches(ours, ref, "SP prefill, TP decode")
    release(chunked, (0, 1), epoch)
    after = generate(url, LONG, 16)
    assert after["meta_info"]["input_token_logprobs"] == ref["meta_info"]["input_token_logprobs"]
    assert after["meta_info"]["output_token_logprobs"] == ref["meta_info"]["output_token_logprobs"]


def test_sp_steps_mixed_with_decodes_give_each_request_its_own_text(chunked):
    url, n = worker_url(chunked, 0), 120
    refs = [generate(url, SHORT, n), generate(url, LONG, 8)]
    epoch = bind_sp(chunked, (0, 1))
    try:
        wait = decode_time(url, n) * 0.2
        decoding = Running(url, SHORT, n)
        time.sleep(wait)
        assert decoding.thread.is_alive(), "the decoding request finished before the prefill: make it longer"
        long = generate(url, LONG, 8)  # its chunks share steps with the running decode
        short = decoding.join()
    finally:
        release(chunked, (0, 1), epoch)
    assert short["output_ids"] == refs[0]["output_ids"]
    assert_matches(long, refs[1], "SP prefill mixed with a decode")


def test_decode_steps_above_the_threshold_run_sp_and_give_dp_s_text(chunked):
    """With a threshold of 2 batched tokens, the decode steps of three requests run in SP too (as Shift
    Parallelism's base configuration): each member its slice of the sequences through its full weights."""
    url, n = worker_url(chunked, 0), 24
    prompts = [SHORT, SHORT[::-1], [(5 * i + 2) % 900 + 5 for i in range(20)]]
    refs = [generate(url, p, n) for p in prompts]
    epoch = bind_sp(chunked, (0, 1), threshold=2)
    try:
        before = sp_steps(chunked, 0)
        runs = [Running(url, p, n) for p in prompts]
        got = [r.join() for r in runs]
        # the decode steps too, not only the (at most one per prompt) prefills; the requests start a moment
        # apart, so the few steps in which one decodes alone stay TP
        assert sp_steps(chunked, 0) - before >= len(prompts) + n // 2
    finally:
        release(chunked, (0, 1), epoch)
    for ours, ref in zip(got, refs):
        assert ours["output_ids"] == ref["output_ids"], "SP decode: greedy text differs from DP's"


def test_adopted_requests_decode_beside_an_sp_prefill_and_scatter_back_to_dp(chunked):
    urls, n = [worker_url(chunked, i) for i in (0, 1)], 200
    refs = [generate(urls[1], SHORT, n), generate(urls[0], LONG, 8)]
    wait = decode_time(urls[1], n) * 0.15
    adopted = Running(urls[1], SHORT, n)
    time.sleep(wait)
    epoch = bind_sp(chunked, (0, 1), adopt=True)
    assert adopted.thread.is_alive(), "the request finished before the bind: make it longer"
    long = generate(urls[0], LONG, 8)
    release(chunked, (0, 1), epoch, scatter=True)
    got = adopted.join()
    assert got["output_ids"] == refs[0]["output_ids"] and got["meta_info"]["num_retractions"] == 0
    assert_matches(long, refs[1], "SP prefill beside an adopted request")


def test_width_4_sp_prefill_matches_a_stock_tp1_server(cluster4, stock_server):
    text = [
        (11 * i + 5) % 1000 + 5 for i in range(560)
    ]  # more than one engine's KV (512): it needs the group
    members = (0, 1, 2, 3)
    epoch = bind_sp(cluster4, members)
    try:
        ours = generate(worker_url(cluster4, 0), text, 8)
        assert sp_steps(cluster4, 0) >= 1
    finally:
        release(cluster4, members, epoch)
    assert_matches(ours, generate(stock_server, text, 8), "width-4 SP prefill vs stock tp=1")


def test_a_request_sent_to_a_follower_runs_in_the_group_and_streams_from_the_follower(chunked):
    follower = worker_url(chunked, 1)
    ref = generate(follower, LONG, 16)  # DP on engine 1
    epoch = bind_sp(chunked, (0, 1))
    try:
        before = sp_steps(chunked, 0)
        ours = generate(follower, LONG, 16)  # its owner follows the group: the leader runs it
        assert sp_steps(chunked, 0) > before  # prefilled by the group, in SP steps
        assert control.status(chunked.client(), chunked.keys)[1].mode == "tp"
    finally:
        release(chunked, (0, 1), epoch)
    assert_matches(ours, ref, "a follower's own request run by its group")


def test_a_follower_refuses_a_constrained_request_at_once_and_the_gateway_sends_them_to_the_leader(chunked):
    """A grammar's state lives in the process that runs it: a follower cannot hand a JSON-mode request to its
    leader. Sent to the follower directly it gets a 503 saying so (it used to wait for the group's release);
    through the gateway every such request goes to the leader, none to the follower."""
    c = chunked
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "a JSON object"}], "max_tokens": 8,
            "temperature": 0, "response_format": {"type": "json_object"}}  # fmt: skip
    epoch = bind_sp(c, (0, 1))
    try:
        t0 = time.monotonic()
        direct = httpx.post(worker_url(c, 1) + "/v1/chat/completions", json=body, timeout=30)
        assert direct.status_code == 503 and "constrained" in direct.text, direct.text
        assert time.monotonic() - t0 < 10
        r = c.client()

        async def through_gateway() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                url = c.config.gateway_url + "/v1/chat/completions"
                return await asyncio.gather(*(client.post(url, json=body) for _ in range(4)))

        responses = asyncio.run(through_gateway())
        assert [x.status_code for x in responses] == [200] * 4, [x.text[:200] for x in responses]
        engines = {r.hget(c.keys.request(x.headers["x-request-id"]), "engine") for x in responses}
        assert engines == {b"0"}, f"constrained requests went to {engines}"
    finally:
        release(c, (0, 1), epoch)


async def _gateway_requests(url: str, n: int, max_tokens: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=300) as client:
        body = lambda i: {"model": "tiny-llama", "messages": [{"role": "user", "content": f"count to {i}"}],  # noqa: E731
                          "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}  # fmt: skip
        return await asyncio.gather(
            *(client.post(url + "/v1/chat/completions", json=body(i)) for i in range(n))
        )


def test_the_router_spreads_a_groups_requests_over_its_members_and_a_scatter_keeps_each_with_its_owner(
    chunked,
):
    """The router (its operator's group takes the gateway's work) dispatches a bound group's requests to both
    members' endpoints; released by scatter while they decode, each continues in DP on the member that owns it
    and completes: none lost, none moved."""
    c, n, tokens = chunked, 6, 96
    r = c.client()
    epoch = bind_sp(c, (0, 1))

    async def scenario() -> tuple[dict[int, int], list[httpx.Response]]:
        task = asyncio.create_task(_gateway_requests(c.config.gateway_url, n, tokens))
        deadline = time.monotonic() + 60
        while sum(r.scard(c.keys.inflight(e)) for e in (0, 1)) < n:  # every one assigned and running
            assert time.monotonic() < deadline and not task.done(), "requests not all assigned"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # they decode in the group
        held = {e: r.scard(c.keys.inflight(e)) for e in (0, 1)}
        await asyncio.to_thread(release, c, (0, 1), epoch, True)
        return held, await task

    held, responses = asyncio.run(scenario())
    assert held[0] and held[1], f"in flight at the release: {held}"
    assert [x.status_code for x in responses] == [200] * n
    assert all(x.json()["usage"]["completion_tokens"] == tokens for x in responses)
    rows = [{k.decode(): v.decode() for k, v in r.hgetall(c.keys.request(x.headers["x-request-id"])).items()}
            for x in responses]  # fmt: skip
    assert {h["epoch"] for h in rows} == {str(epoch)}, "every request ran in the group"
    owners = sorted(int(h["engine"]) for h in rows)
    assert owners == [0, 0, 0, 1, 1, 1], f"not spread in turn over the members: {owners}"
    assert {h["url"] for h in rows} == {worker_url(c, 0), worker_url(c, 1)}
