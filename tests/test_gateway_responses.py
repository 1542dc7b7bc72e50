"""``/v1/responses`` driven by the official ``openai`` client's ``client.responses.create``, streaming and not:
translated to a chat completion through the same queue (the engine sees a chat request), answered as the
Responses API's objects and events, which validate against the ``openai`` package's models with no extra field."""

from __future__ import annotations

import openai
import pytest

from tests import test_gateway_openai as stack
from tests.test_gateway_openai import no_extras

engine, http, client = stack.engine, stack.http, stack.client  # the fixtures: the same gateway and engine

SEQUENCE = [
    "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
    "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed",
]  # fmt: skip


def test_a_text_response(client, engine):
    out = client.responses.create(
        model="tiny-llama", input="hello there", instructions="be brief", temperature=0.5
    )
    no_extras(out)
    assert out.status == "completed" and out.output_text == " w0 w1 w2"
    assert float(out.created_at).is_integer(), "whole seconds, as OpenAI's (the SDK types it a float)"
    assert (
        out.usage.input_tokens == 2 + 3 + 2 and out.usage.output_tokens == 3 and out.usage.total_tokens == 10
    )
    details = out.usage.input_tokens_details.model_dump()  # (cache_write_tokens: required by openai 3.x)
    assert details["cached_tokens"] == 0 and details["cache_write_tokens"] == 0
    path, body = engine.calls[-1]
    assert path in ("/v1/chat/completions", "/v1/completions")
    assert body["temperature"] == 0.5


def test_a_message_list_with_text_parts_becomes_the_chat(client, engine):
    conversation = [
        {"role": "developer", "content": "rules"},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "one"}, {"type": "input_text", "text": " two"}],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "ok", "annotations": []}],
        },
        {"role": "user", "content": "three"},
    ]
    client.responses.create(model="tiny-llama", input=conversation, max_output_tokens=8, stream=False)
    body = engine.calls[-1][1]
    assert body["max_tokens"] == 8
    assert [m["content"] for m in body["messages"]] == ["rules", "one two", "ok", "three"]


def test_a_response_cut_by_max_output_tokens_is_incomplete(client):
    out = client.responses.create(model="tiny-llama", input="hi", max_output_tokens=2)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output_text == " w0 w1"
    assert out.output[0].status == "incomplete", "the message item is marked as the response is"
    events = list(client.responses.create(model="tiny-llama", input="hi", max_output_tokens=2, stream=True))
    assert events[-1].type == "response.incomplete"
    assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["incomplete"]


def test_current_responses_parameters_are_accepted_or_refused_with_a_reason(client):
    out = client.responses.create(
        model="tiny-llama", input="hi", max_output_tokens=2, max_tool_calls=3, prompt_cache_retention="24h",
        top_logprobs=0,
    )  # fmt: skip
    assert out.output_text == " w0 w1"
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model="tiny-llama", input="hi", top_logprobs=2)
    assert exc.value.body["param"] == "top_logprobs" and "log-probabilities" in exc.value.body["message"]


def test_a_streamed_response_has_the_responses_event_sequence(client):
    events = list(client.responses.create(model="tiny-llama", input="hi", stream=True))
    assert [e.type for e in events] == SEQUENCE
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for e in events:
        no_extras(e)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == " w0 w1 w2"
    done = events[-1].response
    assert done.output_text == " w0 w1 w2" and done.usage.output_tokens == 3


def test_a_json_schema_text_format_becomes_the_chats_response_format(client, engine):
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    out = client.responses.create(model="tiny-llama", input="hi", text={"format": fmt})
    no_extras(out)
    assert out.text.format.type == "json_schema" and out.text.format.name == "thing"
    body = engine.calls[-1][1]
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}  # fmt: skip
    client.responses.create(model="tiny-llama", input="hi", text={"format": {"type": "json_object"}})
    assert engine.calls[-1][1]["response_format"] == {"type": "json_object"}


def test_refused_fields_sent_as_null_are_accepted(http):
    body = {"model": "tiny-llama", "input": "hi", "previous_response_id": None, "conversation": None, "background": False, "stream": None}  # fmt: skip
    assert http.post("/v1/responses", json=body).status_code == 200


def test_the_priority_header_and_service_tier_apply(client, engine):
    client.responses.create(model="tiny-llama", input="hi", extra_headers={"X-Priority": "high"})
    assert engine.calls[-1][1]["priority"] == 2
    out = client.responses.create(
        model="tiny-llama", input="hi", service_tier="flex", store=True, metadata={"a": "b"}
    )
    assert engine.calls[-1][1]["priority"] == 0
    assert out.service_tier == "flex", "the tier it was served at"
    events = list(client.responses.create(model="tiny-llama", input="hi", stream=True, extra_headers={"X-Priority": "high"}))  # fmt: skip
    assert {e.response.service_tier for e in events if hasattr(e, "response")} == {"priority"}


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools", "not served"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0]", "only message"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0]", "text"),
        ({"input": ""}, "input", "no message has any content"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format", "json_schema"),
        ({"max_output_tokens": -3}, "max_output_tokens", "max_output_tokens must be at least 1"),
        ({"input": "w " * 5000}, "input", "maximum context length"),
    ],
)  # fmt: skip
def test_what_a_stateless_text_gateway_cannot_do_is_a_clear_400(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(**({"model": "tiny-llama", "input": "hi"} | extra))
    err = exc.value.body
    assert err["param"] == param and words in err["message"], err
