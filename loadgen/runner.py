"""The open-loop driver: requests leave on schedule whatever the server does; the client's own lateness is
recorded per request (dispatch lag) and warned about, never hidden (no coordinated omission). An optional
concurrency cap turns it into a bounded client; the time a request waits for the cap counts as its lag. The turns
of a session (:class:`loadgen.workload.Sessions`) go out one after another, each when the one before it ended."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from loadgen import conversation
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
    api_key: str | None = field(default=None, repr=False)  # sent as Authorization: Bearer <key>

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"the per-request timeout must be positive, got {self.timeout_s:g} s")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(
                f"the concurrency cap must be at least 1 (None: no cap), got {self.max_concurrency}"
            )
        if self.warmup < 0:
            raise ValueError(f"warm-up requests cannot be negative, got {self.warmup}")

    def headers(self, priority: str) -> dict[str, str]:
        """A request's headers: its priority class, and the API key if there is one."""
        out = {"X-Priority": priority}
        if self.api_key:
            out["Authorization"] = f"Bearer {self.api_key}"
        return out


def payload(req: PlannedRequest, cfg: RunConfig, history: Sequence[tuple[str, str]] = ()) -> dict:
    """The request body; a session's turn carries its conversation so far (``history``: earlier (question,
    answer) pairs, see :mod:`loadgen.conversation`)."""
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
        body["messages"] = conversation.chat_messages(req, history)
    else:
        body["prompt"] = req.prompt if req.turn is None else conversation.completion_prompt(req, history)
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

        async def one(
            req: PlannedRequest,
            rec: RequestRecord,
            t0: float,
            history: Sequence[tuple[str, str]] = (),
            answer: list[str] | None = None,
        ) -> None:
            body, headers = payload(req, cfg, history), cfg.headers(req.priority)
            if gate:
                async with gate:
                    await send(client, path, body, headers, rec, t0, cfg.timeout_s, answer)
            else:
                await send(client, path, body, headers, rec, t0, cfg.timeout_s, answer)
            if on_done:
                on_done(rec)

        async def session(group: list[int], t0: float) -> None:
            """A session's turns one after another, each with the conversation so far; a failed turn ends it."""
            history: list[tuple[str, str]] = []
            for k, i in enumerate(group):
                req, rec = requests[i], records[i]
                if k:  # a later turn is due when the turn before it ended
                    rec.scheduled_at = time.perf_counter() - t0
                answer: list[str] | None = [] if len(group) > 1 else None  # what a later turn sends back
                await one(req, rec, t0, history, answer)
                if not rec.ok:
                    for j in group[k + 1 :]:
                        records[j].error = f"session: turn {k} failed"
                        if on_done:
                            on_done(records[j])
                    return
                history.append((req.prompt, "".join(answer or ())))

        warm = []
        for i in range(cfg.warmup):
            req = requests[i % len(requests)]
            rec = RequestRecord(index=-1 - i, priority=req.priority, scheduled_at=0.0, warmup=True)
            await send(
                client,
                path,
                payload(req, cfg),
                cfg.headers(req.priority),
                rec,
                time.perf_counter(),
                cfg.timeout_s,
            )
            warm.append(rec)

        t0 = time.perf_counter()
        tasks = []
        warned = False
        for group in conversation.conversation_groups(requests):
            req = requests[group[0]]
            delay = req.at - (time.perf_counter() - t0)
            if delay > 0:
                # the event loop may wake a timer up to its clock's resolution early: never send before the schedule
                while (delay := req.at - (time.perf_counter() - t0)) > 0:
                    await asyncio.sleep(delay)
            elif -delay * 1000 > cfg.lag_warn_ms and not warned:
                log.warning(
                    "loadgen is %.0f ms behind schedule; its dispatch lag is in the results", -delay * 1000
                )
                warned = True
            tasks.append(asyncio.create_task(session(group, t0)))
        await asyncio.gather(*tasks)
        return warm + records, time.perf_counter() - t0
