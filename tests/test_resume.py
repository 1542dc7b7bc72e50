"""A stream continued on another engine: the client's text is the uninterrupted run's, also when the engine died
while SGLang's detokenizer held back an incomplete UTF-8 character (and, with it, whole words). The engine side
is SGLang's own detokenizer (its ``DetokenizerManager``'s decoding, fed as the scheduler feeds it)."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest

with warnings.catch_warnings():  # SGLang's import-time notes on quantizations only GPUs run
    warnings.simplefilter("ignore", UserWarning)
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager, LimitedCapacityDict
    from sglang.srt.managers.schedule_batch import INIT_INCREMENTAL_DETOKENIZATION_OFFSET

from gateway.resume import DETOKENIZE_CONTEXT, HELD_BACK_MAX, Resumable, shown_whole

# A byte-level vocabulary: "é" is b"\xc3\xa9"; 5 ends in the first byte of a character, after a word; 10 is a CJK
# character and the first byte of another (SGLang sends the CJK character before it early).
VOCAB = {0: b"<", 1: b"s>", 2: b" the", 3: b" cat", 4: b" caf", 5: b" caf\xc3", 6: b"\xc3", 7: b"\xa9", 8: b" and",
         9: "好".encode(), 10: "很".encode() + "是".encode()[:1], 11: "是".encode()[1:]}  # fmt: skip
PROMPT = [0, 1, 2, 3, 2, 3]
GREEDY = {"prompt": PROMPT, "temperature": 0}


class ByteTokenizer:
    """A byte-level tokenizer over VOCAB, as much of one as SGLang's detokenizer uses."""

    is_fast = True

    def decode(self, ids: list[int], **_) -> str:
        return b"".join(VOCAB[i] for i in ids).decode("utf-8", "replace")

    def batch_decode(self, batch: list[list[int]], **_) -> list[str]:
        return [self.decode(ids) for ids in batch]


decode = ByteTokenizer().decode


def engine_chunks(tokenizer, prompt: list[int], out: list[int]) -> list[str]:
    """The text SGLang streams for ``out`` generated after ``prompt``, a chunk a token: its DetokenizerManager's
    decoding (the state only: no sockets, no process), given the ids as its scheduler sends them."""
    d = object.__new__(DetokenizerManager)
    d.tokenizer, d.vocab_size, d.decode_status = tokenizer, None, LimitedCapacityDict(capacity=4)
    d.disable_tokenizer_batch_decode, d.is_tool_call_parser_gpt_oss, d.tool_close_token_ids = False, False, ()
    context = prompt[-INIT_INCREMENTAL_DETOKENIZATION_OFFSET:]
    chunks = []
    for i, token in enumerate(out):
        batch = SimpleNamespace(
            rids=["r"],
            decoded_texts=[""],
            decode_ids=[context + [token] if i == 0 else [token]],
            read_offsets=[len(context)],
            finished_reasons=[{"type": "length"} if i == len(out) - 1 else None],
            no_stop_trim=[False],
            skip_special_tokens=[True],
            spaces_between_special_tokens=[True],
        )
        chunks += d._decode_batch_token_id_output(batch)
    return chunks


def events(prompt: list[int], out: list[int], chunks: list[str], chat: bool = False) -> list[str]:
    """The engine's completion chunks, the first naming the prompt's ids."""
    got = []
    for i, (token, text) in enumerate(zip(out, chunks, strict=True)):
        choice: dict = {"index": 0, "text": text, "token_ids": [token], "finish_reason": None}
        if i == 0:
            choice["prompt_token_ids"] = prompt
        got.append(json.dumps({"id": "x", "choices": [choice]}))
    return got


def text_of(event: dict) -> str:
    choice = event["choices"][0]
    return choice["delta"].get("content", "") if "delta" in choice else choice["text"]


def run(resume: Resumable, prompt: list[int], out: list[int], cut: int | None = None, tokenizer=None) -> str:
    """The client's text from the engine's chunks for ``out``, the first ``cut`` of them (None: all)."""
    chunks = events(prompt, out, engine_chunks(tokenizer or ByteTokenizer(), prompt, out))[:cut]
    return "".join(text_of(resume.event(e)[0]) for e in chunks)


def resumable(body: dict, max_tokens: int, **kw) -> Resumable:
    return Resumable(body, max_tokens, prompt_ids=body["prompt"], decode=decode, **kw)


def test_the_detokenization_context_is_sglangs():
    assert DETOKENIZE_CONTEXT == INIT_INCREMENTAL_DETOKENIZATION_OFFSET


OUT = [2, 4, 6, 7, 8, 5, 7, 8, 9, 10, 11, 3]  # " the caf" é " and" " caf" é " and" 好很是 " cat"


@pytest.mark.parametrize("cut", range(1, len(OUT)))
def test_a_continuation_gives_the_client_the_uninterrupted_text_wherever_the_engine_died(cut):
    resume = resumable(GREEDY, len(OUT))
    before = run(resume, PROMPT, OUT, cut)
    cont = resume.continuation()
    kept = cont["prompt"][len(PROMPT) :]
    assert cont["prompt"] == PROMPT + OUT[: len(kept)] and cont["max_tokens"] == len(OUT) - len(kept)
    assert before + run(resume, cont["prompt"], OUT[len(kept) :]) == decode(OUT)


def test_the_continuation_starts_before_a_held_back_character_and_drops_the_words_the_client_has():
    out = [
        2,
        5,
        7,
        8,
    ]  # " the caf\xc3": SGLang sends " the " and holds back "caf" with the character's first byte
    resume = resumable(GREEDY, 4)
    assert run(resume, PROMPT, out, 2) == " the ", "the words before the incomplete character"
    assert resume.continuation()["prompt"] == PROMPT + [2], "the token with the character's first byte again"
    assert resume.seen == " "
    assert run(resume, PROMPT + [2], [5, 7, 8]) == "café and"


def test_cjk_characters_sent_early_are_not_sent_again():
    out = [2, 9, 10, 11, 3]
    resume = resumable(GREEDY, 5)
    before = run(resume, PROMPT, out, 3)
    assert before == " the好很", "SGLang sends a CJK character before an incomplete one"
    cont = resume.continuation()
    assert cont["prompt"] == PROMPT + [2, 9] and resume.seen == "很"
    assert before + run(resume, cont["prompt"], out[2:]) == decode(out)


def test_a_sampled_continuation_that_differs_from_the_words_the_client_has_follows_them():
    resume = resumable({"prompt": PROMPT}, 5)
    assert run(resume, PROMPT, [2, 9, 10, 11, 3], 3) == " the好很"
    cont = resume.continuation()
    assert run(resume, cont["prompt"], [3, 8]) == " cat and", "the client keeps 很, then gets the new text"


def test_a_chat_stream_gets_the_whole_text_as_deltas():
    out = [2, 5, 7, 8]
    resume = resumable(GREEDY, 4, chat=True)
    chunks = events(PROMPT, out, engine_chunks(ByteTokenizer(), PROMPT, out))[:2]
    first = [resume.event(e)[0] for e in chunks]
    assert first[0]["choices"][0]["delta"]["role"] == "assistant"
    cont = resume.continuation()
    rest = out[len(cont["prompt"]) - len(PROMPT) :]
    again = [resume.event(e)[0] for e in events(cont["prompt"], rest, engine_chunks(ByteTokenizer(), cont["prompt"], rest))]  # fmt: skip
    assert all(e["object"] == "chat.completion.chunk" for e in first + again)
    assert "".join(text_of(e) for e in first + again) == decode(out)


def test_a_second_failure_before_the_words_were_regenerated_still_gives_the_whole_text():
    out = [2, 5, 7, 8, 3]
    resume = resumable(GREEDY, 5)
    before = run(resume, PROMPT, out, 2)  # " the " of " the caf\xc3"
    cont = resume.continuation()
    assert resume.seen == " "
    before += run(resume, cont["prompt"], out[1:], 1)  # dies again after " caf\xc3": nothing new to show
    cont = resume.continuation()
    assert cont["prompt"] == PROMPT + [2] and resume.seen == " "
    assert before + run(resume, cont["prompt"], out[1:]) == decode(out)


def test_without_a_decoder_or_held_back_text_every_streamed_id_is_kept():
    out = [2, 4, 6, 7, 8]
    blind = Resumable(GREEDY, 5, prompt_ids=PROMPT)
    run(blind, PROMPT, out, 3)
    assert blind.continuation()["prompt"] == PROMPT + out[:3] and blind.shown == [], (
        "no text kept without one"
    )
    clean = resumable(GREEDY, 5)
    run(clean, PROMPT, out, 2)
    assert clean.continuation()["prompt"] == PROMPT + out[:2] and clean.seen == ""


def test_a_decoder_that_does_not_make_the_clients_text_keeps_every_id():
    assert shown_whole(decode, [], [2, 3], "something else") == (2, "")
    assert shown_whole(decode, [], [2, 3], " the dog") == (2, ""), "the window's text is not the client's"


def test_no_whole_text_among_the_last_ids_keeps_every_id():
    ids = [2] + [6] * (HELD_BACK_MAX + 2)  # lone first bytes: the text ends incomplete wherever it is cut
    shown = decode(ids[:1])
    assert shown_whole(decode, [], ids, shown) == (len(ids), "")


def test_the_served_models_tokenizer_finds_the_held_back_byte(tiny_model):
    """The tiny model's byte-level tokenizer, SGLang's loading of it on the engine side and the gateway's on its
    own: an engine that died after the first byte of "é" is continued from the token before it."""
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    from gateway.tokens import PromptCounter

    gateway, engine = PromptCounter(str(tiny_model)), get_tokenizer(str(tiny_model))
    out = gateway.ids(" the cat said café and left", special=False)
    prompt = gateway.ids("<|user|>hi<|end|><|assistant|>", special=False)
    at = next(i for i, t in enumerate(out) if gateway.decode([t]) == "\ufffd") + 1  # the first byte streamed
    resume = Resumable({"prompt": prompt}, len(out), prompt_ids=prompt, decode=gateway.decode)
    before = run(resume, prompt, out, at, engine)
    cont = resume.continuation()
    assert cont["prompt"] == prompt + out[: at - 1]
    assert before + run(resume, cont["prompt"], out[at - 1 :], tokenizer=engine) == engine.decode(out)
