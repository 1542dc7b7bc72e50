"""The open-loop driver: requests leave on schedule whatever the server does; the client's own lateness is
recorded per request (dispatch lag) and warned about, never hidden (no coordinated omission)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import httpx

from loadgen.client import send
from loadgen.metrics import RequestRecord
from loadgen.workload import PlannedRequest

log = logging.getLogger("loadgen")


def payload(req: PlannedRequest, model: str, api: str) -> dict:
    body = {
        "model": model,
        "max_tokens": req.max_tokens,
        "stream": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if api == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


async def run(
    base_url: str,
    model: str,
    requests: Sequence[PlannedRequest],
    api: str = "chat",
    timeout_s: float = 300,
    max_concurrency: int | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send ``requests`` on their schedule; return (records, wall duration in s)."""
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    records = [RequestRecord(index=i, priority=r.priority, scheduled_at=r.at) for i, r in enumerate(requests)]
    async with httpx.AsyncClient(base_url=base_url, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(req: PlannedRequest, rec: RequestRecord) -> None:
            if gate:
                async with gate:
                    await send(
                        client,
                        path,
                        payload(req, model, api),
                        {"X-Priority": req.priority},
                        rec,
                        t0,
                        timeout_s,
                    )
            else:
                await send(
                    client, path, payload(req, model, api), {"X-Priority": req.priority}, rec, t0, timeout_s
                )
            if on_done:
                on_done(rec)

        tasks = []
        warned = False
        for req, rec in zip(requests, records):
            delay = req.at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            elif -delay > 0.05 and not warned:
                log.warning(
                    "loadgen is %.0f ms behind schedule; results include its dispatch lag", -delay * 1000
                )
                warned = True
            tasks.append(asyncio.create_task(one(req, rec)))
        await asyncio.gather(*tasks)
        return records, time.perf_counter() - t0
