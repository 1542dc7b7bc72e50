"""Cache-aware DP dispatch on the live CPU stack (issue 16): the gateway records each prompt's prefix chain, the
router follows it to the engine that cached it. The shared 2-engine cluster (router manual: DP only, dispatch
cache-aware by default)."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.e2e
SYSTEM = "You are a patient tutor of geometry who explains every step with a small drawing in words. " * 10


def chat(url: str, question: str) -> tuple[int, dict]:
    body = {"model": "tiny-llama", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}  # fmt: skip
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return int(resp.headers["x-flying-engine"]), resp.json()["usage"]


def test_requests_sharing_a_system_prompt_follow_it_to_the_engine_that_cached_it(cluster):
    url = cluster.config.gateway_url
    first, usage = chat(url, "What is a triangle?")
    assert usage["prompt_tokens"] > 3 * 64, "several blocks: a chain the router can match"
    for q in ("What is a square?", "What is a circle?", "What is an angle?", "What is a line?"):
        engine, usage = chat(url, q)
        assert engine == first, "both engines idle (balanced): the prefix decides"
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 3 * 64, (
            "the system prompt came from the cache"
        )
    metrics = httpx.get(f"http://127.0.0.1:{cluster.config.router_metrics_port}/metrics", timeout=5).text
    followed = [line for line in metrics.splitlines() if line.startswith('flying_router_dp_dispatch_total{rule="prefix"}')]  # fmt: skip
    assert followed and float(followed[0].split()[-1]) >= 4
