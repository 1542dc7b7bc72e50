"""KV transformation in real SGLang CPU workers (2 engines): a bind adopts busy engines' DP requests and a release
scatters TP requests back to DP, with no drain, no recompute, each request streaming from the engine it arrived on.
Checked against the same requests without the switch and against a stock ``--tp 2`` server."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest

from flying import control
from tests.e2e.test_switching import wait_mode, worker_url

pytestmark = pytest.mark.e2e
# about 300 prompt tokens each (ids, so the length is exact), different per engine
PROMPTS = [[(7 * i + 3) % 1000 + 5 for i in range(300)], [(11 * i + 5) % 1000 + 5 for i in range(290)]]


def generate(url: str, ids: list[int], n: int, **sampling) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **sampling},
        "return_logprob": True,
    }
    resp = httpx.post(url + "/generate", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def logprobs(out: dict) -> list[float]:
    return [x[0] for x in out["meta_info"]["output_token_logprobs"]]


def teacher_forced(url: str, prompt: list[int], output: list[int]) -> list[float]:
    """Log-probs a server gives each output token after the prompt and the output before it."""
    body = {
        "input_ids": prompt + output,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": len(prompt),
    }
    resp = httpx.post(url + "/generate", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return [x[0] for x in resp.json()["meta_info"]["input_token_logprobs"]][: len(output)]


class Running:
    """Requests sent in threads, one per (url, prompt)."""

    def __init__(self, jobs: list[tuple[str, list[int]]], n: int, **sampling) -> None:
        self.out: dict[int, dict] = {}
        self.threads = [
            threading.Thread(target=lambda i=i, u=u, p=p: self.out.update({i: generate(u, p, n, **sampling)}))
            for i, (u, p) in enumerate(jobs)
        ]
        for t in self.threads:
            t.start()

    def alive(self) -> list[bool]:
        return [t.is_alive() for t in self.threads]

    def join(self) -> list[dict]:
        for t in self.threads:
            t.join(300)
        return [self.out[i] for i in range(len(self.threads))]


def decode_time(url: str, n: int) -> float:
    t0 = time.monotonic()
    generate(url, PROMPTS[0], n)
    return time.monotonic() - t0


def switch_index(ours: dict, reference: dict) -> int:
    """The first generated token whose log-prob differs from the run without a switch (DP is bit-exact)."""
    diffs = [a != b for a, b in zip(logprobs(ours), logprobs(reference))]
    return diffs.index(True) if True in diffs else len(diffs)


def test_bind_by_adoption_continues_busy_engines_requests_in_tp(cluster, stock_tp2):
    urls, n = [worker_url(cluster, i) for i in (0, 1)], 160
    for i in (
        0,
        1,
    ):  # the prompts are cached from here on (the radix cache), for the references and the run alike
        generate(urls[i], PROMPTS[i], 1)
    refs = [generate(urls[i], PROMPTS[i], n) for i in (0, 1)]
    wait = decode_time(urls[0], n) * 0.4  # mid-decode
    run = Running([(urls[0], PROMPTS[0]), (urls[1], PROMPTS[1])], n)
    time.sleep(wait)
    r = cluster.client()
    epoch = control.bind(r, cluster.keys, (0, 1), adopt=True)
    beats = wait_mode(cluster, (0, 1), "tp", epoch=epoch)
    assert all(run.alive()), "a request finished before the bind: make it longer"
    assert beats[0].transform_tokens > 0 and beats[1].transform_tokens > 0  # head slices moved both ways
    assert beats[0].transform_peak_bytes > 0 and not beats[0].transform_retracted
    got = run.join()
    control.release(r, cluster.keys, (0, 1), epoch)
    wait_mode(cluster, (0, 1), "dp")
    for i in (0, 1):
        assert got[i]["output_ids"] == refs[i]["output_ids"]  # same text, on its own connection
        assert got[i]["meta_info"]["num_retractions"] == 0  # no recompute
        k = switch_index(got[i], refs[i])
        assert 0 < k < n, f"request {i} did not switch mid-way ({k})"
        stock = teacher_forced(stock_tp2, PROMPTS[i], got[i]["output_ids"])
        diffs = [abs(a - b) for a, b in zip(logprobs(got[i])[k:], stock[k:])]
        assert max(diffs) <= 1e-5, f"request {i}: TP log-probs after the switch differ by {max(diffs):.2e}"


def test_release_by_scatter_returns_tp_requests_to_dp_on_their_owners(cluster):
    """Adopt one request per engine, add a TP request of the group's own (on the leader), then scatter: each goes
    back to DP on the engine it arrived on, mid-decode, with its KV."""
    urls, n = [worker_url(cluster, i) for i in (0, 1)], 400
    jobs = [(urls[0], PROMPTS[0]), (urls[1], PROMPTS[1]), (urls[0], PROMPTS[1][:100])]
    refs = [generate(u, p, n) for u, p in jobs]
    half = decode_time(urls[0], n) * 0.15  # (the bind and the waits for each mode take time too: a busy
    # machine's can take a third of the decode)
    run = Running(jobs[:2], n)
    time.sleep(half)
    r = cluster.client()
    epoch = control.bind(r, cluster.keys, (0, 1), adopt=True)
    wait_mode(cluster, (0, 1), "tp", epoch=epoch)
    third = Running(jobs[2:], n)
    time.sleep(half)
    control.release(r, cluster.keys, (0, 1), epoch, scatter=True)
    beats = wait_mode(cluster, (0, 1), "dp")
    assert all(run.alive() + third.alive()), "a request finished before the release: make it longer"
    assert beats[1].transform_tokens > 0 and beats[0].transform_retracted == beats[1].transform_retracted == 0
    got = run.join() + third.join()
    for i in range(3):
        assert got[i]["output_ids"] == refs[i]["output_ids"]
        assert got[i]["meta_info"]["num_retractions"] == 0


def test_sampling_parameters_travel_with_adopted_requests(cluster):
    """Temperature 1 through SGLang's sampler (top_k 1 keeps it reproducible: SGLang 0.5.23 honours
    ``sampling_seed`` only with --enable-deterministic-inference, which the CPU attention backend lacks). The
    leader samples every TP request with the request's own parameters, whoever streams it."""
    urls, n = [worker_url(cluster, i) for i in (0, 1)], 200
    sampling = {"temperature": 1.0, "top_k": 1}
    refs = [generate(urls[i], PROMPTS[i], n, **sampling) for i in (0, 1)]
    wait = decode_time(urls[0], n) * 0.3
    run = Running([(urls[0], PROMPTS[0]), (urls[1], PROMPTS[1])], n, **sampling)
    time.sleep(wait)
    r = cluster.client()
    epoch = control.bind(r, cluster.keys, (0, 1), adopt=True)
    wait_mode(cluster, (0, 1), "tp", epoch=epoch)
    time.sleep(0.3)
    control.release(r, cluster.keys, (0, 1), epoch, scatter=True)
    wait_mode(cluster, (0, 1), "dp")
    got = run.join()
    for i in (0, 1):
        assert got[i]["output_ids"] == refs[i]["output_ids"]
        assert got[i]["meta_info"]["num_retractions"] == 0


def test_an_adoption_into_a_leader_whose_prefix_tree_fills_its_pool_continues(cluster):
    """The leader's pool is nearly all cached prompts (evictable) and it keeps back the room its follower lacks:
    the adopted request decodes to its end, the leader evicting what it needs (it was aborted for want of KV, and
    its client, on the follower, was never told)."""
    urls, n = [worker_url(cluster, i) for i in (0, 1)], 200
    for i in (0, 1):
        for k in range(4):  # 4 x 900 of the engines' 4,096 tokens
            generate(urls[i], [(13 * j + 7 * k + 3 * i) % 900 + 5 for j in range(900)], 1)
    prompt = [(17 * j + 1) % 900 + 5 for j in range(900)]
    t0 = time.monotonic()
    ref = generate(urls[1], prompt, n)
    wait = (time.monotonic() - t0) * 0.3
    run = Running([(urls[1], prompt)], n)
    time.sleep(wait)
    r = cluster.client()
    epoch = control.bind(r, cluster.keys, (0, 1), adopt=True)
    wait_mode(cluster, (0, 1), "tp", epoch=epoch)
    assert all(run.alive()), "the request finished before the bind: make it longer"
    for t in run.threads:
        t.join(120)
    assert not any(run.alive()), "the adopted request hung"
    (got,) = run.join()
    control.release(r, cluster.keys, (0, 1), epoch)
    wait_mode(cluster, (0, 1), "dp")
    assert got["output_ids"] == ref["output_ids"] and got["meta_info"]["finish_reason"]["type"] == "length"


def test_adopt_scatter_cycles_leave_no_kv_behind(cluster):
    """Repeated adopt/scatter under load: every request completes, SGLang's idle pool checks hold afterwards (a
    leaked slot stops the engine), all KV is free again and the parameters did not grow."""
    urls, n = [worker_url(cluster, i) for i in (0, 1)], 400
    r = cluster.client()
    before = control.status(r, cluster.keys)
    run = Running([(urls[0], PROMPTS[0]), (urls[1], PROMPTS[1]), (urls[0], PROMPTS[1][:50])], n)
    for _ in range(5):
        epoch = control.bind(r, cluster.keys, (0, 1), adopt=True)
        wait_mode(cluster, (0, 1), "tp", epoch=epoch)
        control.release(r, cluster.keys, (0, 1), epoch, scatter=True)
        wait_mode(cluster, (0, 1), "dp")
    got = run.join()
    assert [g["meta_info"]["completion_tokens"] for g in got] == [n] * 3
    assert all(g["meta_info"]["num_retractions"] == 0 for g in got)
    time.sleep(1.5)  # idle: SGLang's own checks run
    after = control.status(r, cluster.keys)
    for e in (0, 1):
        assert after[e].free_kv_tokens == after[e].max_total_tokens, after[e]
        assert after[e].param_bytes == before[e].param_bytes
    assert generate(urls[1], PROMPTS[1], 8)["meta_info"]["completion_tokens"] == 8  # still serving


def test_a_client_leaving_an_adopted_request_frees_the_group_at_once(cluster):
    """A client of engine 1 aborts its request (as the gateway does when the client disconnects) while the leader,
    engine 0, runs it as an adopted copy: engine 1 ends it at once and the leader drops its copy within seconds,
    not at the end of the epoch."""
    urls, n = [worker_url(cluster, i) for i in (0, 1)], 3000
    results: dict[int, dict] = {}

    def send(i: int) -> None:
        body = {
            "rid": f"leave-{i}",
            "input_ids": PROMPTS[i],
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        }
        results[i] = httpx.post(urls[i] + "/generate", json=body, timeout=120).json()

    threads = [threading.Thread(target=send, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    r = cluster.client()
    epoch = control.bind(r, cluster.keys, (0, 1), adopt=True)
    beats = wait_mode(cluster, (0, 1), "tp", epoch=epoch)
    assert beats[0].running == 2, beats[0]  # the leader runs its own request and engine 1's copy
    t0 = time.monotonic()
    assert httpx.post(urls[1] + "/abort_request", json={"rid": "leave-1"}, timeout=10).status_code == 200
    threads[1].join(10)
    assert not threads[1].is_alive(), "engine 1 did not end its aborted request"
    assert results[1]["meta_info"]["finish_reason"]["type"] == "abort"
    while control.status(r, cluster.keys)[0].running != 1:
        assert time.monotonic() - t0 < 5, "the leader still runs the aborted copy"
        time.sleep(0.05)
    assert control.status(r, cluster.keys)[0].mode == "tp"  # the epoch goes on
    httpx.post(urls[0] + "/abort_request", json={"rid": "leave-0"}, timeout=10)
    threads[0].join(10)
    control.release(r, cluster.keys, (0, 1), epoch)
    wait_mode(cluster, (0, 1), "dp", timeout_s=30)


def test_a_member_killed_while_its_requests_are_adopted_ends_them_clearly(cluster):
    """Engine 1 dies while the group runs both engines' adopted requests: the leader ends the epoch, aborts the
    requests it ran (status 503) and serves DP again; nothing hangs."""
    import signal

    urls, n = [worker_url(cluster, i) for i in (0, 1)], 3000
    out: dict = {}

    def own() -> None:
        body = {
            "input_ids": PROMPTS[0],
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        }
        resp = httpx.post(urls[0] + "/generate", json=body, timeout=60)
        out.update(status=resp.status_code, body=resp.json())

    t = threading.Thread(target=own)
    t.start()

    def on_the_killed_engine() -> None:  # its connection drops with the engine
        body = {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(urls[1] + "/generate", json=body, timeout=60)

    other = threading.Thread(target=on_the_killed_engine)
    other.start()
    time.sleep(1.0)
    r = cluster.client()
    epoch = control.bind(r, cluster.keys, (0, 1), adopt=True)
    wait_mode(cluster, (0, 1), "tp", epoch=epoch)
    time.sleep(0.5)
    cluster.kill_worker(1, signal.SIGKILL)
    beats = wait_mode(cluster, (0,), "dp", timeout_s=5)
    assert "aborted" in beats[0].switch_error
    t.join(10)
    assert not t.is_alive(), "the adopted request hung"
    # a clear end: SGLang answers the aborted request 503 (so a client with nothing yet can go elsewhere)
    assert out["status"] == 503 and "lost a member" in str(out["body"]), out
    assert generate(urls[0], PROMPTS[0], 8)["meta_info"]["completion_tokens"] == 8  # serving DP again
    while 1 in cluster.heartbeats():  # the killed engine's last heartbeat expires (PX 1000)
        time.sleep(0.1)
    cluster.start_worker(1)  # restore the shared cluster
    cluster.wait_live([1], timeout_s=240)
    deadline = time.monotonic() + 120
    while (
        control.status(r, cluster.keys)[0].comm_rebuilds < 1
    ):  # engine 0 rebuilt the group with the new engine 1
        assert time.monotonic() < deadline, "the pool was not rebuilt"
        time.sleep(0.2)
