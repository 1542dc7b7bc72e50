import msgspec
import pytest

from gateway.api import schemas
from gateway.api.errors import InvalidRequest, QueueFullError


def chat(body: bytes):
    req = schemas.decode(body, schemas.ChatCompletionRequest)
    schemas.check_chat(req)
    return req


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"", None),
        (b"{not json", None),
        (b"[]", None),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "model"),  # missing: the param is the field
        (b'{"model": "m", "messages": [{"content": "x"}]}', "messages[0].role"),
        (b'{"model": "m", "messages": "hi"}', "messages"),
        (b'{"model": "m", "messages": [{"role": "wizard", "content": "x"}]}', "messages[0].role"),
        (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}', "max_tokens"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}', "max_tokens"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream"),
        (b'{"model": 7, "messages": [{"role": "user", "content": "x"}]}', "model"),
    ],
)
def test_type_errors_name_the_parameter(body, param):
    with pytest.raises(InvalidRequest) as exc:
        chat(body)
    assert exc.value.status == 400
    assert exc.value.param == param


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ('"n": 0', "n"),
        ('"n": 17', "n"),
        ('"temperature": -1', "temperature"),
        ('"temperature": 3', "temperature"),
        ('"top_p": -0.1', "top_p"),
        ('"top_p": 1.5', "top_p"),
        ('"presence_penalty": 9', "presence_penalty"),
        ('"stop": ["a", "b", "c", "d", "e"]', "stop"),
        ('"stop": ""', "stop"),
        ('"stop": ["a", ""]', "stop"),
        ('"min_tokens": -1', "min_tokens"),
        ('"min_tokens": 1.5', "min_tokens"),
        ('"top_logprobs": 50', "top_logprobs"),
        ('"logit_bias": {"abc": 5}', "logit_bias"),
        ('"logit_bias": {"-3": 5}', "logit_bias"),
        ('"logit_bias": {"12": 500}', "logit_bias"),
        ('"logit_bias": [1, 2]', "logit_bias"),
        ('"top_k": -5', "top_k"),
        ('"top_k": 0', "top_k"),
        ('"top_k": 2.5', "top_k"),
        ('"top_k": 100000000000000', "top_k"),
        ('"parallel_tool_calls": "no"', "parallel_tool_calls"),
        ('"metadata": {' + ", ".join(f'"k{i}": "v"' for i in range(17)) + "}", "metadata"),
        (
            '"metadata": {"k": "' + "v" * 513 + '"}',
            "metadata",
        ),  # over int32: it stopped the engine's scheduler
        ('"top_k": 1073741825', "top_k"),
        ('"min_p": 1.5', "min_p"),
        ('"repetition_penalty": -1', "repetition_penalty"),
        ('"repetition_penalty": "x"', "repetition_penalty"),
        ('"stream_options": {"include_usage": true}', "stream_options"),
        ('"seed": 100000000000000000000000', "seed"),
        ('"stop_token_ids": ["x"]', "stop_token_ids"),
        ('"stop_token_ids": 7', "stop_token_ids"),
        ('"top_logprobs": 2', "top_logprobs"),
    ],
)
def test_value_errors_name_the_parameter(extra, param):
    body = ('{"model": "m", "messages": [{"role": "user", "content": "x"}], ' + extra + "}").encode()
    with pytest.raises(InvalidRequest) as exc:
        chat(body)
    assert exc.value.param == param


def test_a_tool_message_names_the_call_it_answers():
    body = (
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}]}'
    )
    with pytest.raises(InvalidRequest) as exc:
        chat(body)
    assert exc.value.param == "messages[1].tool_call_id"
    ok = b'{"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "42", "tool_call_id": "c1"}]}'
    assert chat(ok).messages[1].tool_call_id == "c1"


def test_top_p_zero_is_the_most_likely_token_as_openai_takes_it():
    req = chat(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0, "top_k": 50}')
    sent = msgspec.to_builtins(schemas.for_engine(req))
    assert sent["top_k"] == 1 and "top_p" not in sent  # SGLang refuses top_p 0; top_k 1 is the same choice
    kept = schemas.for_engine(
        chat(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0.5}')
    )
    assert kept.top_p == 0.5 and kept.top_k is None


def test_top_k_up_to_sglangs_whole_vocabulary_value_passes():
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_k": 1073741824}'
    assert chat(body).top_k == 1 << 30


@pytest.mark.parametrize("logprobs", [-1, 21, 100000])
def test_a_completions_logprobs_beyond_the_bound_is_refused(logprobs):
    """More than the vocabulary stopped the engine's scheduler (and every request on it): refused at the door."""
    req = schemas.decode(
        msgspec.json.encode({"model": "m", "prompt": "x", "logprobs": logprobs}), schemas.CompletionRequest
    )
    with pytest.raises(InvalidRequest, match="logprobs must be between 0 and 20") as exc:
        schemas.check_completion(req)
    assert exc.value.param == "logprobs"
    ok = schemas.decode(b'{"model": "m", "prompt": "x", "logprobs": 20}', schemas.CompletionRequest)
    schemas.check_completion(ok)


def test_optional_fields_sent_as_null_mean_their_defaults():
    """Clients that send every field send OpenAI's optional ones as null: accepted as if absent, refused fields
    included; a body that is wrong apart from its nulls is told what is wrong."""
    nulls = {"stream": None, "n": None, "audio": None, "prediction": None, "web_search_options": None,
             "stream_options": None, "temperature": None}  # fmt: skip
    req = chat(msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "x"}], **nulls}))
    assert req.stream is False and req.n == 1
    done = schemas.decode(
        b'{"model": "m", "prompt": "x", "stream": null, "n": null}', schemas.CompletionRequest
    )
    assert done.stream is False and done.n == 1
    with pytest.raises(InvalidRequest) as exc:
        chat(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": null, "n": "2"}')
    assert exc.value.param == "n"
    with pytest.raises(InvalidRequest, match="audio is not supported here") as exc:
        chat(
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": null, "audio": {"voice": "a"}}'
        )
    assert exc.value.param == "audio"


def test_empty_messages_are_rejected():
    for body in (
        b'{"model": "m", "messages": []}',
        b'{"model": "m", "messages": [{"role": "user", "content": ""}]}',
    ):
        with pytest.raises(InvalidRequest) as exc:
            chat(body)
        assert exc.value.param == "messages"


def test_valid_chat_with_text_parts():
    req = chat(
        b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},'
        b' {"type": "text", "text": "b"}]}], "max_tokens": 3}'
    )
    assert req.messages[0].text() == "ab" and req.max_tokens == 3


def test_sglang_fields_pass_through_refused_ones_say_why_unknown_ones_are_named():
    import msgspec

    body = (
        b'{"model": "m", "messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]},'
        b' {"role": "tool", "content": "42", "tool_call_id": "c"}], "top_k": 5, "min_p": 0.1,'
        b' "tools": [{"type": "function", "function": {"name": "f"}}], "response_format": {"type": "json_object"}}'
    )
    out = msgspec.to_builtins(chat(body))
    assert (
        out["top_k"] == 5
        and out["min_p"] == 0.1
        and out["tools"] == [{"type": "function", "function": {"name": "f"}}]
    )
    assert out["messages"][1] == {"role": "tool", "content": "42", "tool_call_id": "c"}
    assert "logit_bias" not in out, "fields not sent are not invented"
    for raw, param, words in [
        (b'"whatever": 1', "whatever", "unknown parameter whatever"),
        (b'"session_id": "s"', "session_id", "sessions live on one engine"),
        (b'"rid": "x"', "rid", "X-Request-Id"),
    ]:
        with pytest.raises(InvalidRequest) as exc:
            chat(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], ' + raw + b"}")
        assert exc.value.param == param and words in exc.value.message
    with pytest.raises(InvalidRequest) as exc:
        chat(b'{"model": "m", "messages": [{"role": "user", "content": "x", "foo": 1}]}')
    assert exc.value.param == "messages[0].foo"


def test_completion_prompt_checks():
    for body in (
        b'{"model": "m", "prompt": ""}',
        b'{"model": "m", "prompt": [-1]}',
        b'{"model": "m", "prompt": []}',
    ):
        req = schemas.decode(body, schemas.CompletionRequest)
        with pytest.raises(InvalidRequest):
            schemas.check_completion(req)


def test_priority_header_wins_and_is_validated():
    assert schemas.resolve_priority("HIGH", "low") == "high"
    assert schemas.resolve_priority(None, "low") == "low"
    assert schemas.resolve_priority(None, None) == "normal"
    assert schemas.resolve_priority("", "low") == "low" and schemas.resolve_priority("  ", None) == "normal"
    with pytest.raises(InvalidRequest) as exc:
        schemas.resolve_priority("urgent", None)
    assert exc.value.param == "X-Priority"
    with pytest.raises(InvalidRequest) as exc:
        schemas.resolve_priority(None, "3")
    assert exc.value.param == "priority"


def test_error_body_is_openai_shaped():
    body = QueueFullError("full").body()
    assert body == {
        "error": {"message": "full", "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}
    }


def test_service_tier_is_a_priority_unless_one_is_given():
    assert schemas.resolve_priority(None, None, "priority") == "high"
    assert schemas.resolve_priority(None, None, "flex") == "low"
    assert schemas.resolve_priority(None, None, "auto") == "normal"
    assert schemas.resolve_priority("low", None, "priority") == "low"
    assert schemas.resolve_priority(None, "high", "flex") == "high"


def test_prompt_forms_and_the_fields_not_forwarded():
    req = schemas.decode(b'{"model": "m", "prompt": [[1, 2], [3]], "store": true, "best_of": 1}', schemas.CompletionRequest)  # fmt: skip
    schemas.check_completion(req)
    parts = schemas.split_prompts(req)
    assert [p.prompt for p in parts] == [[1, 2], [3]]
    sent = msgspec.to_builtins(schemas.for_engine(parts[0]))
    assert sent == {"model": "m", "prompt": [1, 2]}
    assert schemas.prompts("x") == ["x"] and schemas.prompts([7]) == [[7]] and schemas.prompts(["a", "b"]) == ["a", "b"]  # fmt: skip
    with pytest.raises(InvalidRequest) as exc:
        schemas.prompts([1, True])
    assert exc.value.param == "prompt[1]"


def test_good_sampling_extensions_pass():
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"12": -100, "7": 2.5},'
    req = chat(body + b' "top_k": -1, "min_p": 0.05, "repetition_penalty": 1.1}')
    assert req.top_k == -1 and req.logit_bias == {"12": -100, "7": 2.5}


def test_an_answers_message_sent_back_as_the_openai_client_dumps_it_is_accepted():
    """The usual multi-turn pattern: ``messages + [r.choices[0].message.model_dump()]`` carries refusal,
    annotations, audio and function_call as null."""
    dumped = {"role": "assistant", "content": "ok", "refusal": None, "annotations": None, "audio": None,
              "function_call": None, "tool_calls": None}  # fmt: skip
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}, dumped, {"role": "user", "content": "more"}]}  # fmt: skip
    req = chat(msgspec.json.encode(body))
    assert msgspec.to_builtins(req.messages[1]) == {"role": "assistant", "content": "ok"}
    audio = dict(dumped, audio={"id": "audio_1"})
    with pytest.raises(InvalidRequest) as exc:
        chat(msgspec.json.encode(dict(body, messages=[audio])))
    assert exc.value.param == "messages[0].audio"


def test_current_openai_parameters_that_change_nothing_here_are_accepted_and_not_forwarded():
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "verbosity": "low", "prompt_cache_retention": "24h"}'  # fmt: skip
    req = chat(body)
    assert msgspec.to_builtins(schemas.for_engine(req)) == {"model": "m", "messages": [{"role": "user", "content": "x"}]}  # fmt: skip


def test_a_body_nested_too_deeply_is_a_400_not_a_500():
    depth = 5000
    body = b'{"model": "m", "max_tokens": 1, "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(InvalidRequest, match="nested too deeply"):
        schemas.decode(body, schemas.CompletionRequest)


@pytest.mark.parametrize(
    ("extra", "pinned"),
    [
        ({}, False),
        ({"response_format": {"type": "text"}}, False),
        ({"response_format": {"type": "json_object"}}, True),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, True),
        ({"regex": "[ab]+"}, True),
        ({"ebnf": 'root ::= "a"'}, True),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, True),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, True),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}, False),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, True),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            True,
        ),  # fmt: skip
    ],
)
def test_constrained_requests_are_the_ones_with_a_grammar(extra, pinned):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}
    assert schemas.constrained(chat(msgspec.json.encode(body))) is pinned


TOOL = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
            "'g'",
        ),
        ({"tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "no tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [TOOL], "tool_choice": "always"}, "tool_choice", "'always'"),
        ({"tools": {"f": 1}}, "tools", "object"),
        ({"tools": [TOOL, {"type": "function", "function": {}}]}, "tools[1].function.name", "name"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "name"),
    ],
)
def test_tool_errors_name_the_parameter(extra, param, says):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}
    with pytest.raises(InvalidRequest) as exc:
        schemas.check_chat(chat(msgspec.json.encode(body)))
    assert exc.value.param == param
    assert says in str(exc.value)


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": "none"},
        {"tool_choice": "auto"},
        {"tools": [TOOL], "tool_choice": "required"},
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
    ],
)
def test_valid_tool_choices_pass(extra):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}
    schemas.check_chat(chat(msgspec.json.encode(body)))


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
        ({"type": "xml"}, "response_format.type"),
        ("json", "response_format"),
    ],
)
def test_response_format_errors_name_the_parameter(fmt, param):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": fmt}
    with pytest.raises(InvalidRequest) as exc:
        schemas.check_chat(chat(msgspec.json.encode(body)))
    assert exc.value.param == param


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "text"},
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    ],
)
def test_valid_response_formats_pass(fmt):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": fmt}
    schemas.check_chat(chat(msgspec.json.encode(body)))


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].type",
            "only text content parts are served",
        ),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "one of system, user"),
        (
            {"messages": [{"role": "user", "content": "x"}], "service_tier": "gold"},
            "service_tier",
            "one of priority, default",
        ),
    ],
)
def test_a_value_outside_a_fields_set_is_told_with_the_values_it_takes(body, param, says):
    with pytest.raises(InvalidRequest) as exc:
        chat(msgspec.json.encode({"model": "m", **body}))
    assert exc.value.param == param
    assert says in str(exc.value) and "Invalid enum" not in str(exc.value)
