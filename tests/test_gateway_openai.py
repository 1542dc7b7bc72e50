"""The gateway as an OpenAI drop-in, driven by the official ``openai`` client: every prompt form of
``/v1/completions``, OpenAI's fields accepted or mapped, ``/v1/models/{id}``, and answers and stream chunks that
validate against the ``openai`` package's own models with no extra field. The real app, real Redis, the real
router in a thread; the engine answers as SGLang does, extra fields included (tests.sglang_like)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from openai.types import Completion
from pydantic import BaseModel
from starlette.testclient import TestClient

from flying.prefix import decode_chain, key_hash
from gateway.api import engine_fields
from gateway.api.batch import merge_completions
from gateway.app import create_app
from gateway.config import GatewayConfig
from tests.sglang_like import SGLangLike
from tests.stack import CountWords, RouterThread, ServerThread, announce_engine


@pytest.fixture(scope="module")
def engine():
    fake = SGLangLike()
    with ServerThread(fake.app) as server:
        fake.url = server.url
        yield fake


def gateway_client(redis_server, sync_redis, keys, engine, **config):
    announce_engine(sync_redis, keys, url=engine.url)
    cfg = GatewayConfig(model_path="unused", redis_url=redis_server.url, key_prefix=keys.prefix, **config)
    return TestClient(create_app(cfg, count_tokens=CountWords()), raise_server_exceptions=False)


@pytest.fixture
def http(redis_server, sync_redis, keys, engine):
    engine.calls.clear()
    with (
        RouterThread(redis_server.url, keys.prefix),
        gateway_client(redis_server, sync_redis, keys, engine) as c,
    ):
        yield c


@pytest.fixture
def client(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def no_extras(model: BaseModel, validate: bool = True) -> None:
    """Valid as its ``openai`` model (the client builds its objects without validating them), and no field beyond
    the model's own at any depth. A completion stream's chunk is validated with a null ``finish_reason`` read as
    "stop": the SDK reuses ``Completion`` for chunks and types it as never null (OpenAI's own chunks have null
    there). ``validate=False``: the fields only."""
    if validate:
        doc = model.model_dump(mode="json", exclude_unset=True, by_alias=True)
        if isinstance(model, Completion):
            for choice in doc.get("choices") or []:
                choice["finish_reason"] = choice.get("finish_reason") or "stop"
        model = type(model).model_validate(doc)
    _no_extras(model, "$")


# OpenAI's fields that the ``openai`` package pinned here (2.8, SGLang's pin) does not know yet, and its current
# releases require: the Responses usage's ``input_tokens_details.cache_write_tokens`` (required from openai 3.x)
NEWER_THAN_PINNED = frozenset({"cache_write_tokens"})


def _no_extras(model: BaseModel, where: str) -> None:
    extra = set(model.model_extra or {}) - NEWER_THAN_PINNED
    assert not extra, f"{where}: extra fields {sorted(extra)}"
    for name in type(model).model_fields:
        value = getattr(model, name)
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(item, BaseModel):
                _no_extras(item, f"{where}.{name}[{i}]" if isinstance(value, list) else f"{where}.{name}")


# -- prompt forms ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompt, sent",
    [("hello there", ["hello there"]), (["hello there"], ["hello there"]), (["one", "two words"], ["one", "two words"]),
     ([1, 2, 3], [[1, 2, 3]]), ([[1, 2], [3, 4, 5]], [[1, 2], [3, 4, 5]])],
    ids=["string", "one-string-list", "strings", "token-ids", "token-id-lists"],
)  # fmt: skip
def test_every_prompt_form_is_served_with_n_choices_per_prompt(client, engine, prompt, sent):
    out = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=3, n=2)
    no_extras(out)
    assert [c.index for c in out.choices] == list(range(2 * len(sent)))
    assert out.usage.completion_tokens == 3 * 2 * len(sent)
    got = [body["prompt"] for _, body in engine.calls]  # each prompt a request of its own
    assert sorted(map(str, got)) == sorted(map(str, sent))


def test_a_batch_numbers_choices_per_prompt_and_sums_usage():
    bodies = [
        {"id": "a", "choices": [{"index": 0, "text": "x"}, {"index": 1, "text": "y"}],
         "usage": {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 1}}},
        {"id": "b", "choices": [{"index": 1, "text": "w"}, {"index": 0, "text": "z"}],
         "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 2}}},
    ]  # fmt: skip
    out = merge_completions(bodies, n=2, request_id="batch-1")
    assert out["id"] == "batch-1" and [(c["index"], c["text"]) for c in out["choices"]] == [(0, "x"), (1, "y"), (3, "w"), (2, "z")]  # fmt: skip
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13, "prompt_tokens_details": {"cached_tokens": 3}}  # fmt: skip


@pytest.mark.parametrize(
    "prompt, param, words",
    [
        (
            5,
            "prompt",
            "must be a string, a list of strings, a list of token ids, or a list of token-id lists",
        ),
        (["a", 3], "prompt[1]", "got an integer"),
        ([[1, "x"]], "prompt[0][1]", "token id"),
        ([], "prompt", "empty"),
        ([[]], "prompt[0]", "empty list"),
        ([1, -2], "prompt[1]", "non-negative"),
    ],
)
def test_a_wrong_prompt_names_what_is_wrong(http, prompt, param, words):
    resp = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": prompt})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_type_errors_are_in_words(http):
    resp = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "a", "max_tokens": "9"})
    err = resp.json()["error"]
    assert (
        err["param"] == "max_tokens"
        and err["message"] == "max_tokens must be an integer or null, got a string"
    )


@pytest.mark.parametrize("n", [1, 2], ids=["resumable", "engine-endpoint"])
def test_a_streamed_batch_interleaves_its_prompts_choices(client, engine, n):
    stream = client.completions.create(model="tiny-llama", prompt=["one", "two words"], max_tokens=3, n=n,
                                       stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    texts: dict[int, str] = {}
    for chunk in chunks:
        no_extras(chunk)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {i: " w0 w1 w2" for i in range(2 * n)}
    assert len(engine.calls) == 2
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 3 * 2 * n and usage.prompt_tokens == 1 + 2


# -- fields accepted, mapped, refused ----------------------------------------------------------------------------
def test_fields_that_change_nothing_are_accepted_and_not_forwarded(client, engine):
    extra = {
        "store": True,
        "metadata": {"k": "v"},
        "user": "u",
        "safety_identifier": "s",
        "prompt_cache_key": "p",
    }
    client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                   modalities=["text"], **extra)  # fmt: skip
    client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2, best_of=1, extra_body=extra)
    for _, body in engine.calls:
        assert not {
            "store",
            "metadata",
            "safety_identifier",
            "prompt_cache_key",
            "modalities",
            "best_of",
        } & set(body)
        assert body["user"] == "u"


def test_prompt_cache_key_heads_the_queue_records_chain(client, sync_redis, keys):
    """The key is the router's affinity key (flying.prefix, router.dp_dispatch), from every endpoint."""
    hi = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model="tiny-llama", messages=hi, max_tokens=2, prompt_cache_key="user-7",
                                   extra_headers={"X-Request-Id": "key-chat"})  # fmt: skip
    client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2, extra_body={"prompt_cache_key": "user-7"},
                              extra_headers={"X-Request-Id": "key-completion"})  # fmt: skip
    client.responses.create(model="tiny-llama", input="hi", prompt_cache_key="user-7",
                            extra_headers={"X-Request-Id": "key-responses"})  # fmt: skip
    client.completions.create(
        model="tiny-llama", prompt="hi", max_tokens=2, extra_headers={"X-Request-Id": "no-key"}
    )
    for rid in ("key-chat", "key-completion", "key-responses", "no-key"):
        record = {k.decode(): v.decode() for k, v in sync_redis.hgetall(keys.request(rid)).items()}
        chain = (key_hash("user-7"),) if rid != "no-key" else ()
        assert (record["keyed"], decode_chain(record["prefix"])) == (str(rid != "no-key"), chain), rid


@pytest.mark.parametrize("tier, priority", [("priority", 2), ("default", 1), ("auto", 1), ("flex", 0)])
def test_service_tier_maps_to_a_priority(client, engine, tier, priority):
    client.completions.create(
        model="tiny-llama", prompt="hi", max_tokens=2, extra_body={"service_tier": tier}
    )
    assert engine.calls[-1][1]["priority"] == priority and "service_tier" not in engine.calls[-1][1]


def test_the_priority_header_wins_over_service_tier(client, engine):
    client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2, extra_body={"service_tier": "flex"},
                              extra_headers={"X-Priority": "high"})  # fmt: skip
    assert engine.calls[-1][1]["priority"] == 2


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_answer_names_the_tier_it_was_served_at(client, stream):
    """As OpenAI's: ``service_tier`` in the answer and in every chunk, the one its final priority is (a header
    that overrides the request's tier is what it was served at); completions have no such field."""
    cases = [
        ({"service_tier": "flex"}, {}, "flex"),
        ({}, {}, "default"),
        ({"service_tier": "auto"}, {}, "default"),
        ({"service_tier": "flex"}, {"X-Priority": "high"}, "priority"),
        ({"service_tier": "flex", "logprobs": True}, {}, "flex"),
    ]  # fmt: skip (logprobs: not resumable)
    for body, headers, tier in cases:
        kwargs = dict(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                      extra_body=body, extra_headers=headers)  # fmt: skip
        if stream:
            chunks = list(client.chat.completions.create(**kwargs, stream=True))
            assert chunks and {c.service_tier for c in chunks} == {tier}, (body, headers)
            for c in chunks:
                no_extras(c)
        else:
            answer = client.chat.completions.create(**kwargs)
            assert answer.service_tier == tier, (body, headers)
            no_extras(answer)
    done = client.completions.create(
        model="tiny-llama", prompt="hi", max_tokens=2, extra_body={"service_tier": "flex"}
    )
    assert "service_tier" not in done.model_dump(exclude_unset=True)


@pytest.mark.parametrize(
    "body, param",
    [({"best_of": 3}, "best_of"), ({"modalities": ["text", "audio"]}, "modalities"), ({"audio": {}}, "audio"),
     ({"service_tier": "turbo"}, "service_tier")],
)  # fmt: skip
def test_what_cannot_be_honoured_is_refused_with_why(http, body, param):
    path, base = ("/v1/completions", {"prompt": "hi"}) if "best_of" in body else ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    resp = http.post(path, json={"model": "tiny-llama", **base, **body})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


# -- models ------------------------------------------------------------------------------------------------------
def test_models_retrieve_and_an_unknown_model(client):
    card = client.models.retrieve("tiny-llama")
    assert card.id == "tiny-llama" and card.model_extra["max_model_len"] == 2048
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("gpt-9")
    assert exc.value.body["code"] == "model_not_found"


# -- OpenAI-shaped answers -----------------------------------------------------------------------------------------
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.mark.parametrize(
    "extra", [{}, {"n": 2}, {"logprobs": True}], ids=["resumable", "n", "engine-endpoint"]
)
def test_chat_answers_and_chunks_have_openai_shape(client, extra):
    no_extras(client.chat.completions.create(**CHAT, **extra))
    chunks = list(client.chat.completions.create(**CHAT, **extra, stream=True, stream_options={"include_usage": True}))  # fmt: skip
    for chunk in chunks:
        no_extras(chunk)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


@pytest.mark.parametrize("extra", [{}, {"n": 2}], ids=["resumable", "engine-endpoint"])
def test_completion_answers_and_chunks_have_openai_shape(client, extra):
    no_extras(client.completions.create(model="tiny-llama", prompt="hi", max_tokens=3, **extra))
    chunks = list(
        client.completions.create(model="tiny-llama", prompt="hi", max_tokens=3, stream=True, **extra)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == 0) == " w0 w1 w2"
    for chunk in chunks:
        no_extras(chunk)


PROMPTS = {"string": "hello there", "strings": ["one", "two words"], "token-ids": [1, 2, 3],
           "token-id-lists": [[1, 2], [3, 4, 5]]}  # fmt: skip


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("form", PROMPTS)
def test_every_prompt_forms_answer_and_chunks_validate_with_no_extra_field(client, form, n):
    ask = {"model": "tiny-llama", "prompt": PROMPTS[form], "max_tokens": 3, "n": n}
    no_extras(client.completions.create(**ask))
    chunks = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks:
        no_extras(chunk)
    prompts = len(PROMPTS[form]) if form in ("strings", "token-id-lists") else 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3 * n * prompts


def test_raw_engine_fields_keeps_sglangs_fields(redis_server, sync_redis, keys, engine):
    with RouterThread(redis_server.url, keys.prefix), gateway_client(redis_server, sync_redis, keys, engine, raw_engine_fields=True) as c:  # fmt: skip
        body = c.post("/v1/chat/completions", json=CHAT).json()
    assert body["metadata"] == {"weight_version": "default"} and "matched_stop" in body["choices"][0]


def test_cleaning_moves_reasoning_tokens_and_keeps_reasoning_text():
    doc = {"metadata": {"weight_version": "v"}, "sglext": {},
           "choices": [{"index": 0, "message": {"role": "assistant", "content": "a", "reasoning_content": "think"},
                        "matched_stop": 2, "finish_reason": "stop"}],
           "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3, "reasoning_tokens": 1}}  # fmt: skip
    out = engine_fields.clean(doc)
    assert out == {"choices": [{"index": 0, "message": {"role": "assistant", "content": "a", "reasoning_content": "think"},
                                "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3,
                             "completion_tokens_details": {"reasoning_tokens": 1}}}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_an_answers_id_is_the_request_id_not_the_engines_rid(client, stream):
    """SGLang names an answer after the rid it ran under (``<id>~<attempt>``): the client gets the request's id,
    the one ``X-Request-Id`` echoes, for chat and completions, streamed or not."""
    chat = client.chat.completions.with_raw_response.create(
        **CHAT, stream=stream, extra_headers={"X-Request-Id": f"chat-{stream}"}
    )
    text = client.completions.with_raw_response.create(
        model="tiny-llama",
        prompt="hi",
        max_tokens=3,
        stream=stream,
        extra_headers={"X-Request-Id": f"text-{stream}"},
    )
    for raw, rid in ((chat, f"chat-{stream}"), (text, f"text-{stream}")):
        assert raw.headers["x-request-id"] == rid
        parsed = raw.parse()
        ids = {chunk.id for chunk in parsed} if stream else {parsed.id}
        assert ids == {rid}


def test_every_chunk_of_a_stream_carries_its_first_chunks_id():
    stream_id = engine_fields.StreamId()
    lines = ['data: {"id": "a", "choices": [{"index": 0}]}', 'data: {"id": "b", "choices": [{"index": 1}]}']
    ids = [json.loads(engine_fields.clean_sse(line, stream_id)[0][6:])["id"] for line in lines]
    assert ids == ["a", "a"]  # (SGLang streams each of n choices under an id of its own)
    resumed = engine_fields.StreamId()  # an attempt's rid names its chunks: the request's id is the stream's
    for line in ['data: {"id": "r-1~0", "choices": []}', 'data: {"id": "r-1~1", "choices": []}']:
        assert json.loads(engine_fields.clean_sse(line, resumed)[0][6:])["id"] == "r-1"
    assert (
        engine_fields.clean({"id": "r-1~2"})["id"] == "r-1"
        and engine_fields.clean({"id": "9f0e"})["id"] == "9f0e"
    )


def test_an_engines_error_body_becomes_openais_shape():
    raw = b'{"object":"error","message":"bad","type":"BadRequestError","param":null,"code":400}'
    assert httpx.Response(200, content=engine_fields.openai_error(raw)).json() == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}
    }  # (SGLang's type is a Python exception's name; OpenAI's clients read type as one of theirs)
    assert engine_fields.openai_error(b"not json") == b"not json"
    assert engine_fields.openai_error_doc({"object": "error", "message": "m", "type": "t", "code": 503}) == {
        "error": {"message": "m", "type": "server_error", "param": None, "code": None}
    }
    kept = {"object": "error", "message": "m", "type": "rate_limit_error", "code": 429}
    assert engine_fields.openai_error_doc(kept)["error"]["type"] == "rate_limit_error"
    assert engine_fields.openai_error_doc({"choices": []}) is None


def test_an_engines_validation_error_is_told_in_words_with_its_param_and_no_server_paths():
    message = (
        "1 validation error:\n  {'type': 'missing', 'loc': ('body', 'tools', 0, 'function'), 'msg': 'Field "
        "required', 'input': {'type': 'function'}}\n\n  File \"/srv/.venv/lib/python3.11/site-packages/sglang/"
        'srt/entrypoints/http_server.py", line 1870, in openai_v1_chat_completions\n'
    )
    error = engine_fields.openai_error_doc({"object": "error", "message": message, "type": "BadRequestError", "code": 400})["error"]  # fmt: skip
    assert error == {
        "message": "invalid request: tools[0].function: Field required",
        "type": "invalid_request_error",
        "param": "tools[0].function",
        "code": None,
    }
    union = "2 validation errors:\n  {'type': 'literal_error', 'loc': ('body', 'response_format', 'ResponseFormat', 'type'), 'msg': 'Input should be text'}\n"  # fmt: skip
    assert engine_fields.readable_message(union) == (
        "invalid request: response_format.type: Input should be text",
        "response_format.type",
    )
    plain = "Input length (4095 tokens) exceeds the maximum allowed length (4090 tokens)"
    assert engine_fields.readable_message(plain) == (plain, None)
    grammar = (
        "Failed to compile regex grammar: [07:56:08] /project/cpp/regex_converter.cc:83: Regex parsing error at "
        "position 4: The parenthesis is not closed."
    )
    assert engine_fields.readable_message(grammar) == (
        "Failed to compile regex grammar: Regex parsing error at position 4: The parenthesis is not closed.",
        "regex",
    )
    assert engine_fields.readable_message("Failed to compile json grammar: x")[1] is None  # (tools or format)
    assert engine_fields.readable_message("x /a/b.py:3: y, and /c/d.cc:9: z") == ("x y, and z", None)
    sampling = (
        "min_new_tokens must be in [0, max_new_tokens(3)], got 10."  # SGLang's check, its internal names
    )
    assert engine_fields.readable_message(sampling) == (
        "min_tokens must be in [0, max_tokens(3)], got 10.",
        "min_tokens",
    )
    assert engine_fields.readable_message("top_k must be -1 (disable) or at least 1, got 0.")[1] == "top_k"
    slow = "/a" * 20_000 + ".py is not a file"
    t0 = time.perf_counter()
    assert engine_fields.readable_message(slow) == (slow, None)
    assert time.perf_counter() - t0 < 0.1, "a path-like message must not make the path pattern backtrack"


def test_an_error_sglang_streams_is_read_from_its_event():
    line = 'data: {"error": {"object": "error", "message": "bad regex", "type": "BadRequestError", "param": null, "code": 400}}'  # fmt: skip
    error = engine_fields.stream_error(line)
    assert error is not None and engine_fields.error_status(error) == 400
    assert engine_fields.stream_error('data: {"choices": [{"delta": {"content": "error"}}]}') is None
    assert engine_fields.error_status({"code": "x"}) == 400


def test_every_answers_id_is_the_one_x_request_id_echoes(client):
    """SGLang answers ``n`` > 1 under ids of its own, and a batch's prompts run as requests of their own: the
    client still sees one id, the request's, in every answer and chunk."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=2
    )
    assert raw.parse().id == raw.headers["x-request-id"]
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=2, stream=True
    )
    assert {c.id for c in raw.parse()} == {raw.headers["x-request-id"]}
    raw = client.completions.with_raw_response.create(model="tiny-llama", prompt=["a", "b c"], max_tokens=3)
    assert raw.parse().id == raw.headers["x-request-id"]
    raw = client.completions.with_raw_response.create(
        model="tiny-llama",
        prompt=["a", "b c"],
        max_tokens=3,
        stream=True,
        extra_headers={"X-Request-Id": "mine-1"},
    )
    assert raw.headers["x-request-id"] == "mine-1" and {c.id for c in raw.parse()} == {"mine-1"}


def test_a_batch_prompt_over_the_context_is_named_by_its_index(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny-llama", prompt=["short", "word " * 5000], max_tokens=2)
    assert (
        caught.value.body["param"] == "prompt[1]" and caught.value.body["code"] == "context_length_exceeded"
    )
