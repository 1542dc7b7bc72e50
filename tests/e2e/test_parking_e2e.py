"""Parking in real SGLang CPU workers (four engines of 512 KV tokens; engines 0 and 1 bound): a request no engine
holds alone is parked mid-decode with its KV where it is, the engines serve DP meanwhile, and a resume on the same
engines continues it to the same tokens and log-probs as a run that was never parked; releasing a parked epoch
ends its request and gives its KV back."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest

from devstack.cluster import Cluster, ClusterConfig
from flying import control
from flying.messages import Heartbeat
from tests.e2e.conftest import KV_TOKENS
from tests.e2e.test_switching import generate, wait_mode, worker_url

pytestmark = pytest.mark.e2e
IDS = [int(x) for x in np.random.default_rng(7).integers(10, 1000, 500)]
NEW = 300  # 800 tokens in all: more than one engine's KV_TOKENS, within the pair's


def long_request(url: str) -> httpx.Response:
    body = {
        "input_ids": IDS,
        "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    return httpx.post(url + "/generate", json=body, timeout=300)


def logprobs(out: dict) -> list[float]:
    return [x[0] for x in out["meta_info"]["output_token_logprobs"]]


def bind(c, members=(0, 1)) -> int:
    epoch = control.bind(c.client(), c.keys, members)
    wait_mode(c, members, "tp", epoch=epoch)
    return epoch


def release(c, epoch: int, members=(0, 1)) -> None:
    control.release(c.client(), c.keys, members, epoch)
    wait_mode(c, members, "dp")


def wait_parked(c, epoch: int, engines=(0, 1), timeout_s: float = 10) -> dict[int, Heartbeat]:
    """Until each engine reports ``epoch`` parked and the router's record of it is ``parked``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beats = control.status(c.client(), c.keys)
        record = next((g for g in control.groups(c.client(), c.keys) if g.epoch == epoch), None)
        if all(beats[e].parked == (epoch,) and beats[e].mode == "dp" for e in engines) and (
            record is not None and record.state == "parked"
        ):
            return beats
        time.sleep(0.05)
    raise AssertionError(f"epoch {epoch} not parked: {control.status(c.client(), c.keys)}")


class Background:
    def __init__(self, url: str) -> None:
        self.resp: httpx.Response | None = None
        self.thread = threading.Thread(target=self._run, args=(url,))
        self.thread.start()

    def _run(self, url: str) -> None:
        self.resp = long_request(url)

    def join(self) -> httpx.Response:
        self.thread.join(300)
        assert self.resp is not None
        return self.resp


@pytest.fixture(scope="module")
def reference(cluster4):
    """The request on a bound pair, never parked: its tokens and log-probs, and how long it took."""
    epoch = bind(cluster4)
    try:
        t0 = time.monotonic()
        resp = long_request(worker_url(cluster4, 1))
        took = time.monotonic() - t0
    finally:
        release(cluster4, epoch)
    assert resp.status_code == 200, resp.text
    return resp.json(), took


def test_a_parked_request_continues_on_the_resume_as_if_never_parked(cluster4, reference):
    c, (ref, took) = cluster4, reference
    epoch = bind(c)
    run = Background(worker_url(c, 1))  # owned by the follower: the leader runs it, engine 1 streams it
    time.sleep(took * 0.4)  # mid-decode
    control.release(c.client(), c.keys, (0, 1), epoch, park=True)
    beats = wait_parked(c, epoch)
    assert run.thread.is_alive(), f"the request ended before the park: {run.resp and run.resp.text[:300]}"
    assert all(beats[e].free_kv_tokens < KV_TOKENS for e in (0, 1))  # each holds its head slices
    for e in (0, 1):  # DP meanwhile, on the engines holding the parked KV
        assert (
            generate(worker_url(c, e), "parked engines still serve", 8)["meta_info"]["completion_tokens"] == 8
        )
    time.sleep(0.5)
    assert run.thread.is_alive()  # no token while parked: it waits, its stream open
    new, members = control.resume(c.client(), c.keys, epoch)
    assert members == (0, 1)
    wait_mode(c, (0, 1), "tp", epoch=new)
    resp = run.join()
    release(c, new)
    assert resp.status_code == 200, resp.text
    got = resp.json()
    assert got["output_ids"] == ref["output_ids"]
    assert logprobs(got) == logprobs(ref)  # the same KV, the same group: bit for bit
    assert got["meta_info"]["num_retractions"] == 0  # nothing recomputed
    beats = control.status(c.client(), c.keys)
    assert beats[0].parked == beats[1].parked == ()


def test_releasing_a_parked_epoch_ends_its_request_and_gives_its_kv_back(cluster4, reference):
    c, (_, took) = cluster4, reference
    epoch = bind(c)
    run = Background(worker_url(c, 0))  # the leader's own
    time.sleep(took * 0.4)
    control.release(c.client(), c.keys, (0, 1), epoch, park=True)
    wait_parked(c, epoch)
    control.release(c.client(), c.keys, (0, 1), epoch)  # (flyctl release EPOCH 0 1: the parked requests end)
    resp = run.join()
    assert resp.status_code != 200 or resp.json()["meta_info"]["finish_reason"]["type"] == "abort", resp.text
    deadline = time.monotonic() + 10
    while control.status(c.client(), c.keys)[0].parked and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [control.status(c.client(), c.keys)[e].parked for e in (0, 1)] == [(), ()]
    assert not any(g.epoch == epoch for g in control.groups(c.client(), c.keys))
    # its KV is back: a bound pair holds the long request again, and DP is fine after
    epoch = bind(c)
    try:
        assert long_request(worker_url(c, 0)).status_code == 200
    finally:
        release(c, epoch)
    assert generate(worker_url(c, 0), "after the discard", 4)["meta_info"]["completion_tokens"] == 4


@pytest.fixture(scope="module")
def chunked_pair(tiny_model, tmp_path_factory):
    """Two engines of KV_TOKENS, prefilling in chunks of 16 tokens: a long prompt's prefill spans many steps."""
    config = ClusterConfig(
        model_path=tiny_model,
        num_engines=2,
        log_dir=tmp_path_factory.mktemp("chunked-pair"),
        max_total_tokens=KV_TOKENS,
        router_args=("--manual",),
        worker_args=("--", "--chunked-prefill-size", "16"),
    )
    with Cluster(config, progress=print) as c:
        yield c


def test_a_long_request_in_its_prefill_is_not_parked_but_ends_before_its_first_token(chunked_pair):
    """Its prefill would hold the park up for all its chunks: it ends with the group-lost abort instead (a 503
    before any token: the gateway queues such a request again), its KV freed, and the rest of the group parks."""
    c = chunked_pair
    ids = [int(x) for x in np.random.default_rng(3).integers(10, 1000, 900)]
    epoch = bind(c)
    out: dict[str, httpx.Response] = {}
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 50, "temperature": 0, "ignore_eos": True}}
    t = threading.Thread(target=lambda: out.update(r=httpx.post(worker_url(c, 0) + "/generate", json=body,
                                                                 timeout=120)))  # fmt: skip
    t.start()
    deadline = time.monotonic() + 30
    while control.status(c.client(), c.keys)[0].steps_tp < 3 and time.monotonic() < deadline:
        time.sleep(0.005)  # its first chunks ran
    control.release(c.client(), c.keys, (0, 1), epoch, park=True)
    t.join(120)
    assert out["r"].status_code == 503 and "parked for a burst before its first token" in out["r"].text
    beats = wait_mode(c, (0, 1), "dp")
    assert beats[0].parked == beats[1].parked == ()  # nothing was left to park
    epoch = bind(c)  # its KV is free: the pair holds it whole again
    try:
        assert httpx.post(worker_url(c, 0) + "/generate", json=body, timeout=120).status_code == 200
    finally:
        release(c, epoch)
