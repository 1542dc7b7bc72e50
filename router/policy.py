"""Dispatch policy: pure, deterministic functions of (waiting requests, engine views) -> decisions.

No Redis and no clocks here, so the same code runs in the live router, in unit tests and in a simulator.
The bind/release policy of the paper (section 5) extends :func:`plan` with group decisions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flying.messages import QueuedRequest


@dataclass(frozen=True)
class EngineView:
    """What the policy knows about one live engine."""

    engine: int
    url: str
    inflight: int  # assigned by the router and not finished
    free_kv_tokens: int
    max_total_tokens: int


@dataclass(frozen=True)
class Dispatch:
    request: QueuedRequest
    engine: int
    url: str


def plan(
    waiting: Sequence[QueuedRequest], engines: Sequence[EngineView], max_inflight: int
) -> list[Dispatch]:
    """Assign waiting requests, in queue order, to the least-loaded engine that has a free slot and whose KV
    capacity can ever hold the request. Requests no engine can hold stay queued (the gateway rejects those
    before admission; this only happens when the engines changed meanwhile)."""
    inflight = {e.engine: e.inflight for e in engines}
    kv_free = {e.engine: e.free_kv_tokens for e in engines}
    out: list[Dispatch] = []
    for req in waiting:
        fits = [
            e for e in engines if inflight[e.engine] < max_inflight and e.max_total_tokens >= req.kv_tokens
        ]
        if not fits:
            if all(inflight[e.engine] >= max_inflight for e in engines):
                break  # every engine is full: nothing behind this request can go either
            continue
        best = min(fits, key=lambda e: (inflight[e.engine], -kv_free[e.engine], e.engine))
        inflight[best.engine] += 1
        kv_free[best.engine] -= req.kv_tokens
        out.append(Dispatch(req, best.engine, best.url))
    return out
