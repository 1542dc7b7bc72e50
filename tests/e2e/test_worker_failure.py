"""Killing a worker mid-burst: requests it had not answered are re-dispatched, streams it was running continue on
the other engine from the tokens already sent (greedy text identical to an uninterrupted run, up to a near-tie of
the model's top two tokens, where batched fp32 arithmetic may pick either), the gateway stays up."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

pytestmark = pytest.mark.e2e
BODY = {
    "model": "tiny-llama",
    "messages": [{"role": "user", "content": "a long story please"}],
    "max_tokens": 400,
    "ignore_eos": True,
    "temperature": 0,
}


async def non_stream(client: httpx.AsyncClient, url: str, **extra) -> tuple[int, dict]:
    resp = await client.post(url + "/v1/chat/completions", json={**BODY, **extra})
    return resp.status_code, resp.json()


async def stream(client: httpx.AsyncClient, url: str, **extra) -> tuple[int, list[dict]]:
    events = []
    async with client.stream(
        "POST",
        url + "/v1/chat/completions",
        json={**BODY, "stream": True, "stream_options": {"include_usage": True}, **extra},
    ) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                events.append(json.loads(line[5:]))
        return resp.status_code, events


def text(events: list[dict]) -> str:
    return "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices") or ())


TIE = 1e-3  # top-two log-probability gap under which batched fp32 arithmetic may pick either token


def check_same_greedy_text(got: str, want: str, steps: list[dict]) -> None:
    """``got`` is ``want`` (the uninterrupted stream's text), or departs from it only where the model's top two
    tokens were a near-tie (``steps``: the same answer's tokens with their top two log-probabilities). A
    resumption that lost, repeated or garbled tokens departs where the choice was clear."""
    if got == want:
        return
    at = next(
        (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
    )
    seen, k = b"", len(steps) - 1  # the token whose text reaches past the departure
    for i, step in enumerate(steps):
        seen += bytes(step["bytes"])
        if len(seen.decode("utf-8", "replace")) > at:
            k = i
            break
    # the streams' detokenizers place partial characters apart from this count: a few tokens either side
    near = steps[max(0, k - 2) : k + 2]
    gaps = [t["top_logprobs"][0]["logprob"] - t["top_logprobs"][1]["logprob"] for t in near]
    assert min(gaps) < TIE, f"departs at char {at} (about token {k}) where the choice was clear: gaps {gaps}"


def test_worker_kill_redispatches_and_streams_continue_unbroken(cluster):
    url = cluster.config.gateway_url
    r = cluster.client()
    requeued_before = int(r.hget("flying:stats", "requeued") or 0)
    steps: list[dict] = []  # the uninterrupted answer's tokens, with their top two log-probabilities

    async def scenario():
        async with httpx.AsyncClient(timeout=180) as client:
            reference = await stream(client, url)  # uninterrupted
            _, scored = await non_stream(client, url, logprobs=True, top_logprobs=2)
            steps.extend(scored["choices"][0]["logprobs"]["content"])
            tasks = [asyncio.create_task(non_stream(client, url)) for _ in range(8)]
            tasks += [asyncio.create_task(stream(client, url)) for _ in range(4)]
            await asyncio.sleep(1.0)
            assert r.scard("flying:inflight:1") > 0, "engine 1 must hold requests when it dies"
            cluster.kill_worker(1, signal.SIGKILL)
            return reference, await asyncio.gather(*tasks)

    (_, reference), results = asyncio.run(scenario())
    assert len(steps) == 400, "the scored answer has a log-probability a token"
    for status, body in results[:8]:  # nothing was sent to these clients yet: re-dispatched to engine 0
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 400
    for status, events in results[8:]:  # every stream, the killed engine's too, ends whole and identical
        assert status == 200
        assert not [e for e in events if "error" in e], events[-3:]
        assert events[-1]["usage"]["completion_tokens"] == 400
        check_same_greedy_text(text(events), text(reference), steps)
    assert int(r.hget("flying:stats", "requeued") or 0) > requeued_before
    deadline = time.monotonic() + 5
    while (health := httpx.get(url + "/health", timeout=5).json())["live_workers"] != [0]:
        assert time.monotonic() < deadline, f"dead engine still listed: {health}"
        time.sleep(0.2)
    assert health["status"] == "ok"
    ok = httpx.post(url + "/v1/chat/completions", json={**BODY, "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200

    cluster.start_worker(1)  # restore the shared cluster
    cluster.wait_live([1], timeout_s=240)
