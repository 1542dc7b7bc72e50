"""Sending one streaming request and recording its events (no metric math here).

An event counts when it carries output: text in ``choices`` (chat ``delta.content`` / ``reasoning_content``,
completions ``text``) or, with per-chunk usage, new completion tokens. Role-only and usage-only chunks do not.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from loadgen.metrics import RequestRecord


def _carries_text(choice: dict) -> bool:
    delta = choice.get("delta")
    if delta is not None:
        return bool(delta.get("content") or delta.get("reasoning_content"))
    return bool(choice.get("text"))


def _text(choice: dict) -> str:
    delta = choice.get("delta")
    return (delta.get("content") or "") if delta is not None else (choice.get("text") or "")


def _cached_tokens(usage: dict) -> int | None:
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) else None


async def send(
    client: httpx.AsyncClient,
    url: str,
    payload: dict,
    headers: dict,
    rec: RequestRecord,
    clock0: float,
    timeout_s: float,
    answer: list[str] | None = None,
) -> RequestRecord:
    """POST a streaming request; fill ``rec`` with times relative to ``clock0`` (``ended_at``: when it ended,
    whether it succeeded or failed). ``timeout_s`` bounds the whole request (a server trickling tokens forever times
    out too). The output text goes to ``answer`` when given. Never raises."""
    rec.sent_at = time.perf_counter() - clock0
    try:
        return await _stream(client, url, payload, headers, rec, clock0, timeout_s, answer)
    finally:
        rec.ended_at = time.perf_counter() - clock0


async def _stream(
    client: httpx.AsyncClient,
    url: str,
    payload: dict,
    headers: dict,
    rec: RequestRecord,
    clock0: float,
    timeout_s: float,
    answer: list[str] | None,
) -> RequestRecord:
    seen = 0  # completion tokens reported so far (per-chunk usage)
    per_chunk_usage = True
    try:
        async with (
            asyncio.timeout(timeout_s),
            client.stream("POST", url, json=payload, headers=headers) as resp,
        ):
            rec.status = resp.status_code
            if (q := resp.headers.get("x-queue-time-ms")) is not None:
                rec.queue_ms = float(q)
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {body[:200]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - clock0
                event = json.loads(data)
                if "error" in event:
                    rec.error = f"stream error: {str(event['error'].get('message', ''))[:200]}"
                    return rec
                usage = event.get("usage")
                choices = event.get("choices") or []
                new = 0
                if usage:
                    rec.output_tokens = usage.get("completion_tokens") or 0
                    rec.prompt_tokens = usage.get("prompt_tokens") or 0
                    rec.cached_tokens = _cached_tokens(usage)
                    new, seen = rec.output_tokens - seen, rec.output_tokens
                text = bool(choices) and _carries_text(choices[0])
                if text and answer is not None:
                    answer.append(_text(choices[0]))
                if text and not usage:
                    per_chunk_usage = False
                if text or (choices and new > 0):
                    rec.event_times.append(now)
                    rec.event_tokens.append(new)
            if not per_chunk_usage or sum(rec.event_tokens) != rec.output_tokens:
                rec.event_tokens = []  # per-event token counts unknown: metrics fall back to events
            if rec.output_tokens == 0 and rec.event_times:
                rec.output_tokens, rec.tokens_from_usage = len(rec.event_times), False
    except (TimeoutError, httpx.TimeoutException):
        rec.error = f"timeout: no complete response within {timeout_s:g} s"
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        rec.error = f"transport: {exc!r}"
    return rec
