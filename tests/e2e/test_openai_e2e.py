"""The OpenAI drop-in against real SGLang CPU workers: every endpoint and prompt form with the official ``openai``
client, every answer and stream chunk valid as the ``openai`` package's models with no field beyond them (SGLang's
own extras removed by the gateway)."""

from __future__ import annotations

import openai
import pytest

from tests.test_gateway_openai import no_extras

pytestmark = pytest.mark.e2e
MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "Tell me about the river and the sea."}]


@pytest.fixture
def oai(cluster):
    return openai.OpenAI(base_url=cluster.config.gateway_url + "/v1", api_key="unused", max_retries=0)


def test_chat_answers_and_chunks_are_openai_shaped(oai):
    no_extras(oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0))
    for extra in ({}, {"n": 2}):
        stream = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=True,
                                             stream_options={"include_usage": True}, **extra)  # fmt: skip
        for chunk in stream:
            no_extras(chunk)


def test_every_prompt_form_and_best_of(oai):
    for prompt, prompts in [("The sun", 1), (["The sun", "The moon"], 2), ([1, 450, 657], 1), ([[1, 450], [1, 278]], 2)]:  # fmt: skip
        out = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=3, n=2, best_of=2, temperature=0)
        no_extras(out)
        assert [c.index for c in out.choices] == list(range(2 * prompts))
        assert out.usage.completion_tokens == 3 * 2 * prompts


def test_a_streamed_batch(oai):
    stream = oai.completions.create(model=MODEL, prompt=["The sun", "The moon"], max_tokens=3, n=2, stream=True,
                                    stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    for chunk in chunks:
        no_extras(chunk, validate=all(c.finish_reason is not None for c in chunk.choices))
    assert {c.index for chunk in chunks for c in chunk.choices} == {0, 1, 2, 3}
    assert chunks[-1].usage.completion_tokens == 3 * 2 * 2


def test_a_token_id_outside_the_vocabulary_is_a_400_not_an_engine_crash(oai):
    with pytest.raises(openai.BadRequestError) as exc:
        oai.completions.create(model=MODEL, prompt=[[1, 2], [1, 10**6]], max_tokens=2)
    assert exc.value.body["param"] == "prompt[1]" and "vocabulary" in exc.value.body["message"]
    assert oai.completions.create(model=MODEL, prompt=[1, 2], max_tokens=2).usage.completion_tokens == 2


def test_requests_sglang_refuses_are_openai_errors_with_their_param(oai):
    """SGLang refuses a regex it cannot compile only once the stream has started, and validates some fields
    itself: the client still gets a 400 in OpenAI's shape, naming the field, with no server paths."""
    with pytest.raises(openai.BadRequestError) as exc:
        next(iter(oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, stream=True,
                                              extra_body={"regex": "("})))  # fmt: skip
    assert exc.value.body["type"] == "invalid_request_error" and "regex" in exc.value.body["message"].lower()
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, tools=[{"type": "function"}]
        )
    assert exc.value.body["param"] == "tools[0].function" and 'File "' not in exc.value.body["message"]
    first = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0)
    turn = [*MESSAGES, first.choices[0].message.model_dump(), {"role": "user", "content": "And then?"}]
    again = oai.chat.completions.with_raw_response.create(model=MODEL, messages=turn, max_tokens=3, n=2)
    assert again.parse().id == again.headers["x-request-id"], "the request's id, also for n > 1"


def test_models_retrieve(oai):
    card = oai.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["max_model_len"] > 0


def test_responses_streaming_and_not(oai):
    out = oai.responses.create(model=MODEL, input="The river", instructions="Answer.", max_output_tokens=5)
    no_extras(out)
    assert out.output_text and out.usage.output_tokens == 5
    events = list(oai.responses.create(model=MODEL, input="The river", max_output_tokens=5, stream=True))
    for e in events:
        no_extras(e)
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed",
        "response.incomplete",
    )
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == events[-1].response.output_text  # fmt: skip
