"""The mode track of a run: when engines bound and released and why (the router's decision log,
``flying:router:decisions``), and per phase of the run its TTFT and how many requests ran in TP groups or in DP.
``flying-demo`` prints it under its summary; the live check in docs/benchmarks.md reads it the same way."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from flying.keys import Keys
from flying.messages import DecisionEvent, decode
from loadgen.metrics import RequestRecord, stats


@dataclass(frozen=True)
class Phase:
    """One phase of a run: its requests' records, when (wall clock) it began and ended, the rate it was sent at
    (requests per second) and its duration as loadgen measured it."""

    name: str
    records: Sequence[RequestRecord]
    started: float
    ended: float
    rate: float
    duration: float


@dataclass(frozen=True)
class PhaseModes:
    """How a phase's requests were assigned: to a TP group (``epoch`` > 0) or to a DP engine."""

    tp: int = 0
    dp: int = 0


def decision_log(r: redis.Redis, keys: Keys, since: float = 0.0) -> list[DecisionEvent]:
    """The decision log's entries from ``since`` (wall clock) on, oldest first."""
    rows: list[tuple[bytes, dict[bytes, bytes]]] = r.xrange(keys.decisions, min=f"{int(since * 1000)}-0")  # type: ignore[assignment]
    return [decode(fields[b"event"], DecisionEvent) for _, fields in rows]


def modes(r: redis.Redis, keys: Keys, started: float, ended: float) -> PhaseModes:
    """TP and DP assignments of the requests admitted between ``started`` and ``ended`` (their records in Redis)."""
    tp = dp = 0
    for key in r.scan_iter(match=keys.request("*"), count=500):
        enqueued, epoch, state = r.hmget(key, ["enqueued_at", "epoch", "state"])
        if enqueued is None or not started <= float(enqueued) <= ended or state == b"queued":
            continue
        if int(epoch or 0):
            tp += 1
        else:
            dp += 1
    return PhaseModes(tp, dp)


def phase_line(p: Phase, m: PhaseModes) -> str:
    ok = [x.ttft for x in p.records if x.ok]
    p50 = stats(ok, 1000)["p50"]
    ttft = "no TTFT" if math.isnan(p50) else f"TTFT p50 {p50:.1f} ms"
    return (
        f"{p.name:<6} {len(p.records):3d} requests at {p.rate:g} req/s: {ttft}; "
        f"{m.tp} ran in TP groups, {m.dp} in DP"
    )


def ttft_ratio(p: Phase, reference: Phase) -> float | None:
    """``p``'s TTFT p50 over ``reference``'s (None where either has none)."""
    a, b = (stats([x.ttft for x in q.records if x.ok], 1000)["p50"] for q in (p, reference))
    return None if math.isnan(a) or math.isnan(b) or not b else a / b


def track(events: Sequence[DecisionEvent], phases: Sequence[Phase]) -> list[str]:
    """The decision log as lines ``t=  12.3s <what and why>``, t from the first phase's start, with the phases'
    beginnings marked; distrust entries and regime changes without a bind or release are kept (they say why)."""
    t0 = phases[0].started if phases else 0.0
    marks = [(p.started, f"-- {p.name} phase begins") for p in phases]
    lines = sorted([*marks, *((e.ts, e.text) for e in events)], key=lambda x: x[0])
    return [f"t={t - t0:7.1f}s  {text}" for t, text in lines]


def binds_per_minute(events: Sequence[DecisionEvent], seconds: float) -> float:
    """Binds in the log per minute of ``seconds`` (how often the engines switch: flapping shows here)."""
    return sum(e.kind == "bind" for e in events) / (seconds / 60) if seconds > 0 else 0.0
