"""The prompt counter's ids are the tokenizer's own: its Rust backend called directly gives what
``tokenizer(text)`` gives, with and without special tokens, for the chat template's rendering too."""

from __future__ import annotations

import functools

import pytest
from transformers import AutoTokenizer

from gateway.api.schemas import ChatCompletionRequest, CompletionRequest, Message
from gateway.tokens import PromptCounter

TEXTS = ["hi", "", "  leading and trailing  ", "<s>special</s> tokens <|user|> inside", "ünïcødé 日本語 🙂",
         "line\nbreaks\r\n and\ttabs", "a" * 5000, "the river and the sea 🙂 " * 2000]  # fmt: skip


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def counter(tiny_model) -> PromptCounter:
    c = PromptCounter(str(tiny_model))
    assert c.backend is not None, "the test model's tokenizer is a fast one"
    assert not isinstance(c.render, functools.partial), "the template renders into a shared context here"
    return c


@pytest.mark.parametrize("text", TEXTS)
def test_completion_counts_what_the_tokenizer_counts(tok, counter, text):
    assert counter.completion(CompletionRequest(model="m", prompt=text)) == len(tok(text).input_ids)
    assert counter.ids(text, special=False) == tok(text, add_special_tokens=False).input_ids
    assert counter.ids(text, special=True) == tok(text).input_ids


@pytest.mark.parametrize("text", TEXTS)
def test_chat_ids_are_the_templated_prompt_tokenized(tok, counter, text):
    req = ChatCompletionRequest(model="m", messages=[Message(role="system", content="be brief"), Message(role="user", content=text)])  # fmt: skip
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert counter.chat_ids(req) == tok(rendered, add_special_tokens=False).input_ids
    assert counter.chat(req) == len(counter.chat_ids(req))


def test_a_token_id_prompt_counts_its_ids(counter):
    assert counter.completion(CompletionRequest(model="m", prompt=[5, 6, 7])) == 3


def test_a_token_id_outside_the_vocabulary_is_refused(counter):
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        counter.completion(CompletionRequest(model="m", prompt=[5, counter.vocab]))
    assert counter.completion(CompletionRequest(model="m", prompt=[counter.vocab - 1])) == 1


def test_a_conversation_of_every_role_renders_as_apply_chat_template_does(tok, counter):
    messages = [("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("user", "and again")]
    req = ChatCompletionRequest(model="m", messages=[Message(role=r, content=c) for r, c in messages])
    rendered = tok.apply_chat_template([{"role": r, "content": c} for r, c in messages], add_generation_prompt=True, tokenize=False)  # fmt: skip
    assert counter.chat_ids(req) == tok(rendered, add_special_tokens=False).input_ids


async def test_a_long_text_is_tokenized_without_holding_the_event_loop(counter):
    """The backend's ``encode`` holds the GIL throughout: a megabyte prompt on another thread stopped the gateway's
    event loop until it was done. A long text goes through ``encode_batch``, which releases it."""
    import asyncio
    import time

    from gateway.tokens import LONG_TEXT_CHARS

    text = "hello world " * 100_000
    assert len(text) > LONG_TEXT_CHARS
    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.002)
            ticks += 1

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    t0, before = time.perf_counter(), ticks
    await asyncio.to_thread(counter.ids, text, False)
    took, ran = time.perf_counter() - t0, ticks - before
    ticker.cancel()
    assert ran >= 20, f"the loop ticked {ran} times in {took:.2f} s"
