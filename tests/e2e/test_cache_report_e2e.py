"""SGLang's prefix cache seen from outside on the live CPU stack: a repeated prompt reports cached tokens in the
usage of streaming and non-streaming answers, the engines' heartbeats tally the same tokens, flyctl shows each
engine's hit rate, and loadgen's sessions report theirs. The shared 2-engine cluster: bindable engines, cache on
(the default), the router manual, so no bind happens here."""

from __future__ import annotations

import time

import httpx
import pytest

from devstack.cluster import Cluster
from flyctl.cli import main as flyctl
from flying import control

pytestmark = pytest.mark.e2e
SYSTEM = "You are a careful assistant who answers questions about rivers, seas and mountains. " * 12


def chat(url: str, question: str, stream: bool) -> tuple[int, dict]:
    """(engine, usage) of one greedy chat request through the gateway."""
    body = {"model": "tiny-llama", "max_tokens": 4, "temperature": 0, "stream": stream,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}  # fmt: skip
    if not stream:
        resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        return int(resp.headers["x-flying-engine"]), resp.json()["usage"]
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        events = [line[5:].strip() for line in resp.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    return int(resp.headers["x-flying-engine"]), httpx.Response(200, content=events[-2]).json()["usage"]


def tally(c: Cluster) -> tuple[tuple[int, int], dict]:
    """The engines' (prompt, cached) tokens summed, and their heartbeats."""
    beats = control.status(c.client(), c.keys)
    return (
        sum(hb.prompt_tokens for hb in beats.values()),
        sum(hb.cached_tokens for hb in beats.values()),
    ), beats


def test_a_repeated_prompt_reports_cached_tokens_and_the_engines_tally_them(cluster, capsys):
    url, seen, usages = cluster.config.gateway_url, set(), []
    time.sleep(0.2)
    (prompt0, cached0), _ = tally(cluster)  # SGLang's own warm-up request at start counts too
    for i, stream in enumerate([True, False, True, False, True, True]):
        engine, usage = chat(url, "Which river is the longest?", stream)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        if (
            engine in seen
        ):  # this engine has the whole prompt: all of it but the last token comes from its cache
            assert usage["prompt_tokens"] - 1 <= cached < usage["prompt_tokens"], (i, usage)
        seen.add(engine)
        usages.append(usage)
    assert len(usages) - len(seen) >= 4, "at least four answers came from an engine that had the prompt"
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    deadline = time.monotonic() + 10
    while True:  # the heartbeats (every 50 ms) tally what the engines finished: the same tokens
        now, beats = tally(cluster)
        if now == (prompt0 + prompt, cached0 + cached) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert now == (prompt0 + prompt, cached0 + cached)
    args = ["--redis-url", cluster.redis_url, "--key-prefix", cluster.keys.prefix, "status"]
    assert flyctl(args) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    rows = {
        int(x.split()[0]): x.split() for x in lines if x.split() and x.split()[0].isdigit()
    }  # (node headers)
    for e, hb in beats.items():
        shown = "-" if hb.cache_hit_rate is None else f"{hb.cache_hit_rate:.1%}"
        assert (
            rows[e][10] == shown
        )  # (engine, mode, epoch, pending, group, inflight, run, wait, paused, free KV)
    assert any(hb.cache_hit_rate and hb.cache_hit_rate > 0.5 for hb in beats.values())


def test_loadgen_sessions_report_the_hit_rate(cluster, tmp_path):
    import json

    from loadgen.cli import main as loadgen

    out = tmp_path / "sessions"
    args = ["run", "--url", cluster.config.gateway_url, "-n", "4", "--rate", "inf", "--max-concurrency", "2",
            "--input-tokens", "8", "--output-tokens", "4", "--system-prompts", "2", "--system-prompt-words", "150",
            "--turns", "2", "--out", str(out), "--quiet"]  # fmt: skip
    assert loadgen(args) == 0
    s = json.loads(out.with_suffix(".json").read_text())["summary"]
    assert s["completed"] == 8 and s["cached_tokens"] > 0
    assert 0.3 < s["cache_hit_rate"] < 1, "second turns and the later sessions find their system prompt"
