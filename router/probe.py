"""Idle probes: where the fitted cost model has no line yet for a group's steps at a width the planner may choose,
the router measures one. It plans that node at the width (a load group binds, at idle a hard preemption of
nothing), sends the group's leader a few prompts of its own, short to long, and lets the engines' step costs do
the rest (:mod:`router.cost_fit`). Bounded: only on a node that has been idle for :data:`IDLE_S` (nothing queued,
admitted, running or waiting), at most :data:`BUDGET` probes in a router's life, each ended at
:data:`TIMEOUT_S` or as soon as a request arrives. A restarted router finds the fit in Redis and probes no more."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

import httpx

from flying.groups import widths as group_widths
from router.cost_fit import CostFit
from router.engine_view import EngineView
from router.snapshot import Snapshot

log = logging.getLogger("flying.router")

IDLE_S = 5.0  # seconds a node must have been idle before it is probed
BUDGET = 2  # probes in a router's life
TIMEOUT_S = 60.0  # seconds a probe may take, its group's bind included
# SP steps: prompts of 1, 2, 4 and 8 times the SP threshold (those the context holds), each 3 times, one after
# another (a prefill step each, timed by the decode steps after it); TP steps: 8 short prompts at once whose decode
# batch shrinks from 8 to 1
SP_FACTORS = (1, 2, 4, 8)
SP_REPEATS = 3
TP_PROMPT = 32
TP_OUTPUTS = (16, 14, 12, 10, 8, 6, 4, 2)


def unmeasured(fit: CostFit | None, width: int) -> bool:
    """Whether ``fit`` lacks a line for a group's TP or SP steps at ``width``."""
    have = {(c.mode, c.width) for c in fit.curves} if fit is not None else set()
    return ("tp", width) not in have or ("sp", width) not in have


def body(tokens: int, out: int, seed: int) -> dict:
    """One probe request, as SGLang's native ``/generate`` body (token ids: no tokenizer needed; distinct per
    ``seed``, so that no prefix cache shortens it)."""
    return {
        "input_ids": [1 + (7 * i + 13 * seed) % 97 for i in range(tokens)],
        "sampling_params": {"max_new_tokens": out, "temperature": 0.0, "ignore_eos": True},
    }


def payloads(max_context: int, sp_threshold: int) -> tuple[list[dict], list[dict]]:
    """The probe's requests: those sent one after another (SP steps), and those sent at once (TP steps)."""
    sp = [
        body(f * sp_threshold, 4, seed=len(SP_FACTORS) * r + i)
        for r in range(SP_REPEATS)
        for i, f in enumerate(SP_FACTORS)
        if sp_threshold and f * sp_threshold + 4 <= max_context
    ]
    tp = [
        body(TP_PROMPT, out, seed=100 + i)
        for i, out in enumerate(TP_OUTPUTS)
        if TP_PROMPT + out <= max_context
    ]
    return sp, tp


class Prober:
    """The router's probes: which node to plan at which width for one (:meth:`widths`), and the prompts sent
    once its group is bound (:meth:`fire`)."""

    def __init__(self, budget: int = BUDGET) -> None:
        self.left = budget
        self._idle_since: dict[str, float] = {}
        self._admitted: int | None = None  # the admission counter last seen
        self.node: str | None = None  # the node being probed, at ``width``, since ``started``
        self.width = 0
        self.started = 0.0
        self._task: asyncio.Task[None] | None = None
        self._http: httpx.AsyncClient | None = None

    def widths(self, s: Snapshot, fit: CostFit | None, max_width: int, adaptive: bool) -> Mapping[str, int]:
        """Node -> the width to plan it at for a probe this round (empty: none)."""
        arrived = self._admitted is not None and s.admitted != self._admitted
        self._admitted = s.admitted
        nodes: dict[str, list[EngineView]] = {}
        for e in s.engines:
            nodes.setdefault(e.node_key, []).append(e)
        if self.node is not None:
            done = self._task is not None and self._task.done()
            if not (
                done or arrived or s.queued or s.now - self.started > TIMEOUT_S or self.node not in nodes
            ):
                return {self.node: self.width}
            log.info(
                "probe of node %s at width %d %s",
                self.node,
                self.width,
                "answered" if done else "ended: work arrived, or it timed out",
            )
            self._end()
        for node, engines in nodes.items():
            quiet = not (arrived or s.queued) and all(_idle(e) for e in engines)
            since = self._idle_since.setdefault(node, s.now) if quiet else self._idle_since.pop(node, None)
            if not (adaptive and self.left > 0 and quiet and since is not None and s.now - since >= IDLE_S):
                continue
            if any(g.reason != "load" and set(g.members) & {e.engine for e in engines} for g in s.groups):
                continue  # (a priority, long, parked or operator's group: not idle in the planner's sense)
            width = next(
                (
                    w
                    for w in group_widths(engines[0].pool[2])
                    if 2 <= w <= min(max_width, len(engines)) and unmeasured(fit, w)
                ),
                0,
            )
            if width:
                self.node, self.width, self.started, self.left = node, width, s.now, self.left - 1
                log.info(
                    "probing node %s at width %d: the cost model has no measured line for its steps yet",
                    node,
                    width,
                )
                return {node: width}
        return {}

    def fire(self, engines: Sequence[EngineView], sp_threshold: int) -> None:
        """Once the probed node's load group of the probe's width is bound, send its leader the prompts."""
        if self.node is None or self._task is not None:
            return
        for e in engines:
            leads = e.mode == "tp" and len(e.group) == self.width and e.group[0] == e.engine
            if e.node_key == self.node and leads:
                bodies = payloads(min(e.max_total_tokens, e.context_len or e.max_total_tokens), sp_threshold)
                self._task = asyncio.create_task(self._send(e.url, *bodies))
                return

    async def _send(self, url: str, one_by_one: list[dict], at_once: list[dict]) -> None:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=TIMEOUT_S)
        try:
            for b in one_by_one:
                await self._http.post(f"{url}/generate", json=b)
            await asyncio.gather(*(self._http.post(f"{url}/generate", json=b) for b in at_once))
        except httpx.HTTPError as exc:
            log.warning("probe of node %s: %s", self.node, exc)

    def _end(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self.node, self._task = None, None
        self._idle_since.clear()

    async def close(self) -> None:
        self._end()
        if self._http is not None:
            await self._http.aclose()


def _idle(e: EngineView) -> bool:
    return e.running == 0 and e.waiting == 0 and e.inflight == 0
