"""SGLang's fields beyond OpenAI's in the engines' answers, removed on the OpenAI endpoints (unless the gateway runs
with ``--raw-engine-fields``) so that every answer and stream chunk is exactly OpenAI's shape:

- top level: ``metadata`` (SGLang's ``weight_version``; OpenAI's ``metadata`` is the request's string map),
  ``sglext``;
- per choice: ``matched_stop``, ``hidden_states``, ``token_ids``, ``prompt_token_ids``, ``response_token_ids``,
  ``meta_info``;
- a message's or delta's ``reasoning_content`` when it is null (a reasoning model's text is kept: clients that
  know the field read it);
- ``usage.reasoning_tokens`` moves to ``usage.completion_tokens_details.reasoning_tokens`` (dropped when 0);
- an engine's error body (``{"object": "error", "message", "type", "param", "code": 400}``) becomes OpenAI's
  ``{"error": {"message", "type", "param", "code"}}``.

A stream chunk is decoded by the relay anyway (to look for an engine's abort, or to follow a resumable stream's
token ids); cleaning it is a few dict operations, and an encode of the small chunk when it had SGLang's fields
(docs/openai.md measures it: under a microsecond per chunk).
"""

from __future__ import annotations

import ast
import re
from typing import Any

import msgspec

from flying.messages import split_engine_rid
from flying.sources import without_sources

TOP = ("metadata", "sglext")
CHOICE = ("matched_stop", "hidden_states", "token_ids", "prompt_token_ids", "response_token_ids", "meta_info")
_NONE = object()
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def clean(doc: Any, request_id: str | None = None, tier: str | None = None) -> Any:
    """``doc`` (a decoded response or chunk) without SGLang's fields and with the request's id (``request_id``,
    the one ``X-Request-Id`` echoes; else the one its engine answered under) and, given one, the ``service_tier``
    it was served at, changed in place; returned."""
    strip(doc)
    if isinstance(doc, dict) and "id" in doc:
        doc["id"] = request_id if request_id is not None else public_id(doc["id"])
        if tier is not None:
            doc["service_tier"] = tier
    return doc


def public_id(value: Any) -> Any:
    """An answer's id as the client gets it: SGLang names an answer after the rid it ran under,
    ``<id>~<attempt>`` (flying.messages.engine_rid); the client gets the request's id, whichever attempt
    answered."""
    return split_engine_rid(value)[0] if isinstance(value, str) else value


def strip(doc: Any) -> bool:
    """Remove SGLang's fields from ``doc`` in place; whether there were any."""
    if not isinstance(doc, dict):
        return False
    changed = False
    for key in TOP:
        changed |= doc.pop(key, _NONE) is not _NONE
    for choice in doc.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        for key in CHOICE:
            changed |= choice.pop(key, _NONE) is not _NONE
        for part in ("message", "delta"):
            msg = choice.get(part)
            if isinstance(msg, dict) and "reasoning_content" in msg and msg["reasoning_content"] is None:
                del msg["reasoning_content"]
                changed = True
    usage = doc.get("usage")
    if isinstance(usage, dict) and "reasoning_tokens" in usage:
        reasoning = usage.pop("reasoning_tokens")
        if reasoning and not isinstance(usage.get("completion_tokens_details"), dict):
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        changed = True
    return changed


class StreamId:
    """The one id every chunk of a stream carries, as OpenAI's do: the request's, or else its first chunk's
    (SGLang streams each of ``n`` choices under an id of its own); and the ``service_tier`` a chat stream's chunks
    carry (None: none)."""

    __slots__ = ("tier", "value")

    def __init__(self, value: str | None = None, tier: str | None = None) -> None:
        # the request's id when known (SGLang names n > 1 choices' chunks its own way)
        self.value: Any = value
        self.tier = tier

    def apply(self, event: Any) -> None:
        """Give ``event`` the stream's id (the first non-empty one seen is the stream's, as :func:`public_id`)
        and its tier."""
        if isinstance(event, dict) and "id" in event:
            if not self.value:
                self.value = public_id(event["id"])
            event["id"] = self.value
            if self.tier is not None:
                event["service_tier"] = self.tier


def clean_sse(line: str, stream_id: StreamId | None = None) -> tuple[bytes, Any]:
    """An engine's SSE ``data:`` line as the client gets it (with its blank line), cleaned (and carrying
    ``stream_id``'s id), and its decoded event (None if it is not JSON: then it goes as it came)."""
    try:
        event = _decode(line[5:])
    except msgspec.DecodeError:
        return (line + "\n\n").encode(), None
    if stream_id is not None:
        stream_id.apply(event)
    return b"data: " + _encode(clean(event)) + b"\n\n", event


def openai_error(raw: bytes) -> bytes:
    """An engine's error body in OpenAI's shape (the same bytes when it is not SGLang's error object)."""
    try:
        doc = _decode(raw)
    except msgspec.DecodeError:
        return raw
    error = openai_error_doc(doc)
    return raw if error is None else _encode(error)


OPENAI_ERROR_TYPES = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "rate_limit_error",
        "server_error",
    }
)


def openai_error_doc(doc: Any) -> dict | None:
    """SGLang's error object (``{"object": "error", "message", "type", "param", "code": 400}``) as OpenAI's
    ``{"error": {...}}``, its message in words (:func:`readable_message`); None when ``doc`` is not one."""
    if not isinstance(doc, dict) or doc.get("object") != "error" or "message" not in doc:
        return None
    code = doc.get("code")
    kind = doc.get("type")
    if kind not in OPENAI_ERROR_TYPES:  # SGLang's own (a Python exception's name: BadRequestError, ...)
        kind = "server_error" if isinstance(code, int) and code >= 500 else "invalid_request_error"
    message, param = readable_message(str(doc["message"]))
    error = {
        "message": message,
        "type": kind,
        "param": doc.get("param") or param,
        "code": code if isinstance(code, str) else None,
    }
    return {"error": error}


def stream_error(line: str) -> dict | None:
    """The SGLang error object an SSE line carries (``data: {"error": {"object": "error", ...}}`` as SGLang
    streams it), None when it carries none: a stream that starts with one is answered as an error instead."""
    if not line.startswith("data:") or '"error"' not in line:
        return None
    try:
        doc = _decode(line[5:].strip())
    except msgspec.DecodeError:
        return None
    inner = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(inner, dict) and "message" in inner:
        return {**inner, "object": "error"}
    return doc if isinstance(doc, dict) and doc.get("object") == "error" else None


def error_status(doc: dict) -> int:
    """The HTTP status an SGLang error object names (its ``code``), 400 when it names none."""
    code = doc.get("code")
    return code if isinstance(code, int) and 400 <= code <= 599 else 400


_PYDANTIC_ITEM = re.compile(r"^\s*(\{'type': .*\})\s*$", re.MULTILINE)
# SGLang's regex grammar errors ("Failed to compile regex grammar: ...") come from the regex field alone (JSON
# and EBNF grammars may come from response_format, json_schema or the tools: no param is named for them)
_REGEX_GRAMMAR = re.compile(r"Failed to compile regex grammar")


# SGLang's sampling-parameter checks begin with the field's name, some of them internal ones: the client's names
_INTERNAL_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}
_SAMPLING_CHECK = re.compile(
    r"^(temperature|top_p|top_k|min_p|frequency_penalty|presence_penalty|repetition_penalty|logit_bias|"
    r"max_new_tokens|min_new_tokens|sampling_seed) must "
)
_INTERNAL = re.compile(r"\b(" + "|".join(_INTERNAL_NAMES) + r")\b")


def _client_names(text: str) -> tuple[str, str | None]:
    """A sampling-parameter check's message in the client's names, and the parameter it names (None: not one)."""
    m = _SAMPLING_CHECK.match(text)
    param = _INTERNAL_NAMES.get(m.group(1), m.group(1)) if m else None
    return _INTERNAL.sub(lambda x: _INTERNAL_NAMES[x.group(1)], text), param


def readable_message(message: str) -> tuple[str, str | None]:
    """An engine's error message without its server's file paths and, for a validation error of SGLang's request
    models (pydantic's error dicts, one a line), each as ``<param>: <what>``; with the first error's param."""
    lines = [
        x for x in message.splitlines() if not x.strip().startswith(('File "', "For further information"))
    ]
    text = "\n".join(lines).strip()
    found: list[tuple[str, str]] = []
    for m in _PYDANTIC_ITEM.finditer(text):
        try:
            item = ast.literal_eval(m.group(1))
        except (ValueError, SyntaxError):
            continue
        if isinstance(item, dict) and isinstance(item.get("loc"), tuple):
            found.append((_param(item["loc"]), str(item.get("msg", ""))))
    if not found:
        text, param = _client_names(without_sources(re.sub(r"\n\s*\n", "\n", text)))
        return text, "regex" if _REGEX_GRAMMAR.search(text) else param
    said = "; ".join(f"{param}: {msg}" if param else msg for param, msg in found[:3])
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return f"invalid request: {said}{more}", found[0][0] or None


def _param(loc: tuple) -> str:
    """pydantic's location as a parameter path: ``('body', 'tools', 0, 'function')`` -> ``tools[0].function``
    (its union members' class names, such as ``ResponseFormat``, left out)."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and not (part[:1].isupper() and part.isidentifier()):
            out += f".{part}" if out else part
    return out
