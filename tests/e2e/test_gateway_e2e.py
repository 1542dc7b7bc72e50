"""Through the gateway to real SGLang CPU workers, with the official openai client."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "Tell me about the river and the sea."}]


@pytest.fixture
def oai(cluster):
    return openai.OpenAI(base_url=cluster.config.gateway_url + "/v1", api_key="unused", max_retries=0)


def test_non_streaming_chat_with_priority_header(oai):
    raw = oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, extra_headers={"X-Priority": "high"}
    )
    resp = raw.parse()
    assert resp.choices[0].message.content
    assert resp.usage.completion_tokens == 8 and resp.usage.prompt_tokens > 0
    assert float(raw.headers["x-queue-time-ms"]) >= 0
    assert raw.headers["x-request-id"]


def test_streaming_chat_with_usage(oai):
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Priority": "high"},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage.completion_tokens == 6


def test_n_choices_streaming_and_not(oai):
    """n=2 as stock SGLang serves it: two choices, usage summed over them; a stream carries both indices."""
    out = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0.8, n=2)
    assert sorted(c.index for c in out.choices) == [0, 1] and all(c.message.content for c in out.choices)
    assert out.usage.completion_tokens == 8
    text = oai.completions.create(model=MODEL, prompt="The sun rises", max_tokens=3, n=2)
    assert len(text.choices) == 2 and text.usage.completion_tokens == 6
    stream = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, n=2, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert all(texts.values()), texts
    assert chunks[-1].usage.completion_tokens == 8


def test_completions_and_models(oai):
    out = oai.completions.create(model=MODEL, prompt="The sun rises", max_tokens=5, temperature=0)
    assert out.usage.completion_tokens == 5
    [card] = oai.models.list().data
    assert card.id == MODEL


HOSTILE = [
    ("bad json", b"{oops", 400),
    ("json array", b"[1, 2]", 400),
    ("empty body", b"", 400),
    ("no messages", b'{"model": "tiny-llama"}', 400),
    ("empty messages", b'{"model": "tiny-llama", "messages": []}', 400),
    ("messages not a list", b'{"model": "tiny-llama", "messages": "hi"}', 400),
    ("bad role", b'{"model": "tiny-llama", "messages": [{"role": "god", "content": "x"}]}', 400),
    (
        "content wrong type",
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": {"a": 1}}]}',
        400,
    ),
    (
        "max_tokens string",
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}',
        400,
    ),
    (
        "max_tokens negative",
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
        400,
    ),
    (
        "max_tokens zero",
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
        400,
    ),
    (
        "max_tokens huge",
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10000000000}',
        400,
    ),
    (
        "temperature out of range",
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "temperature": 99}',
        400,
    ),
    ("n too large", b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "n": 99}', 400),
    ("unknown model", b'{"model": "gpt-5", "messages": [{"role": "user", "content": "x"}]}', 404),
    (
        "bad priority field",
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "priority": "urgent"}',
        400,
    ),
    ("oversize prompt", None, 400),
    ("body too large", b"{" + b" " * (5 * 1024 * 1024) + b"}", 413),
    (
        "stream not bool",
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
        400,
    ),
    ("nested garbage", b'{"model": "tiny-llama", "messages": [[[[[]]]]]}', 400),
    (
        "top_k over int32 (it stopped the engine's scheduler)",
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "top_k": 100000000000000}',
        400,
    ),
]


@pytest.mark.parametrize(("name", "body", "status"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_requests_get_the_right_4xx(cluster, name, body, status):
    if body is None:  # a prompt longer than the context limit (4096 tokens of KV per engine here)
        body = httpx.Request(
            "POST",
            "/",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "the river runs to the sea " * 1200}],
            },
        ).content
    resp = httpx.post(
        cluster.config.gateway_url + "/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if name == "oversize prompt":
        assert err["code"] == "context_length_exceeded" and "4096" in err["message"]


def test_bad_priority_header(cluster):
    resp = httpx.post(
        cluster.config.gateway_url + "/v1/chat/completions",
        headers={"X-Priority": "asap"},
        json={"model": MODEL, "messages": MESSAGES},
        timeout=30,
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "X-Priority"


def test_completion_logprobs_over_the_vocabulary_is_refused_not_run(cluster):
    """The engine's scheduler stopped on it (top-k over the vocabulary), and the retry stopped the next engine."""
    resp = httpx.post(
        cluster.config.gateway_url + "/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": 100000},
        timeout=30,
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "logprobs", resp.text


def test_a_request_that_fills_the_context_gets_every_token_it_was_admitted_for(cluster):
    """SGLang stops an output 2 tokens short of the context: the gateway admits prompt + max_tokens up to that,
    and the engine then produces all of them."""
    prompt = [5] * 3000
    url = cluster.config.gateway_url + "/v1/completions"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 100_000, "ignore_eos": True, "temperature": 0}
    refused = httpx.post(url, json=body, timeout=30)
    assert refused.status_code == 400, refused.text
    room = int(re.search(r"a request may use (\d+)", refused.json()["error"]["message"]).group(1))
    fits = room - len(prompt)
    assert httpx.post(url, json=body | {"max_tokens": fits + 1}, timeout=30).status_code == 400
    answer = httpx.post(url, json=body | {"max_tokens": fits}, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == fits, "every token admitted, none cut short"


def test_gateway_healthy_and_queue_clean_after_hostile_traffic(cluster):
    health = httpx.get(cluster.config.gateway_url + "/health", timeout=5).json()
    assert health["status"] == "ok" and health["live_workers"] == [0, 1] and health["queue_depth"] == 0


def test_redis_keys_match_the_documented_schema(cluster, oai):
    oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    out = subprocess.run(
        ["redis-cli", "-u", cluster.redis_url, "--scan"], capture_output=True, text=True, check=True
    ).stdout.split()
    documented = re.findall(r"^\| `([^`]+)` \|", (ROOT / "docs" / "redis.md").read_text(), re.M)
    patterns = [re.compile("^" + re.sub(r"\\\{\w+\\\}", "[^:]+", re.escape(k)) + "$") for k in documented]
    for key in out:
        assert any(p.match(key) for p in patterns), f"key {key} is not in docs/redis.md"
    assert {"flying:worker:0", "flying:worker:1", "flying:ready:0", "flying:workers"} <= set(out)
    assert any(k.startswith("flying:req:") for k in out)


def test_greedy_text_identical_to_a_stock_sglang_server(oai, stock_server):
    stock = openai.OpenAI(base_url=stock_server + "/v1", api_key="unused", max_retries=0)
    for content in ("Hello! How are you today?", "Tell me a story about a dragon and a castle."):
        msgs = [{"role": "user", "content": content}]
        ours = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
        theirs = stock.chat.completions.create(model="x", messages=msgs, max_tokens=24, temperature=0)
        assert ours.choices[0].message.content == theirs.choices[0].message.content
        assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens


def test_top_p_zero_answers_the_greedy_text(oai, stock_server):
    """OpenAI takes ``top_p`` 0 (SGLang refuses it): the gateway sends it as ``top_k`` 1, the greedy choice."""
    stock = openai.OpenAI(base_url=stock_server + "/v1", api_key="unused", max_retries=0)
    ours = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=1.0, top_p=0
    )
    theirs = stock.chat.completions.create(model="x", messages=MESSAGES, max_tokens=24, temperature=0)
    assert ours.choices[0].message.content == theirs.choices[0].message.content


def test_streamed_greedy_text_identical_to_a_stock_sglang_server(oai, stock_server):
    """A streaming chat request travels upstream as a token-id completion of the templated prompt (so it can
    resume elsewhere): the client's chunks say what stock SGLang's chat endpoint says."""
    stock = openai.OpenAI(base_url=stock_server + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "Tell me a story about a dragon and a castle."}]
    chunks = list(oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}))  # fmt: skip
    theirs = stock.chat.completions.create(model="x", messages=msgs, max_tokens=24, temperature=0)
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == theirs.choices[0].message.content
    )
    assert chunks[0].choices[0].delta.role == "assistant" and all(
        c.object == "chat.completion.chunk" for c in chunks
    )
    assert len({c.id for c in chunks}) == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == theirs.choices[0].finish_reason
    assert chunks[-1].usage.prompt_tokens == theirs.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == theirs.usage.completion_tokens


def test_client_disconnect_aborts_the_request_on_the_worker(cluster):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", cluster.config.gateway_url + "/v1/chat/completions", json=body, timeout=60
    ) as resp:
        rid = resp.headers["x-request-id"]
        engine = int(resp.headers["x-flying-engine"])
        for i, _ in enumerate(resp.iter_lines()):
            if i >= 4:
                break  # leave mid-stream: closing the connection is the disconnect
    r = cluster.client()
    deadline = time.monotonic() + 10
    while True:
        state = (r.hget(f"flying:req:{rid}", "state") or b"").decode()
        running = cluster.heartbeats()[engine].running
        if state == "cancelled" and running == 0:
            break  # the engine stopped decoding: no zombie request
        assert time.monotonic() < deadline, f"state={state} running={running} 10 s after disconnect"
        time.sleep(0.2)
    assert r.sismember(f"flying:inflight:{engine}", rid) == 0
