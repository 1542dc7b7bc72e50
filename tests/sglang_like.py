"""A fake engine that answers as SGLang's OpenAI server does, extra fields included (``metadata`` with
``weight_version``, ``matched_stop``, ``reasoning_content: null``, ``usage.reasoning_tokens``, ``token_ids`` and
``prompt_token_ids`` with ``return_token_ids``): what the gateway's cleaning is tested against. Every request body
it gets is in ``calls``, its W3C ``traceparent`` header (or None) in ``traceparents``. Each answer is
``max_tokens`` tokens " w<i>" (finish "length"), or 3 that end with "stop" when ``max_tokens`` is larger (or not
set); a prompt's tokens are its ids or its words."""

from __future__ import annotations

import json
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": 0}, "reasoning_tokens": 0}  # fmt: skip


def answer_id(body: dict, default: str) -> str:
    """The id SGLang answers under: the request's rid, but an id of its own for ``n`` > 1 (each choice then runs
    as a request of its own)."""
    return uuid.uuid4().hex if body.get("n", 1) > 1 else body.get("rid", default)


def prompt_len(body: dict) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content") or "").split()) for m in body["messages"]) + 3
    p = body.get("prompt")
    return len(p) if isinstance(p, list) else len(str(p).split())


class SGLangLike:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.traceparents: list[str | None] = []
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completion, methods=["POST"]),
                Route("/health", lambda r: Response("ok")),
            ]
        )

    @staticmethod
    def tokens(body: dict) -> list[str]:
        return [f" w{i}" for i in range(min(int(body.get("max_tokens") or 4), 3))]

    @staticmethod
    def finish(body: dict) -> str:
        return "length" if int(body.get("max_tokens") or 4) <= 3 else "stop"

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        self.calls.append(("/v1/chat/completions", body))
        self.traceparents.append(request.headers.get("traceparent"))
        toks, p = self.tokens(body), prompt_len(body)
        if body.get("stream"):
            return StreamingResponse(self._chat_stream(body, toks, p), media_type="text/event-stream")
        choices = [
            {"index": i, "message": {"role": "assistant", "content": "".join(toks), "reasoning_content": None,
             "tool_calls": None}, "logprobs": None, "finish_reason": self.finish(body), "matched_stop": None}
            for i in range(int(body.get("n") or 1))
        ]  # fmt: skip
        return JSONResponse({"id": answer_id(body, "c1"), "object": "chat.completion", "created": int(time.time()),
                             "model": body["model"], "choices": choices, "usage": usage(p, len(toks) * len(choices)),
                             "metadata": {"weight_version": "default"}})  # fmt: skip

    async def _chat_stream(self, body: dict, toks: list[str], p: int):
        for i, t in enumerate(toks):
            delta = {"role": "assistant" if i == 0 else None, "content": t, "reasoning_content": None, "tool_calls": None}  # fmt: skip
            last = i == len(toks) - 1
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": self.finish(body) if last else None,
                      "matched_stop": None}  # fmt: skip
            yield sse({"id": answer_id(body, "c1"), "object": "chat.completion.chunk", "created": 1, "model": body["model"],
                       "choices": [choice], "usage": None})  # fmt: skip
        if (body.get("stream_options") or {}).get("include_usage"):
            yield sse({"id": answer_id(body, "c1"), "object": "chat.completion.chunk", "created": 1, "model": body["model"],
                       "choices": [], "usage": usage(p, len(toks))})  # fmt: skip
        yield "data: [DONE]\n\n"

    async def completion(self, request: Request) -> Response:
        body = await request.json()
        self.calls.append(("/v1/completions", body))
        self.traceparents.append(request.headers.get("traceparent"))
        toks, p = self.tokens(body), prompt_len(body)
        if body.get("stream"):
            return StreamingResponse(self._completion_stream(body, toks, p), media_type="text/event-stream")
        choices = [
            {
                "index": i,
                "text": "".join(toks),
                "logprobs": None,
                "finish_reason": self.finish(body),
                "matched_stop": None,
            }
            for i in range(int(body.get("n") or 1))
        ]
        return JSONResponse({"id": answer_id(body, "t1"), "object": "text_completion", "created": int(time.time()),
                             "model": body["model"], "choices": choices, "usage": usage(p, len(toks) * len(choices)),
                             "metadata": {"weight_version": "default"}})  # fmt: skip

    async def _completion_stream(self, body: dict, toks: list[str], p: int):
        ids = body.get("return_token_ids")
        prompt = body.get("prompt")
        n = int(body.get("n") or 1)
        for i, t in enumerate(toks):
            for j in range(n):  # (SGLang streams each choice's tokens as chunks of their own)
                last = i == len(toks) - 1
                choice: dict = {"index": j, "text": t, "logprobs": None,
                                "finish_reason": self.finish(body) if last else None, "matched_stop": None}  # fmt: skip
                if ids:
                    choice["token_ids"] = [100 + i]
                    if i == 0:
                        choice["prompt_token_ids"] = prompt if isinstance(prompt, list) else list(range(p))
                yield sse({"id": answer_id(body, "t1"), "object": "text_completion", "created": 1, "model": body["model"],
                           "choices": [choice], "usage": None})  # fmt: skip
        if (body.get("stream_options") or {}).get("include_usage"):
            yield sse({"id": answer_id(body, "t1"), "object": "text_completion", "created": 1, "model": body["model"],
                       "choices": [], "usage": usage(p, len(toks) * n)})  # fmt: skip
        yield "data: [DONE]\n\n"


def sse(event: dict) -> str:
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
