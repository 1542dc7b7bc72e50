"""A bound group's own prefix cache, on real SGLang CPU workers: a group request sharing a prefix with an earlier
one of the same epoch starts after it (``cached_tokens`` in its usage), in TP steps and in SP steps, at widths 2
and 4, with the log-probs and greedy text of stock tp=1 with its radix cache on; a request sent to a follower
reads it too; a prompt prefilled again decodes on the tree's copy; the cache evicts when the group's KV runs short;
a release frees it (no KV leaked) and DP stays bit-identical to stock."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from flying import control
from tests.e2e.test_prefix_cache_e2e import flush, idle_and_whole, logprobs
from tests.e2e.test_switching import wait_mode, worker_url

pytestmark = pytest.mark.e2e
SHARED = [(17 * i + 11) % 995 + 3 for i in range(200)]


def suffix(k: int, n: int = 24) -> list[int]:
    return [(29 * i + 13 * k) % 989 + 5 for i in range(n)]


def generate(url: str, ids: list[int], start: int, n: int = 8) -> dict:
    """Greedy ``n`` tokens with the prompt's log-probs from ``start`` on (SGLang matches no prefix beyond it)."""
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": start,
    }
    resp = httpx.post(url + "/generate", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def assert_matches(ours: dict, ref: dict, what: str) -> None:
    a, b = ours["meta_info"]["input_token_logprobs"], ref["meta_info"]["input_token_logprobs"]
    assert [x[0] is None for x in a] == [x[0] is None for x in b] and len(a) > 16, what
    diffs = [abs(x[0] - y[0]) for x, y in zip(a, b) if x[0] is not None]
    diffs += [abs(x - y) for x, y in zip(logprobs(ours), logprobs(ref))]
    assert max(diffs) <= 1e-5, f"{what}: log-probs differ by up to {max(diffs):.2e}"
    assert ours["output_ids"] == ref["output_ids"], f"{what}: greedy text differs"


def two_turns(url: str, prefix: list[int], seed: int) -> list[dict]:
    return [generate(url, prefix + suffix(seed + k), len(prefix)) for k in (1, 2)]


def steps(cluster, mode: str) -> int:
    return int(getattr(control.status(cluster.client(), cluster.keys)[0], f"steps_{mode}"))


def group_turns(cluster, stock_server: str, members: tuple[int, ...], mode: str, seed: int) -> list[int]:
    """In a group of ``members`` (SP steps for every prefill, or TP steps only): two requests sharing 200 tokens
    on the leader, then a third sent to the last member; each matches stock tp=1 (cache on) running the same, the
    second and third report the shared tokens cached. Returns the shared prefix."""
    prefix = [(t + seed) % 995 + 3 for t in SHARED]
    flush(stock_server)
    ref = two_turns(stock_server, prefix, seed)
    ref.append(generate(stock_server, prefix + suffix(seed + 3), len(prefix)))
    assert ref[1]["meta_info"]["cached_tokens"] >= len(prefix)
    r = cluster.client()
    # an SP bind runs every prefill here in SP steps (24 new tokens at least); the default threshold none of them
    epoch = control.bind(r, cluster.keys, members, sp_threshold=8 if mode == "sp" else None)
    wait_mode(cluster, members, "tp", epoch=epoch, timeout_s=60)
    before = steps(cluster, mode)
    try:
        ours = two_turns(worker_url(cluster, 0), prefix, seed)
        # sent to a follower: the leader runs it as the follower's copy, from the group's cached prefix
        ours.append(generate(worker_url(cluster, members[-1]), prefix + suffix(seed + 3), len(prefix)))
    finally:
        control.release(r, cluster.keys, members, epoch)
        wait_mode(cluster, members, "dp", timeout_s=60)
    assert steps(cluster, mode) > before
    assert ours[0]["meta_info"]["cached_tokens"] == 0
    assert ours[1]["meta_info"]["cached_tokens"] == ref[1]["meta_info"]["cached_tokens"]
    assert ours[2]["meta_info"]["cached_tokens"] >= len(prefix), "a request sent to a follower"
    for k in (0, 1, 2):
        assert_matches(ours[k], ref[k], f"{mode} group of {len(members)}, request {k + 1}")
    return prefix


@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_a_group_request_starts_after_a_prefix_the_group_cached(cluster, stock_server, mode):
    """Width 2; after the release nothing is leaked (the group's cache freed) and DP still matches stock."""
    seed = 100 if mode == "tp" else 200
    prefix = group_turns(cluster, stock_server, (0, 1), mode, seed)
    idle_and_whole(cluster)
    url = worker_url(cluster, 0)
    flush(url)
    flush(stock_server)
    dp, stock = two_turns(url, prefix, seed + 50), two_turns(stock_server, prefix, seed + 50)
    assert dp[1]["meta_info"]["cached_tokens"] == stock[1]["meta_info"]["cached_tokens"] >= len(prefix)
    for a, b in zip(dp, stock):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["input_token_logprobs"] == b["meta_info"]["input_token_logprobs"]
        assert logprobs(a) == logprobs(b)


@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_width_4_group_requests_reuse_the_groups_prefix(cluster4, stock_server, mode):
    group_turns(cluster4, stock_server, (0, 1, 2, 3), mode, 300 if mode == "tp" else 400)
    deadline = time.monotonic() + 30
    while (
        True
    ):  # every engine idle with all its KV free or evictable: the group's cache went with the release
        beats = control.status(cluster4.client(), cluster4.keys)
        if all(
            beats[i].free_kv_tokens == beats[i].max_total_tokens and not beats[i].running for i in range(4)
        ):
            break
        assert time.monotonic() < deadline, beats
        time.sleep(0.1)


def test_the_groups_cache_evicts_when_its_kv_runs_short_and_stays_exact(cluster4, stock_server):
    """Engines of 512 KV tokens bound in twos: distinct 224-token prompts fill the group's cache past its KV, so
    the leader's tree evicts (its followers freeing their copies with it); a prefix still cached is reused
    exactly, and the release leaves nothing behind."""
    members, seed = (2, 3), 500
    r = cluster4.client()
    epoch = control.bind(r, cluster4.keys, members)
    wait_mode(cluster4, members, "tp", epoch=epoch, timeout_s=60)
    url = worker_url(cluster4, 2)
    try:
        for k in range(6):  # 6 x 232 tokens > the group's 1,024
            generate(url, [(t + seed + 7 * k) % 995 + 3 for t in SHARED] + suffix(seed + k), 200)
        prefix = [(t + seed + 35) % 995 + 3 for t in SHARED]  # the last one's: still cached
        ours = generate(url, prefix + suffix(seed + 9), len(prefix))
    finally:
        control.release(r, cluster4.keys, members, epoch)
        wait_mode(cluster4, members, "dp", timeout_s=60)
    assert ours["meta_info"]["cached_tokens"] >= len(prefix)
    flush(stock_server)
    generate(stock_server, prefix + suffix(seed + 5), len(prefix))
    assert_matches(ours, generate(stock_server, prefix + suffix(seed + 9), len(prefix)), "after evictions")
    deadline = time.monotonic() + 30
    while True:
        beats = control.status(cluster4.client(), cluster4.keys)
        if all(
            beats[i].free_kv_tokens == beats[i].max_total_tokens and not beats[i].running for i in members
        ):
            break
        assert time.monotonic() < deadline, beats
        time.sleep(0.1)


@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_a_prompt_prefilled_again_decodes_on_the_groups_copy_of_it(cluster, stock_server, mode):
    """A prompt the group already cached, prefilled again in full (all its prompt log-probs asked: SGLang matches
    no prefix), then concurrently twice: each checkpoint finds it in the tree, frees the request's duplicates and
    points its row at the tree's slots on every member; the decodes that follow read them and keep stock's text."""
    prompt = [(t + 600) % 995 + 3 for t in SHARED] + suffix(600)
    flush(stock_server)
    ref = generate(stock_server, prompt, 0, 24)
    r = cluster.client()
    epoch = control.bind(r, cluster.keys, (0, 1), sp_threshold=8 if mode == "sp" else None)
    wait_mode(cluster, (0, 1), "tp", epoch=epoch, timeout_s=60)
    try:
        url = worker_url(cluster, 0)
        first = generate(url, prompt, 0, 24)
        with ThreadPoolExecutor(2) as pool:
            again = list(pool.map(lambda _: generate(url, prompt, 0, 24), range(2)))
    finally:
        control.release(r, cluster.keys, (0, 1), epoch)
        wait_mode(cluster, (0, 1), "dp", timeout_s=60)
    for k, out in enumerate([first, *again]):
        assert out["meta_info"]["cached_tokens"] == 0
        assert_matches(out, ref, f"{mode}: prefill {k + 1} of a cached prompt")
    idle_and_whole(cluster)
