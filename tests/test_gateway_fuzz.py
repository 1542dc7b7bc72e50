"""Fuzzing the gateway's HTTP edge: whatever the body and headers, the answer is never a 5xx, and every error is
OpenAI-shaped. The real app (real tokenizer and chat template of the tiny model, real Redis, the real router in a
thread); only the engine is a fake (``loadgen.fake_server``) that answers every request it gets."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.config import GatewayConfig
from loadgen import fake_server
from tests.stack import RouterThread, announce_engine


@pytest.fixture
def app_client(redis_server, sync_redis, keys, tiny_model, tmp_path):
    from gateway.tokens import PromptCounter

    engine_proc, engine_url = fake_server.start_process(tmp_path / "engine.log")
    announce_engine(sync_redis, keys, url=engine_url)
    cfg = GatewayConfig(model_path=str(tiny_model), redis_url=redis_server.url, key_prefix=keys.prefix)
    app = create_app(cfg, count_tokens=PromptCounter(str(tiny_model)))
    with RouterThread(redis_server.url, keys.prefix), TestClient(app, raise_server_exceptions=False) as c:
        yield c
    engine_proc.kill()
    engine_proc.wait()


# -- strategies ---------------------------------------------------------------------------------------------------
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
anything = st.recursive(
    scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
    max_leaves=8,
)  # fmt: skip
roles = st.sampled_from(["system", "user", "assistant", "developer", "tool", "robot", ""])
content = st.text(max_size=40) | st.none() | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}), max_size=2) | anything  # fmt: skip
message = st.fixed_dictionaries({"role": roles}, optional={"content": content, "name": st.text(max_size=5)})
small_ints = st.integers(-3, 40) | st.integers()
fields = {
    "model": st.sampled_from(["tiny-llama", "gpt-9", ""]) | anything,
    "messages": st.lists(message, max_size=3) | anything,
    "prompt": st.text(max_size=40) | st.lists(small_ints, max_size=5) | anything,
    "max_tokens": small_ints | anything,
    "max_completion_tokens": small_ints,
    "temperature": st.floats(-1, 3) | anything,
    "top_p": st.floats(-1, 2),
    "n": small_ints,
    "stream": st.booleans() | anything,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}) | anything,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=3), max_size=6),
    "seed": small_ints,
    "priority": st.sampled_from(["high", "normal", "low", "urgent"]) | anything,
    "logprobs": anything,
    "top_logprobs": small_ints,
    "presence_penalty": st.floats(-3, 3),
    "echo": anything,
    "ignore_eos": anything,
    "unknown_field": anything,
}
typed = {  # well-typed values, mostly in range: bodies that pass validation, with edge values
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.text(max_size=5),
    "seed": st.integers(0, 2**63 - 1),
    "priority": st.sampled_from(["high", "normal", "low"]),
    "user": st.text(max_size=10),
}
valid = st.fixed_dictionaries(  # a chat body or a completion body (one endpoint's fields: others are a 400)
    {
        "model": st.just("tiny-llama"),
        "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.text(min_size=1, max_size=40)}), min_size=1, max_size=2),
    },
    optional=typed,
) | st.fixed_dictionaries(
    {
        "model": st.just("tiny-llama"),
        "prompt": st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 100), min_size=1, max_size=5),
    },
    optional=typed,
)  # fmt: skip
wild = st.fixed_dictionaries({}, optional=fields)
half = st.builds(lambda v, w: {**v, **w}, valid, st.fixed_dictionaries({}, optional=fields))
json_bodies = st.builds(
    lambda d, ascii_: json.dumps(d, ensure_ascii=ascii_).encode(), valid | wild | half, st.booleans()
)


@st.composite
def mangled(draw, bodies):
    """A JSON body with a byte replaced, inserted (often invalid UTF-8) or cut off."""
    body = bytearray(draw(bodies))
    at = draw(st.integers(0, len(body)))
    how = draw(st.sampled_from(["replace", "insert", "truncate"]))
    junk = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\\ud800", b'"', b"{"]))
    if how == "truncate":
        return bytes(body[:at])
    if how == "replace" and at < len(body):
        body[at : at + 1] = junk
    else:
        body[at:at] = junk
    return bytes(body)


bodies = json_bodies | mangled(json_bodies) | st.binary(max_size=64) | st.sampled_from(
    [b"", b"null", b"[]", b'"x"', b"1e999", b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\ud800"}]}']
)  # fmt: skip
header_value = st.binary(max_size=20).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"").replace(b"\0", b"").strip())  # fmt: skip
headers = st.fixed_dictionaries(
    {},
    optional={
        "x-priority": st.sampled_from([b"high", b"LOW", b" normal ", b"urgent"]) | header_value,
        "content-type": st.sampled_from([b"application/json", b"text/plain"]) | header_value,
        "authorization": header_value,
        "accept": header_value,
    },
)


def assert_openai_error(resp: httpx.Response) -> None:
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], resp.text


def test_no_body_or_header_gets_a_5xx(app_client):
    seen: dict[int, int] = {}

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), body=bodies, hdrs=headers)
    def one(path, body, hdrs):
        resp = app_client.post(path, content=body, headers=hdrs)
        seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
        assert resp.status_code < 500, (resp.status_code, resp.text, body, hdrs)
        if resp.status_code != 200:
            assert_openai_error(resp)
        elif resp.headers["content-type"].startswith("text/event-stream"):
            assert resp.text.rstrip().endswith("data: [DONE]"), resp.text
        else:
            assert resp.json()["choices"], resp.text

    one()
    assert seen.get(200) and seen.get(400), f"the fuzz reached both success and validation: {seen}"


@pytest.mark.parametrize(
    "body",
    [b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\xff\xfe"}]}', b"\xef\xbb", b"\x80"],
    ids=["in-string", "bom-fragment", "lone-continuation"],
)
def test_invalid_utf8_is_a_400(app_client, body):
    resp = app_client.post("/v1/chat/completions", content=body)
    assert resp.status_code == 400
    assert_openai_error(resp)
    assert resp.json()["error"]["code"] == "invalid_request"


def test_a_prompt_the_tokenizer_rejects_is_a_400(app_client):
    """Tokenizers and chat templates raise anything (Jinja's raise_exception on roles they do not allow): the
    client's error, a 400 naming the parameter, not a 500."""

    class Rejecting:
        def chat_ids(self, req):
            raise RuntimeError("Conversation roles must alternate user/assistant/user/assistant/...")

    app_client.app.state.gateway.admission.count_tokens = Rejecting()
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}]}
    resp = app_client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400
    assert_openai_error(resp)
    assert resp.json()["error"]["param"] == "messages" and "alternate" in resp.json()["error"]["message"]
