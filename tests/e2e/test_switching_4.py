"""Four engines: width 4 against a stock ``--tp 4`` server, a width cycle 1 -> 2 -> 4 -> 2 -> 1 -> 4 -> 1 that
must read back exactly what it wrote at every width (the stale-layout bug), and a prompt larger than one engine's
KV served by a width-2 group."""

from __future__ import annotations

import time

import numpy as np
import pytest

from flying import control
from tests.e2e.conftest import KV_TOKENS, stock_tp
from tests.e2e.test_switching import PROMPTS, generate, prompt_logprobs, wait_mode, worker_url

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stock_tp4(tiny_model, tmp_path_factory):
    with stock_tp(tiny_model, tmp_path_factory, 4) as url:
        yield url


def bind(c, members):
    epoch = control.bind(c.client(), c.keys, members)
    wait_mode(c, members, "tp")
    return epoch


def test_pool_has_every_aligned_group(cluster4):
    beats = control.status(cluster4.client(), cluster4.keys)
    assert [beats[e].comm_groups for e in range(4)] == [2, 2, 2, 2]  # (0,1)|(2,3) and (0,1,2,3)


def test_width_4_matches_a_stock_tp4_server(cluster4, stock_tp4):
    epoch = bind(cluster4, (0, 1, 2, 3))
    try:
        for text in PROMPTS:
            ours, stock = generate(worker_url(cluster4, 0), text), generate(stock_tp4, text)
            diffs = [abs(a - b) for a, b in zip(prompt_logprobs(ours), prompt_logprobs(stock))]
            assert max(diffs) <= 1e-5, f"prompt log-probs differ by up to {max(diffs):.2e}"
            assert ours["output_ids"] == stock["output_ids"]
    finally:
        control.release(cluster4.client(), cluster4.keys, (0, 1, 2, 3), epoch)
        wait_mode(cluster4, range(4), "dp")


def test_width_cycle_reads_back_what_it_wrote_at_every_width(cluster4):
    """1 -> 2 -> 4 -> 2 -> 1 -> 4 -> 1, the width changes 2 -> 4 -> 2 direct (no DP in between). Each width's
    teacher-forced log-probs must be bit-identical every time it comes back: a rank that kept a stale KV layout
    or weight shard would write and read different slots and drift."""
    c, url, groups = cluster4, worker_url(cluster4, 0), {2: (0, 1), 4: (0, 1, 2, 3)}
    seen: dict[int, list[dict]] = {}
    epoch = None
    for width in (1, 2, 4, 2, 1, 4, 1):
        if width == 1:
            if epoch is not None:
                control.release(c.client(), c.keys, (0, 1, 2, 3), epoch)
                wait_mode(c, range(4), "dp")
                epoch = None
        else:
            epoch = control.bind(c.client(), c.keys, groups[width])  # while bound: a direct width change
            wait_mode(c, groups[width], "tp", epoch=epoch)
            if width == 2:
                wait_mode(c, (2, 3), "dp")  # the engines left out of the narrower group are back in DP
            beats = control.status(c.client(), c.keys)
            assert beats[0].width == width and beats[0].group == groups[width]
        outs = [generate(url, t) for t in PROMPTS]
        if width in seen:
            for a, b in zip(seen[width], outs):
                assert a["meta_info"]["input_token_logprobs"] == b["meta_info"]["input_token_logprobs"], width
                assert a["output_ids"] == b["output_ids"]
        seen.setdefault(width, outs)
    for w in (2, 4):  # and each width computes the same function as DP (fp32, up to summation order)
        for a, b in zip(seen[1], seen[w]):
            assert max(abs(x - y) for x, y in zip(prompt_logprobs(a), prompt_logprobs(b))) <= 1e-5
    beats = control.status(c.client(), c.keys)
    assert len({hb.param_bytes for hb in beats.values()}) == 1  # no weight memory grew on any engine


def test_prompt_larger_than_one_engines_kv_runs_at_width_2(cluster4, stock_tp4):
    ids = [int(x) for x in np.random.default_rng(0).integers(10, 1000, 900)]  # > 512 tokens of one engine
    body_tokens, new = len(ids), 30
    assert body_tokens + new >= 0.9 * 2 * KV_TOKENS
    import httpx

    sp = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    refused = httpx.post(
        worker_url(cluster4, 2) + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=60
    )
    assert refused.status_code == 400 and "exceeds" in refused.text  # one engine cannot hold it
    epoch = bind(cluster4, (0, 1))
    try:
        ours = httpx.post(
            worker_url(cluster4, 0) + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=120
        ).json()
    finally:
        control.release(cluster4.client(), cluster4.keys, (0, 1), epoch)
        wait_mode(cluster4, (0, 1), "dp")
    stock = httpx.post(
        stock_tp4 + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=120
    ).json()
    assert ours["meta_info"]["completion_tokens"] == new
    assert ours["output_ids"] == stock["output_ids"]


def test_width_changes_under_load_transform_kv_2_to_4_to_2(cluster4):
    """One greedy request decoding on each engine; adopt (0,1), widen to (0,1,2,3), narrow to (0,1), scatter: each
    width change moves the running requests' head slices (no drain, no recompute) and every request ends with the
    text it produces with no switch at all."""
    from tests.e2e.test_kv_transform_e2e import Running
    from tests.e2e.test_kv_transform_e2e import generate as generate_ids

    c, n = cluster4, 250
    urls = [worker_url(c, i) for i in range(4)]
    prompts = [[(13 * i + 7 * e) % 1000 + 5 for i in range(100)] for e in range(4)]
    refs = [generate_ids(urls[e], prompts[e], n) for e in range(4)]
    run = Running(list(zip(urls, prompts)), n)
    time.sleep(0.5)
    r = c.client()
    for members in ((0, 1), (0, 1, 2, 3), (0, 1)):
        epoch = control.bind(r, c.keys, members, adopt=True)
        beats = wait_mode(c, members, "tp", epoch=epoch, timeout_s=20)
        assert beats[0].width == len(members)
    wait_mode(c, (2, 3), "dp")
    control.release(r, c.keys, (0, 1), epoch, scatter=True)
    wait_mode(c, range(4), "dp")
    assert all(run.alive()), "a request finished before the last switch: make it longer"
    got = run.join()
    for e in range(4):
        assert got[e]["output_ids"] == refs[e]["output_ids"], e
        assert got[e]["meta_info"]["num_retractions"] == 0, e
