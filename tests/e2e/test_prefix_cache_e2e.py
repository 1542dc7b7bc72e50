"""The radix (prefix) cache on bound-capable CPU workers, through binds and releases (2 engines).

DP requests reuse cached prefixes as on stock SGLang; a bind (hard, soft, sequential, by adoption) and a release
(drained, retracting, scattering) keep the tree consistent: no KV leaks (SGLang's idle pool checks, all KV free
or evictable at idle) and no cached prefix is corrupted (a request that reuses it afterwards gets the log-probs of
a cold run). TP requests use their group's own cache instead (tests/e2e/test_group_prefix_cache_e2e.py).
"""

from __future__ import annotations

import itertools
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flying import control
from tests.e2e.test_switching import wait_mode, worker_url

pytestmark = pytest.mark.e2e
_unique = itertools.count(1)


def system_prompt(seed: int, n: int = 200) -> list[int]:
    return [(13 * i + 7 * seed) % 997 + 3 for i in range(n)]


def question(seed: int, k: int, n: int = 12) -> list[int]:
    return [(31 * i + 17 * k + 5 * seed) % 991 + 4 for i in range(n)]


def generate(url: str, ids: list[int], n: int = 8) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    resp = httpx.post(url + "/generate", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def flush(url: str, timeout_s: float = 30) -> None:
    """Empty a server's prefix cache (SGLang flushes only when idle), so that its next request runs cold: other
    tests' prompts can share a first token or two with these by chance."""
    deadline = time.monotonic() + timeout_s
    while (code := httpx.post(url + "/flush_cache", timeout=30).status_code) != 200:
        assert time.monotonic() < deadline, f"{url} did not flush its cache ({code})"
        time.sleep(0.2)


def logprobs(out: dict) -> list[float]:
    return [x[0] for x in out["meta_info"]["output_token_logprobs"]]


def idle_and_whole(cluster, timeout_s: float = 30) -> dict:
    """Wait until both engines are idle with all their KV free or evictable (nothing leaked, nothing locked)."""
    deadline = time.monotonic() + timeout_s
    while True:
        beats = control.status(cluster.client(), cluster.keys)
        ok = all(
            b.mode == "dp" and not b.running and not b.waiting and b.free_kv_tokens == b.max_total_tokens
            for b in (beats[0], beats[1])
        )
        if ok or time.monotonic() > deadline:
            assert ok, beats
            return beats
        time.sleep(0.1)


def test_dp_requests_reuse_cached_prefixes(cluster):
    url = worker_url(cluster, 0)
    prefix = system_prompt(next(_unique))
    flush(url)
    first = generate(url, prefix + question(0, 1))
    second = generate(url, prefix + question(0, 2))
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] >= len(prefix)


def test_dp_after_a_release_is_bit_identical_to_stock_with_its_cache_on(cluster, stock_server):
    """The same two requests (the second reusing the first's prefix) on stock tp=1 and on engine 0, with a bind
    and release of the group between them: identical log-probs, the second a cache hit on both."""
    url, seed = worker_url(cluster, 0), next(_unique)
    prefix = system_prompt(seed)
    flush(stock_server)
    flush(url)
    stock = [generate(stock_server, prefix + question(seed, k), 16) for k in (1, 2)]
    ours = [generate(url, prefix + question(seed, 1), 16)]
    r = cluster.client()
    epoch = control.bind(r, cluster.keys, (0, 1))
    wait_mode(cluster, (0, 1), "tp", epoch=epoch)
    # a TP request: the engine's cache is not the group's, and the group has cached nothing like it
    tp = generate(url, system_prompt(seed + 1000) + question(seed, 3), 8)
    assert tp["meta_info"]["cached_tokens"] == 0
    control.release(r, cluster.keys, (0, 1), epoch)
    wait_mode(cluster, (0, 1), "dp")
    ours.append(generate(url, prefix + question(seed, 2), 16))
    assert ours[1]["meta_info"]["cached_tokens"] == stock[1]["meta_info"]["cached_tokens"] >= len(prefix)
    for a, b in zip(ours, stock):
        assert a["output_ids"] == b["output_ids"]
        assert logprobs(a) == logprobs(b)


BINDS = ["hard", "soft", "sequential", "adopt"]
RELEASES = ["drain", "retract", "scatter"]


class Traffic:
    """Shared-prefix requests on both engines while the switches happen (each engine its own system prompt)."""

    def __init__(self, urls: list[str], prefixes: list[list[int]], seed: int, n: int) -> None:
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self.run, args=(urls[k % 2], prefixes[k % 2] + question(seed, k), n))
            for k in range(6)
        ]
        for t in self.threads:
            t.start()

    def run(self, url: str, ids: list[int], n: int) -> None:
        try:
            out = generate(url, ids, n)
            assert out["meta_info"]["completion_tokens"] == n
        except BaseException as exc:  # noqa: BLE001 - reported by join
            self.errors.append(exc)

    def join(self) -> None:
        for t in self.threads:
            t.join(300)
        assert not self.errors, self.errors


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    steps=st.lists(st.tuples(st.sampled_from(BINDS), st.sampled_from(RELEASES)), min_size=1, max_size=3),
    n=st.sampled_from([24, 64]),
)
def test_switch_sequences_with_shared_prefix_traffic_keep_the_cache_sound(cluster, stock_server, steps, n):
    """Random bind/release sequences while both engines serve shared-prefix requests: every request completes,
    nothing leaks, and afterwards a request reusing each engine's cached prefix gets a cold run's log-probs."""
    urls, seed = [worker_url(cluster, i) for i in (0, 1)], next(_unique)
    prefixes = [system_prompt(seed), system_prompt(seed + 500)]
    for i in (0, 1):  # cached and locked-free before the traffic
        generate(urls[i], prefixes[i] + question(seed, 100 + i), 1)
    r = cluster.client()
    traffic = Traffic(urls, prefixes, seed, n)
    for bind, release in steps:
        time.sleep(0.2)
        adopt = bind == "adopt"
        epoch = control.bind(r, cluster.keys, (0, 1), preempt="hard" if adopt else bind, adopt=adopt)
        wait_mode(cluster, (0, 1), "tp", epoch=epoch, timeout_s=120)
        time.sleep(0.2)
        control.release(
            r, cluster.keys, (0, 1), epoch, retract=release == "retract", scatter=release == "scatter"
        )
        wait_mode(cluster, (0, 1), "dp", timeout_s=120)
    traffic.join()
    idle_and_whole(cluster)
    for i in (0, 1):
        probe = prefixes[i] + question(seed, 200 + i)
        warm = generate(urls[i], probe, 8)
        assert warm["meta_info"]["cached_tokens"] >= len(prefixes[i]), "the prefix should still be cached"
        flush(stock_server)
        cold = generate(stock_server, probe, 8)
        assert cold["meta_info"]["cached_tokens"] == 0
        assert warm["output_ids"] == cold["output_ids"]
        diff = max(abs(a - b) for a, b in zip(logprobs(warm), logprobs(cold)))
        assert diff <= 1e-4, (
            f"engine {i}: log-probs over the cached prefix differ from a cold run by {diff:.2e}"
        )
    idle_and_whole(cluster)
