"""A stream that survives its engine. The gateway forwards a streaming request as a token-id completion
(``return_token_ids``): it knows the prompt's ids (the chat template applied by its own tokenizer, or the
engine's first chunk) and collects the ids of every token streamed. If the engine dies mid-way, the rest is asked
of another engine with the prompt plus the streamed ids as its input and the remaining ``max_tokens``, so the
client sees one unbroken stream, and greedy output is identical to an uninterrupted run.

SGLang's detokenizer holds back the text of tokens that end in an incomplete UTF-8 character (meanwhile it sends
only the whole words, or CJK characters, before it), so the ids streamed may run ahead of the text the client has;
a continuation after them would never send that text. A continuation therefore starts after the last token whose
text the client has whole (found with the gateway's tokenizer), and the engine regenerates the held-back tokens;
the part of their text the client already has (those words) is dropped from the continuation's chunks. Greedy,
the regenerated text is the same; sampled, it may differ from those words: the client keeps them and gets the
rest of the new text.

A chat request travels as a completion of its templated prompt; its chunks are turned back into
``chat.completion.chunk`` events here (content deltas, the role first, the finish reason, usage with SGLang's
``prompt_tokens_details.cached_tokens``), under one id for the whole stream. Chat requests that ask for log-probabilities keep SGLang's chat endpoint (and are not resumed).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from gateway.api.engine_fields import StreamId

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()

# prompt ids SGLang decodes a request's output after (INIT_INCREMENTAL_DETOKENIZATION_OFFSET)
DETOKENIZE_CONTEXT = 5
# ids at the end a continuation may start before: more than one character's bytes and a few words
HELD_BACK_MAX = 16
SHOWN_PIECES = 1024  # chunks' texts kept apart before they are joined into one
Decode = Callable[[list[int]], str]  # token ids to text, as the engine's detokenizer makes it


@dataclass
class Resumable:
    """One streaming request's progress: what is needed to continue it elsewhere."""

    body: dict  # the completion body sent upstream (prompt as ids once known)
    max_tokens: int
    chat: bool = False  # the client speaks chat: convert the chunks
    prompt_ids: list[int] | None = None  # None until the engine's first chunk says (a text prompt)
    generated: list[int] = field(default_factory=list)
    resumed: int = 0  # tokens generated before the current attempt
    stream_id: StreamId = field(default_factory=StreamId)  # every event carries the first attempt's id
    role_sent: bool = False
    decode: Decode | None = None  # None: a continuation starts after every id streamed
    shown: list[str] = field(default_factory=list)  # the text the client got, by chunk (kept with a decoder)
    seen: str = ""  # text the client has that the current attempt regenerates: dropped from its chunks

    def event(self, data: bytes | str) -> tuple[dict, bytes | None]:
        """Parse one engine event, record its ids, and return it with the bytes the client gets (None: none)."""
        event = _decoder.decode(data)
        if not isinstance(event, dict) or "error" in event:
            return event, data.encode() if isinstance(data, str) else data
        self.stream_id.apply(event)
        for choice in event.get("choices") or ():
            prompt = choice.pop("prompt_token_ids", None)
            if prompt and self.prompt_ids is None:
                self.prompt_ids = list(prompt)
            self.generated.extend(choice.pop("token_ids", None) or ())
            if self.decode is not None and (text := choice.get("text")):
                if self.seen:
                    choice["text"] = text = self._unseen(text)
                self.shown.append(text)
                if len(self.shown) > SHOWN_PIECES:
                    self.shown[:] = ["".join(self.shown)]
        if self.resumed and isinstance(usage := event.get("usage"), dict):
            self._usage_of_whole(usage)
        if self.chat:
            event = self._as_chat(event)
        return event, _encoder.encode(event)

    def _usage_of_whole(self, usage: dict) -> None:
        """A continuation's usage as the client's request's: the ids streamed before it move from the prompt to
        the completion; the cached tokens are the part of the client's prompt the finishing engine found in its
        prefix cache (its hit on the streamed ids is not a prompt token of the client's)."""
        usage["prompt_tokens"] = usage.get("prompt_tokens", 0) - self.resumed
        usage["completion_tokens"] = usage.get("completion_tokens", 0) + self.resumed
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            details["cached_tokens"] = min(details["cached_tokens"], usage["prompt_tokens"])

    def _as_chat(self, event: dict) -> dict:
        choices = []
        for c in event.get("choices") or ():
            delta: dict = {}
            if not self.role_sent:
                delta["role"], self.role_sent = "assistant", True
            if c.get("text"):
                delta["content"] = c["text"]
            choice = {
                "index": c.get("index", 0),
                "delta": delta,
                "logprobs": None,
                "finish_reason": c.get("finish_reason"),
            }
            if c.get("matched_stop") is not None:
                choice["matched_stop"] = c["matched_stop"]
            choices.append(choice)
        return event | {"object": "chat.completion.chunk", "choices": choices}

    def _unseen(self, text: str) -> str:
        """``text`` without what the client already has (``seen``, its start); a continuation that differs
        from it (sampled) ends the dropping."""
        k = len(os.path.commonprefix([text, self.seen]))
        self.seen = self.seen[k:] if k == len(text) else ""
        return text[k:]

    def remaining(self) -> int:
        return self.max_tokens - len(self.generated)

    def continuation(self) -> dict:
        """The body that asks another engine for the rest: prompt + streamed ids in, the remaining tokens out."""
        assert self.prompt_ids is not None, "the prompt's ids are known once a token was streamed"
        if self.decode is not None:
            context = self.prompt_ids[-DETOKENIZE_CONTEXT:]
            whole, self.seen = shown_whole(self.decode, context, self.generated, "".join(self.shown))
            del self.generated[whole:]
        self.resumed = len(self.generated)
        return self.body | {"prompt": self.prompt_ids + self.generated, "max_tokens": self.remaining()}


def shown_whole(decode: Decode, context: list[int], ids: list[int], shown: str) -> tuple[int, str]:
    """How many of ``ids`` (decoded after ``context``) the client has the whole text of (``shown``), and the text
    it has beyond theirs (words of held-back tokens). Looked for among the last ``HELD_BACK_MAX`` ids, decoded
    after the ids before them (as SGLang decodes); all of them, and no text, when the decoder does not make the
    client's text or no such point is there."""
    start = max(0, len(ids) - HELD_BACK_MAX)
    head = decode(context + ids[:start])[len(decode(context)) :]  # the text of the ids before the window
    if not shown.startswith(head):
        return len(ids), ""
    rest, window = shown[len(head) :], (context + ids[:start])[-DETOKENIZE_CONTEXT:]
    before = len(decode(window))
    if not decode(window + ids[start:])[before:].startswith(rest):
        return len(ids), ""
    for n in range(len(ids), start - 1, -1):
        text = decode(window + ids[start:n])[before:]
        if not text.endswith("\ufffd") and rest.startswith(text):
            return n, rest[len(text) :]
    return len(ids), ""


def upstream_body(body: dict, chat: bool, prompt_ids: list[int] | None) -> dict:
    """The completion body a streaming request is forwarded as: chat fields folded into a token-id prompt."""
    out = {k: v for k, v in body.items() if k not in ("messages", "logprobs", "top_logprobs")}
    if chat:
        assert prompt_ids is not None
        out["prompt"] = prompt_ids
    return out | {"return_token_ids": True}
