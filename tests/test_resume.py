"""A stream continued on another engine: the client's text is the uninterrupted run's, also when the engine died
while its detokenizer held back an incomplete UTF-8 character (and, with it, whole words)."""

from __future__ import annotations

import json

import pytest
from sglang.utils import find_printable_text

from gateway.resume import DETOKENIZE_CONTEXT, Resumable, shown_whole

# A byte-level vocabulary: "é" is b"\xc3\xa9"; 5 ends in the first byte of a character, after a space.
VOCAB = {
    0: b"<",
    1: b"s>",
    2: b" the",
    3: b" cat",
    4: b" caf",
    5: b" caf\xc3",
    6: b"\xc3",
    7: b"\xa9",
    8: b" and",
}
PROMPT = [0, 1, 2, 3, 2, 3]


def decode(ids: list[int]) -> str:
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", "replace")


def engine_chunks(prompt: list[int], out: list[int], decode=decode) -> list[str]:
    """The text SGLang's detokenizer streams for ``out`` generated after ``prompt``, a chunk a token: decoded after
    the prompt's last ids, and while the text ends in an incomplete character, only the whole words before it."""
    ids = prompt[-DETOKENIZE_CONTEXT:]
    surr, read, decoded, sent = 0, len(ids), "", 0
    chunks = []
    for i, token in enumerate(out):
        ids.append(token)
        new = decode(ids[surr:])[len(decode(ids[surr:read])) :]
        pending = sent - len(decoded)
        if i == len(out) - 1:  # finished: the rest
            chunks.append((decoded + new)[sent:])
        elif new and not new.endswith("\ufffd"):
            decoded, surr, read, sent = decoded + new, read, len(ids), len(decoded) + len(new)
            chunks.append(new[pending:])
        else:
            printable = find_printable_text(new)
            sent = len(decoded) + len(printable)
            chunks.append(printable[pending:])
    return chunks


def events(prompt: list[int], out: list[int], chunks: list[str]) -> list[str]:
    """The engine's completion chunks, the first naming the prompt's ids."""
    got = []
    for i, (token, text) in enumerate(zip(out, chunks, strict=True)):
        choice: dict = {"index": 0, "text": text, "token_ids": [token], "finish_reason": None}
        if i == 0:
            choice["prompt_token_ids"] = prompt
        got.append(json.dumps({"id": "x", "choices": [choice]}))
    return got


def run(resume: Resumable, prompt: list[int], out: list[int], cut: int | None = None) -> str:
    """The client's text from feeding ``out``'s first ``cut`` chunks (all of them: None)."""
    chunks = events(prompt, out, engine_chunks(prompt, out))[:cut]
    return "".join(resume.event(e)[0]["choices"][0]["text"] for e in chunks)


@pytest.mark.parametrize("cut", range(1, 8))
def test_a_continuation_gives_the_client_the_uninterrupted_text_wherever_the_engine_died(cut):
    out = [2, 4, 6, 7, 8, 5, 7, 8, 3]  # " the caf" é " and" " caf" é " and cat"
    whole = decode(out)
    resume = Resumable({"prompt": PROMPT}, len(out), prompt_ids=PROMPT, decode=decode)
    before = run(resume, PROMPT, out, cut)
    body = resume.continuation()
    kept = body["prompt"][len(PROMPT) :]
    assert body["prompt"] == PROMPT + out[: len(kept)] and body["max_tokens"] == len(out) - len(kept)
    after = run(resume, body["prompt"], out[len(kept) :])
    assert before + after == whole


def test_the_continuation_starts_before_a_held_back_character_and_drops_the_words_the_client_has():
    out = [2, 5, 7, 8]  # " the caf\xc3" holds back " caf" (whole words only): " the" then " caf" is in flight
    resume = Resumable({"prompt": PROMPT}, 4, prompt_ids=PROMPT, decode=decode)
    assert run(resume, PROMPT, out, 2) == " the ", "the engine sent the words before the incomplete character"
    assert resume.continuation()["prompt"] == PROMPT + [2], "the token with the character's first byte again"
    assert resume.seen == " "
    assert run(resume, PROMPT + [2], [5, 7, 8]) == "café and"


def test_a_sampled_continuation_that_differs_drops_only_what_it_shares():
    resume = Resumable({"prompt": PROMPT}, 4, prompt_ids=PROMPT, decode=decode)
    run(resume, PROMPT, [2, 5, 7, 8], 2)
    resume.continuation()
    assert run(resume, PROMPT + [2], [3, 8]) == "cat and", "the space the client has is not sent again"


def test_without_a_decoder_or_held_back_text_every_streamed_id_is_kept():
    out = [2, 4, 6, 7, 8]
    blind = Resumable({"prompt": PROMPT}, 5, prompt_ids=PROMPT)
    run(blind, PROMPT, out, 3)
    assert blind.continuation()["prompt"] == PROMPT + out[:3]
    clean = Resumable({"prompt": PROMPT}, 5, prompt_ids=PROMPT, decode=decode)
    run(clean, PROMPT, out, 2)
    assert clean.continuation()["prompt"] == PROMPT + out[:2] and clean.seen == ""


def test_shown_whole_gives_up_looking_back_and_keeps_everything():
    assert shown_whole(decode, [], [2, 3], "something else") == (2, "")


def test_the_served_models_tokenizer_finds_the_held_back_byte(tiny_model):
    """With the tiny model's byte-level tokenizer (the gateway's decoder): an engine that died after the first
    byte of "é" is continued from the token before it, and the client gets "café" whole."""
    from gateway.tokens import PromptCounter

    tok = PromptCounter(str(tiny_model))
    out = tok.ids(" the cat said café and left", special=False)
    prompt = tok.ids("<|user|>hi<|end|><|assistant|>", special=False)
    at = next(i for i, t in enumerate(out) if tok.decode([t]) == "\ufffd") + 1  # the first byte streamed
    resume = Resumable({"prompt": prompt}, len(out), prompt_ids=prompt, decode=tok.decode)
    chunks = events(prompt, out, engine_chunks(prompt, out, tok.decode))
    before = "".join(resume.event(e)[0]["choices"][0]["text"] for e in chunks[:at])
    body = resume.continuation()
    assert body["prompt"] == prompt + out[: at - 1]
    rest = out[at - 1 :]
    after = events(body["prompt"], rest, engine_chunks(body["prompt"], rest, tok.decode))
    assert before + "".join(resume.event(e)[0]["choices"][0]["text"] for e in after) == tok.decode(out)
