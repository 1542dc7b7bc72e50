"""OpenAI's Responses API (``POST /v1/responses``) for text, stateless: a request is translated to a chat
completion (:func:`to_chat`) that goes through the same queue, priorities and engines as any other, and the chat
answer is translated back: one ``Response`` object (:func:`response`), or the Responses API's event stream
(:func:`events`: ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, then ``response.completed``, or
``response.incomplete`` when ``max_output_tokens`` cut the answer short).

Nothing is stored: ``store`` is accepted and changes nothing, ``previous_response_id`` and
``conversation`` are refused, as are tools and non-text input. ``text.format`` maps to the chat's
``response_format`` (JSON mode, a JSON schema).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Literal

import msgspec

from gateway.api.errors import APIError, InvalidRequest
from gateway.api.schemas import (
    ChatCompletionRequest,
    Message,
    ServiceTier,
    StreamOptions,
    check_chat,
    check_metadata,
    decode_struct,
)

REFUSED = {
    "previous_response_id": "responses are not stored: send the whole conversation as input",
    "conversation": "conversations are not stored: send the whole conversation as input",
    "background": "background responses are not served",
    "prompt": "prompt templates are not served",
    "top_logprobs": "log-probabilities are not returned on /v1/responses (use /v1/chat/completions)",
}
ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    model: str
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    priority: str | None = None  # flying-serving extension; the X-Priority header wins
    service_tier: ServiceTier | None = None
    # accepted, change nothing here
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    max_tool_calls: int | None = None  # no tools are served: none is ever called
    parallel_tool_calls: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    reasoning: Any = None
    stream_options: Any = None
    # accepted only as what changes nothing
    tools: list[Any] | None = None
    tool_choice: Any = None
    text: Any = None
    background: bool | None = None
    # refused unless null (REFUSED says why)
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None  # (0 asks for none: accepted)


def decode(body: bytes) -> ResponsesRequest:
    """Parse and check a Responses API body (InvalidRequest naming what is wrong)."""
    req = decode_struct(body, ResponsesRequest, REFUSED)
    assert isinstance(req, ResponsesRequest)
    if req.tools:
        raise InvalidRequest("tools are not served on /v1/responses", param="tools")
    for name, why in REFUSED.items():
        if getattr(req, name):
            raise InvalidRequest(f"{name} is not supported here: {why}", param=name)
    response_format(req)  # (checks text.format)
    check_metadata(req.metadata)
    return req


def text_format(req: ResponsesRequest) -> dict:
    """``text.format`` as given (``{"type": "text"}`` when not)."""
    fmt = req.text.get("format") if isinstance(req.text, dict) else None
    return fmt if isinstance(fmt, dict) else {"type": "text"}


def response_format(req: ResponsesRequest) -> dict | None:
    """``text.format`` as the chat's ``response_format``: none for text, JSON mode, or a JSON schema (SGLang
    constrains the output to it)."""
    fmt = text_format(req)
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidRequest(
        "text.format must be text, json_object, or json_schema with a schema", param="text.format"
    )


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion that answers ``req`` (checked like any chat request)."""
    messages = [Message(role="system", content=req.instructions)] if req.instructions else []
    messages += _messages(req.input)
    chat = ChatCompletionRequest(
        model=req.model,
        messages=messages,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stream=req.stream,
        stream_options=StreamOptions(include_usage=True) if req.stream else None,
        user=req.user,
        priority=req.priority,
        service_tier=req.service_tier,
        prompt_cache_key=req.prompt_cache_key,
        response_format=response_format(req),
    )
    try:
        check_chat(chat)
    except InvalidRequest as exc:
        raise in_client_terms(exc) from None
    return chat


# the chat's parameter -> the client's
CLIENT_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
}


def in_client_terms(exc: APIError) -> APIError:
    """``exc`` (raised for the chat completion that answers a Responses request) with the client's parameter
    names in its message and ``param``."""
    message = exc.message
    for chat_name, name in CLIENT_NAMES.items():
        message = message.replace(chat_name, name)
    renamed = type(exc)(message, param=CLIENT_NAMES.get(exc.param or "", exc.param), code=exc.code)
    renamed.retry_after_s = exc.retry_after_s
    return renamed


def _messages(items: str | list[Any]) -> list[Message]:
    if isinstance(items, str):
        return [Message(role="user", content=items)]
    if not items:
        raise InvalidRequest("input must not be empty", param="input")
    return [_message(item, f"input[{i}]") for i, item in enumerate(items)]


def _message(item: Any, param: str) -> Message:
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        kind = item.get("type") if isinstance(item, dict) else type(item).__name__
        raise InvalidRequest(f"{param}: only message items with text are served, got {kind!r}", param=param)
    role = item.get("role")
    if role not in ROLES:
        raise InvalidRequest(
            f"{param}.role must be one of {', '.join(ROLES)}; got {role!r}", param=f"{param}.role"
        )
    content = item.get("content")
    if isinstance(content, str):
        return Message(role=role, content=content)
    if not isinstance(content, list):
        raise InvalidRequest(
            f"{param}.content must be a string or a list of text parts", param=f"{param}.content"
        )
    texts = []
    for j, part in enumerate(content):
        where = f"{param}.content[{j}]"
        if (
            not isinstance(part, dict)
            or part.get("type") not in TEXT_PARTS
            or not isinstance(part.get("text"), str)
        ):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequest(f"{where}: only text parts are served, got {kind!r}", param=where)
        texts.append(part["text"])
    return Message(role=role, content="".join(texts))


# -- answers -------------------------------------------------------------------------------------------------------
class Draft:
    """What a response says about itself, apart from its output: ids, the request's echoed settings."""

    def __init__(self, req: ResponsesRequest, tier: str | None = None) -> None:
        self.req = req
        self.tier = tier  # the service_tier it is served at (schemas.answer_tier)
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())  # seconds, an integer as OpenAI's

    def response(
        self, status: str, output: list[dict], usage: dict | None, finish: str | None = None
    ) -> dict:
        req = self.req
        incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": req.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tool_choice": "auto",
            "tools": [],
            "metadata": req.metadata or {},
            "text": {"format": text_format(req)},
            "truncation": req.truncation or "disabled",
            "usage": usage,
            "service_tier": self.tier,
        }

    def message(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [output_text(text)]
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage_of(chat_usage: Any) -> dict | None:
    """A chat completion's usage in the Responses API's terms."""
    if not isinstance(chat_usage, dict):
        return None
    details = chat_usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": int(chat_usage.get("prompt_tokens") or 0),
        # cache_write_tokens: required by OpenAI's current Responses usage (openai 3.x); SGLang reports no writes
        "input_tokens_details": {"cached_tokens": int(cached or 0), "cache_write_tokens": 0},
        "output_tokens": int(chat_usage.get("completion_tokens") or 0),
        "output_tokens_details": {"reasoning_tokens": int(reasoning)},
        "total_tokens": int(chat_usage.get("total_tokens") or 0),
    }


def response(draft: Draft, chat: dict) -> dict:
    """A (non-streaming) chat completion as a Response object."""
    choice = (chat.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content") or ""
    finish = choice.get("finish_reason")
    status = "incomplete" if finish == "length" else "completed"  # the message item's too, as OpenAI marks it
    return draft.response(status, [draft.message(text, status)], usage_of(chat.get("usage")), finish)


_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


async def events(draft: Draft, chat_stream: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
    """A chat completion's SSE stream (as the relay gives it) as the Responses API's events. The chat stream is
    started before the first event is sent (its own cleanup lives in it) and closed with this one."""
    seq = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        seq += 1
        return (
            b"event: "
            + kind.encode()
            + b"\ndata: "
            + _encode({"type": kind, "sequence_number": seq - 1, **fields})
            + b"\n\n"
        )

    where = {"item_id": draft.item_id, "output_index": 0, "content_index": 0}
    text: list[str] = []
    usage, finish, error = None, None, None
    try:
        first = await anext(aiter(chat_stream), b"")
        out = [
            event("response.created", response=draft.response("in_progress", [], None)),
            event("response.in_progress", response=draft.response("in_progress", [], None)),
            event("response.output_item.added", output_index=0, item=draft.message(None, "in_progress")),
            event("response.content_part.added", **where, part=output_text("")),
        ]
        chunk = first
        while True:
            for doc in _chat_events(chunk):
                if "error" in doc:
                    error = doc["error"] if isinstance(doc["error"], dict) else {"message": str(doc["error"])}
                    continue
                if isinstance(doc.get("usage"), dict):
                    usage = doc["usage"]
                for c in doc.get("choices") or ():
                    delta = (c.get("delta") or {}).get("content")
                    if delta:
                        text.append(delta)
                        out.append(event("response.output_text.delta", **where, delta=delta, logprobs=[]))
                    finish = c.get("finish_reason") or finish
            if out:
                yield b"".join(out)
                out = []
            chunk = await anext(aiter(chat_stream), b"")
            if not chunk:
                break
        if error is not None:
            # (the Responses API's error event has a string code; SGLang's is its status)
            code = error.get("code")
            yield event(
                "error",
                code=None if code is None else str(code),
                message=str(error.get("message", "")),
                param=error.get("param"),
            )
            yield event(
                "response.failed",
                response=draft.response("failed", [], usage_of(usage))
                | {"error": {"code": "server_error", "message": str(error.get("message", ""))}},
            )
            return
        full = "".join(text)
        status = "incomplete" if finish == "length" else "completed"
        yield b"".join(
            [
                event("response.output_text.done", **where, text=full, logprobs=[]),
                event("response.content_part.done", **where, part=output_text(full)),
                event("response.output_item.done", output_index=0, item=draft.message(full, status)),
                event(
                    f"response.{status}",
                    response=draft.response(status, [draft.message(full, status)], usage_of(usage), finish),
                ),
            ]
        )
    finally:
        aclose = getattr(chat_stream, "aclose", None)
        if aclose is not None:
            await aclose()


def _chat_events(chunk: bytes) -> list[dict]:
    out = []
    for ev in chunk.split(b"\n\n"):
        if not ev.startswith(b"data:"):
            continue
        payload = ev[5:].strip()
        if payload == b"[DONE]":
            continue
        try:
            doc = _decode(payload)
        except msgspec.DecodeError:
            continue
        if isinstance(doc, dict):
            out.append(doc)
    return out
