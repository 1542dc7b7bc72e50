"""Sending one streaming request and recording its events (no metric math here)."""

from __future__ import annotations

import json
import time

import httpx

from loadgen.metrics import RequestRecord


async def send(
    client: httpx.AsyncClient,
    url: str,
    payload: dict,
    headers: dict,
    rec: RequestRecord,
    clock0: float,
    timeout_s: float,
) -> RequestRecord:
    """POST a streaming request; fill ``rec`` with times relative to ``clock0``. Never raises."""
    rec.sent_at = time.perf_counter() - clock0
    try:
        async with client.stream("POST", url, json=payload, headers=headers, timeout=timeout_s) as resp:
            rec.status = resp.status_code
            if (q := resp.headers.get("x-queue-time-ms")) is not None:
                rec.queue_ms = float(q)
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {body[:200]}"
                return rec
            chunks = 0
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                now = time.perf_counter() - clock0
                event = json.loads(line[5:])
                if "error" in event:
                    rec.error = f"stream error: {event['error'].get('message', '')[:200]}"
                    return rec
                if event.get("choices"):
                    rec.event_times.append(now)
                    chunks += 1
                if usage := event.get("usage"):
                    rec.output_tokens = usage.get("completion_tokens", 0)
                    rec.prompt_tokens = usage.get("prompt_tokens", 0)
            if rec.output_tokens == 0 and chunks:
                rec.output_tokens, rec.tokens_from_usage = chunks, False
    except httpx.TimeoutException as exc:
        rec.error = f"timeout: {exc!r}"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"transport: {exc!r}"
    return rec
