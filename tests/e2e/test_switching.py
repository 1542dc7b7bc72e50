"""DP <-> TP switching in real SGLang CPU workers (2 engines): correctness against a stock ``--tp 2`` server,
bit-exact release, KV kept across a hard preemption, a member killed mid-epoch."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from flying import control

pytestmark = pytest.mark.e2e
PROMPTS = ["the river and the sea", "Tell me a story about a dragon and a castle, and then another one."]


def worker_url(cluster, i: int) -> str:
    return f"http://127.0.0.1:{cluster.config.worker_ports[i]}"


def generate(url: str, text: str | list[int], max_new_tokens: int = 12) -> dict:
    """Greedy ``max_new_tokens`` after ``text`` (or token ids), with every token's log-prob."""
    body = {
        **({"input_ids": text} if isinstance(text, list) else {"text": text}),
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    resp = httpx.post(url + "/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def prompt_logprobs(out: dict) -> list[float]:
    return [x[0] for x in out["meta_info"]["input_token_logprobs"][1:]]  # the first token has none


def wait_mode(cluster, engines, mode: str, timeout_s: float = 10, epoch: int | None = None) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beats = control.status(cluster.client(), cluster.keys)
        if all(e in beats and beats[e].mode == mode and epoch in (None, beats[e].epoch) for e in engines):
            return beats
        time.sleep(0.05)
    raise AssertionError(
        f"engines {engines} not in {mode} after {timeout_s} s: {control.status(cluster.client(), cluster.keys)}"
    )


@pytest.fixture
def bound(cluster):
    """Engines 0 and 1 bound into one TP group for the test, released after it."""
    r = cluster.client()
    epoch = control.bind(r, cluster.keys, (0, 1))
    beats = wait_mode(cluster, (0, 1), "tp")
    yield epoch, beats
    control.release(r, cluster.keys, (0, 1), epoch)
    wait_mode(cluster, (0, 1), "dp")


def test_the_communicator_pool_is_built_at_start(cluster):
    beats = control.status(cluster.client(), cluster.keys)
    assert [beats[e].comm_groups for e in (0, 1)] == [1, 1]  # merge set (0, 1)
    assert all(hb.mode == "dp" and hb.epoch == 0 for hb in beats.values())


def test_merged_group_matches_a_stock_tp2_server(cluster, stock_tp2, bound):
    epoch, beats = bound
    assert beats[0].group == (0, 1) and beats[1].group == (0, 1) and beats[0].epoch == beats[1].epoch == epoch
    assert beats[0].width == 2 and beats[0].bind_ms > 0
    for text in PROMPTS:
        ours, stock = generate(worker_url(cluster, 0), text), generate(stock_tp2, text)
        diffs = [abs(a - b) for a, b in zip(prompt_logprobs(ours), prompt_logprobs(stock))]
        assert len(diffs) == len(prompt_logprobs(stock)) > 3
        assert max(diffs) <= 1e-5, f"teacher-forced prompt log-probs differ by up to {max(diffs):.2e}"
        assert ours["output_ids"] == stock["output_ids"]  # greedy output identical


def test_release_restores_dp_bit_exactly(cluster):
    url = worker_url(cluster, 0)
    before = [generate(url, t) for t in PROMPTS]
    r = cluster.client()
    for _ in range(3):
        epoch = control.bind(r, cluster.keys, (0, 1))
        wait_mode(cluster, (0, 1), "tp")
        generate(url, PROMPTS[0])  # the group serves a TP request
        control.release(r, cluster.keys, (0, 1), epoch)
        wait_mode(cluster, (0, 1), "dp")
    after = [generate(url, t) for t in PROMPTS]
    for a, b in zip(before, after):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["input_token_logprobs"] == b["meta_info"]["input_token_logprobs"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]


def test_bind_applies_on_idle_engines_without_a_request(cluster, bound):
    _, beats = bound  # the fixture waited for both heartbeats to say tp; nothing was sent to either engine
    assert all(beats[e].mode == "tp" for e in (0, 1))
    # each reports its own KV (its pool's twice as many half-head slots, over two), not its group's
    assert all(0 < beats[e].free_kv_tokens <= beats[e].max_total_tokens for e in (0, 1)), beats


def test_hard_preempted_dp_request_keeps_its_kv(cluster):
    url, text, n = worker_url(cluster, 0), PROMPTS[1], 400
    reference = generate(url, text, n)
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(generate(url, text, n)))
    t.start()
    time.sleep(0.6)  # mid-generation
    r = cluster.client()
    epoch = control.bind(r, cluster.keys, (0, 1))
    wait_mode(cluster, (0, 1), "tp")
    assert t.is_alive(), "the DP request finished before the bind: make it longer"
    generate(url, PROMPTS[0])  # TP work while the DP request is paused
    control.release(r, cluster.keys, (0, 1), epoch)
    wait_mode(cluster, (0, 1), "dp")
    t.join(120)
    assert got["output_ids"] == reference["output_ids"]
    # exactly the same log-probs: the paused request resumed on its own KV (a re-prefill would not be bit-exact)
    assert got["meta_info"]["output_token_logprobs"] == reference["meta_info"]["output_token_logprobs"]
    assert got["meta_info"]["num_retractions"] == 0  # SGLang's own recompute counter for the request


def test_an_abort_of_paused_dp_work_ends_it_when_the_release_puts_it_back(cluster):
    """SGLang's abort looks in its queues and batches, not in DP work a hard bind set aside: the worker applies the
    abort again once the release puts that work back, so it ends at once instead of decoding for a client gone."""
    url = worker_url(cluster, 0)
    body = {"text": PROMPTS[1], "rid": "paused-abort-1",
            "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    got: dict = {}
    t = threading.Thread(
        target=lambda: got.update(httpx.post(url + "/generate", json=body, timeout=300).json())
    )
    t.start()
    time.sleep(0.6)  # decoding
    r = cluster.client()
    epoch = control.bind(r, cluster.keys, (0, 1))
    beats = wait_mode(cluster, (0, 1), "tp")
    assert beats[0].paused == 1, beats[0]
    assert httpx.post(url + "/abort_request", json={"rid": "paused-abort-1"}, timeout=10).status_code == 200
    time.sleep(0.5)
    control.release(r, cluster.keys, (0, 1), epoch)
    wait_mode(cluster, (0, 1), "dp")
    t.join(20)
    assert not t.is_alive(), "the aborted request still decodes after the release"
    meta = got["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 3000, meta


def test_a_retracting_release_resumes_paused_dp_work_at_once(cluster):
    """The policy's bounded deferral: a hard bind paused a DP request; a release with retraction does not wait for
    the group's long TP request (it continues in DP on the leader), the paused request resumes on its own KV."""
    url, text, n = worker_url(cluster, 0), PROMPTS[1], 400
    reference = generate(url, text, n)
    got: dict = {}
    dp = threading.Thread(target=lambda: got.update(dp=generate(url, text, n)))
    dp.start()
    time.sleep(0.6)
    r = cluster.client()
    epoch = control.bind(r, cluster.keys, (0, 1))
    wait_mode(cluster, (0, 1), "tp")
    tp = threading.Thread(target=lambda: got.update(tp=generate(url, PROMPTS[0], 3000)))
    tp.start()
    time.sleep(1.0)  # the TP request is decoding
    control.release(r, cluster.keys, (0, 1), epoch, retract=True)
    wait_mode(cluster, (0, 1), "dp", timeout_s=5)
    assert tp.is_alive(), "the release waited for the TP request"
    dp.join(120)
    assert got["dp"]["output_ids"] == reference["output_ids"]
    assert got["dp"]["meta_info"]["num_retractions"] == 0  # resumed on its own KV, not recomputed
    # (log-probs agree to float noise: after the release it shares batches with the recomputed TP request)
    ours, ref = (x["meta_info"]["output_token_logprobs"] for x in (got["dp"], reference))
    assert max(abs(a[0] - b[0]) for a, b in zip(ours, ref)) <= 1e-4
    tp.join(300)
    assert got["tp"]["meta_info"]["completion_tokens"] == 3000
    assert got["tp"]["meta_info"]["num_retractions"] >= 1  # recomputed in DP after the release


def test_sequential_bind_waits_for_running_dp_work(cluster):
    """Engine 1 is drained at once, engine 0 only after a DP request that outlasts the group timeout (10 s): the
    drained member waits in its own loop, not in the bind handshake, and the bind succeeds."""
    url = worker_url(cluster, 0)
    t0 = time.monotonic()
    generate(url, PROMPTS[1], 200)
    n = min(3500, int(200 / (time.monotonic() - t0) * 14))  # about 14 s of decoding
    reference = generate(url, PROMPTS[1], n)
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(generate(url, PROMPTS[1], n)))
    t.start()
    time.sleep(0.4)
    r = cluster.client()
    epoch = control.bind(r, cluster.keys, (0, 1), preempt="sequential")
    time.sleep(0.3)
    assert t.is_alive() and control.status(r, cluster.keys)[0].mode == "dp"  # no preemption: it keeps running
    late = threading.Thread(
        target=lambda: got.update(late=generate(url, PROMPTS[0]))
    )  # arrives while draining
    late.start()
    t.join(120)
    beats = wait_mode(cluster, (0, 1), "tp", epoch=epoch)  # bound once the running request finished
    assert not beats[1].switch_error, beats[1].switch_error
    assert got["output_ids"] == reference["output_ids"]
    control.release(r, cluster.keys, (0, 1), epoch)
    wait_mode(cluster, (0, 1), "dp")
    late.join(60)
    assert got["late"]["meta_info"]["completion_tokens"] == 12  # held, then served in DP after the release


def test_soft_bind_starts_tp_requests_in_dp_and_continues_them_in_tp(cluster, stock_tp2):
    url, n = worker_url(cluster, 0), 300
    reference = generate(url, PROMPTS[1], n)  # the DP request: must run uninterrupted
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(dp=generate(url, PROMPTS[1], n)))
    t.start()
    time.sleep(0.4)
    r = cluster.client()
    epoch = control.bind(r, cluster.keys, (0, 1), preempt="soft")
    time.sleep(0.1)
    # the group's request: longer than what is left of the DP one, so it is still running when the group binds
    tp = threading.Thread(target=lambda: got.update(tp=generate(url, PROMPTS[0], 2 * n)))
    tp.start()
    time.sleep(0.3)
    assert t.is_alive() and control.status(r, cluster.keys)[0].mode == "dp"  # stragglers: not bound yet
    t.join(60)
    wait_mode(cluster, (0, 1), "tp", epoch=epoch)  # bound once the DP work drained
    tp.join(120)
    assert not tp.is_alive(), "the group's request never finished"
    assert got["dp"]["output_ids"] == reference["output_ids"]
    assert got["tp"]["meta_info"]["num_retractions"] >= 1  # started in DP, re-prefilled at width 2
    assert got["tp"]["output_ids"] == generate(stock_tp2, PROMPTS[0], 2 * n)["output_ids"]
    control.release(r, cluster.keys, (0, 1), epoch)
    wait_mode(cluster, (0, 1), "dp")


def test_killing_a_member_mid_epoch_returns_the_survivor_to_dp(cluster):
    r = cluster.client()
    control.bind(r, cluster.keys, (0, 1))
    wait_mode(cluster, (0, 1), "tp")
    requeued = int(r.hget("flying:stats", "requeued") or 0)
    body = {
        "text": PROMPTS[0],
        "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True},
    }
    chat = {  # through the gateway: both engines are bound, so the router sends it to the group
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": PROMPTS[1]}],
        "max_tokens": 2000,
        "ignore_eos": True,
    }
    got: dict = {}
    streamed: dict[int, dict] = {}

    def stream_request(i: int) -> None:  # resumable streams, tokens already sent when the member dies
        seen: dict = {"error": None, "done": False, "tokens": None}
        try:
            body = chat | {"max_tokens": 1500, "stream": True, "stream_options": {"include_usage": True}}
            url = cluster.config.gateway_url + "/v1/chat/completions"
            with httpx.stream("POST", url, json=body, timeout=120) as resp:
                seen["status"] = resp.status_code
                for line in resp.iter_lines():
                    if line.strip() == "data: [DONE]":
                        seen["done"] = True
                    elif line.startswith("data:"):
                        event = json.loads(line[5:])
                        seen["error"] = seen["error"] or event.get("error")
                        if event.get("usage"):
                            seen["tokens"] = event["usage"]["completion_tokens"]
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            seen["error"] = repr(exc)
        streamed[i] = seen

    def tp_request() -> None:  # in flight on the group when the member dies
        resp = httpx.post(worker_url(cluster, 0) + "/generate", json=body, timeout=60)
        got.update(status=resp.status_code, body=resp.json())

    def gateway_request() -> None:
        resp = httpx.post(cluster.config.gateway_url + "/v1/chat/completions", json=chat, timeout=120)
        got.update(gw_status=resp.status_code, gw_body=resp.json())

    threads = [threading.Thread(target=tp_request), threading.Thread(target=gateway_request)]
    threads += [threading.Thread(target=stream_request, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while r.scard("flying:inflight:0") + r.scard("flying:inflight:1") < 3:
        assert time.monotonic() < deadline, "the router did not send the gateway's requests to the group"
        time.sleep(0.05)
    time.sleep(0.5)
    t0 = time.monotonic()
    cluster.kill_worker(1, signal.SIGKILL)
    beats = wait_mode(cluster, (0,), "dp", timeout_s=5)
    assert "aborted" in beats[0].switch_error
    threads[0].join(10)
    assert not threads[0].is_alive(), "the TP request hung"
    # a clear end, not a silent hang: the abort is a 503, so a client that has nothing yet can go elsewhere
    assert got["status"] == 503, got
    assert "lost a member" in json.dumps(got["body"]), got
    out = generate(worker_url(cluster, 0), PROMPTS[0])  # serving DP again
    assert out["meta_info"]["completion_tokens"] == 12
    assert time.monotonic() - t0 < 15  # detected, aborted and serving DP again
    # the gateway's client had received nothing: its request was re-dispatched and served whole in DP
    threads[1].join(120)
    assert got["gw_status"] == 200, got
    assert got["gw_body"]["usage"]["completion_tokens"] == 2000
    # the streams had tokens: each continued on the survivor, whole, under a rid of its own (SGLang aborts a
    # closed stream's rid later, and an abort names a prefix: the same rid again was aborted there every 2 s)
    for t in threads[2:]:
        t.join(120)
    assert streamed == {i: {"status": 200, "error": None, "done": True, "tokens": 1500} for i in range(2)}, (
        streamed
    )
    assert int(r.hget("flying:stats", "requeued") or 0) > requeued
    cluster.start_worker(1)  # restore the shared cluster
    cluster.wait_live([1], timeout_s=240)


def test_a_restarted_member_rejoins_the_pool(cluster, stock_tp2):
    """After the kill above: engine 1 came back with a new launch id; engine 0 rebuilt their group with it (off the
    serving path), so the two bind again and the group is still exact."""
    deadline = time.monotonic() + 60
    while True:
        beats = control.status(cluster.client(), cluster.keys)
        if beats[0].comm_rebuilds >= 1 and beats[1].comm_groups == 1:
            break
        assert time.monotonic() < deadline, f"the pool was not rebuilt: {beats}"
        time.sleep(0.2)
    r = cluster.client()
    epoch = control.bind(r, cluster.keys, (0, 1))
    wait_mode(cluster, (0, 1), "tp", epoch=epoch)
    ours, stock = generate(worker_url(cluster, 0), PROMPTS[1]), generate(stock_tp2, PROMPTS[1])
    diffs = [abs(a - b) for a, b in zip(prompt_logprobs(ours), prompt_logprobs(stock))]
    assert max(diffs) <= 1e-5 and ours["output_ids"] == stock["output_ids"]
    control.release(r, cluster.keys, (0, 1), epoch)
    wait_mode(cluster, (0, 1), "dp")
