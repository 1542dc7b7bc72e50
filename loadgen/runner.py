"""The open-loop driver: requests leave on schedule whatever the server does; the client's own lateness is
recorded per request (dispatch lag) and warned about, never hidden (no coordinated omission). An optional
concurrency cap turns it into a bounded client; the time a request waits for the cap counts as its lag."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from loadgen.client import send
from loadgen.metrics import RequestRecord
from loadgen.workload import PlannedRequest

log = logging.getLogger("loadgen")


@dataclass(frozen=True)
class RunConfig:
    base_url: str
    model: str
    api: str = "chat"  # chat | completions
    timeout_s: float = 300.0
    max_concurrency: int | None = None
    warmup: int = 0  # requests sent one by one before the run, excluded from the results
    continuous_usage: bool = True  # ask for usage in every chunk (SGLang, vLLM) for per-token ITL
    ignore_eos: bool = True  # generate exactly max_tokens (SGLang/vLLM extension)
    lag_warn_ms: float = 50.0


def payload(req: PlannedRequest, cfg: RunConfig) -> dict:
    opts = {"include_usage": True}
    if cfg.continuous_usage:
        opts["continuous_usage_stats"] = True
    body = {
        "model": cfg.model,
        "max_tokens": req.max_tokens,
        "stream": True,
        "temperature": 0,
        "stream_options": opts,
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.api == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


async def run(
    cfg: RunConfig,
    requests: Sequence[PlannedRequest],
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send ``requests`` on their schedule; return (records, wall duration in s). Warm-up records come first,
    flagged ``warmup``; the run clock starts after them."""
    path = "/v1/chat/completions" if cfg.api == "chat" else "/v1/completions"
    gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, 30.0))
    records = [RequestRecord(index=i, priority=r.priority, scheduled_at=r.at) for i, r in enumerate(requests)]
    async with httpx.AsyncClient(base_url=cfg.base_url, limits=limits, timeout=timeout) as client:

        async def one(req: PlannedRequest, rec: RequestRecord, t0: float) -> None:
            headers = {"X-Priority": req.priority}
            if gate:
                async with gate:
                    await send(client, path, payload(req, cfg), headers, rec, t0, cfg.timeout_s)
            else:
                await send(client, path, payload(req, cfg), headers, rec, t0, cfg.timeout_s)
            if on_done:
                on_done(rec)

        warm = []
        for i in range(cfg.warmup):
            req = requests[i % len(requests)]
            rec = RequestRecord(index=-1 - i, priority=req.priority, scheduled_at=0.0, warmup=True)
            await send(
                client,
                path,
                payload(req, cfg),
                {"X-Priority": req.priority},
                rec,
                time.perf_counter(),
                cfg.timeout_s,
            )
            warm.append(rec)

        t0 = time.perf_counter()
        tasks = []
        warned = False
        for req, rec in zip(requests, records):
            delay = req.at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            elif -delay * 1000 > cfg.lag_warn_ms and not warned:
                log.warning(
                    "loadgen is %.0f ms behind schedule; its dispatch lag is in the results", -delay * 1000
                )
                warned = True
            tasks.append(asyncio.create_task(one(req, rec, t0)))
        await asyncio.gather(*tasks)
        return warm + records, time.perf_counter() - t0
