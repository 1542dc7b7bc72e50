"""Per-request records and the serving metrics computed from them.

Definitions follow vLLM's ``bench serve`` (and SGLang's ``bench_serving``): TTFT is the first event carrying a
non-empty ``choices`` entry minus the send time; E2EL the last such event; N comes from ``usage``; TPOT is
(E2EL - TTFT) / (N - 1) for N > 1; ITL pools the gaps between consecutive ``choices`` events (TTFT excluded).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    index: int
    priority: str
    scheduled_at: float  # when the arrival process wanted it sent (run clock, s)
    sent_at: float = 0.0  # t0: when it was actually sent
    event_times: list[float] = field(default_factory=list)  # times of events carrying choices
    output_tokens: int = 0  # usage.completion_tokens (or counted client-side, see tokens_from_usage)
    prompt_tokens: int = 0
    tokens_from_usage: bool = True
    queue_ms: float | None = None  # from the gateway's X-Queue-Time-Ms header
    status: int = 0
    error: str = ""
    warmup: bool = False

    @property
    def ok(self) -> bool:
        return not self.error and self.status == 200 and bool(self.event_times)

    @property
    def dispatch_lag(self) -> float:
        return self.sent_at - self.scheduled_at

    @property
    def ttft(self) -> float:
        return self.event_times[0] - self.sent_at

    @property
    def e2el(self) -> float:
        return self.event_times[-1] - self.sent_at

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.event_times
        return [b - a for a, b in zip(t, t[1:])]


def stats(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean / p50 / p90 / p99 (numpy's linear interpolation), scaled (e.g. 1000 for ms)."""
    if not len(values):
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "n": 0}
    a = np.asarray(values, dtype=float) * scale
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99), "n": len(a)}


def token_times(rec: RequestRecord) -> list[float]:
    """Approximate time of every output token: the request's tokens spread evenly over its events."""
    n, t = rec.output_tokens, rec.event_times
    if n <= 0 or not t:
        return []
    if len(t) >= n:
        return t[:n]
    per = n / len(t)
    return [t[min(int(i / per), len(t) - 1)] for i in range(n)]


def peak_output_throughput(records: Sequence[RequestRecord], bucket_s: float = 1.0) -> float:
    times = [x for r in records if r.ok for x in token_times(r)]
    if not times:
        return 0.0
    buckets = np.floor(np.asarray(times) / bucket_s).astype(int)
    return float(np.bincount(buckets - buckets.min()).max() / bucket_s)


def concurrency_series(records: Sequence[RequestRecord], bucket_s: float = 1.0) -> list[int]:
    """Requests in flight during each bucket [k*bucket_s, (k+1)*bucket_s): those whose span overlaps it."""
    spans = [(r.sent_at, r.event_times[-1] if r.event_times else r.sent_at) for r in records if not r.warmup]
    if not spans:
        return []
    n = int(max(e for _, e in spans) // bucket_s) + 1
    out = [0] * n
    for s, e in spans:
        for k in range(int(s // bucket_s), int(e // bucket_s) + 1):
            out[k] += 1
    return out


def goodput(records: Sequence[RequestRecord], duration: float, ttft_s: float, tpot_s: float) -> float:
    good = sum(1 for r in records if r.ok and r.ttft <= ttft_s and (r.tpot is None or r.tpot <= tpot_s))
    return good / duration if duration > 0 else 0.0


def summarize(
    records: Sequence[RequestRecord], duration: float, slo: tuple[float, float] | None = None
) -> dict:
    """Overall and per-priority metrics (times in ms). Warm-up records are excluded."""
    recs = [r for r in records if not r.warmup]
    ok = [r for r in recs if r.ok]
    out = {
        "requests": len(recs),
        "completed": len(ok),
        "failed": len(recs) - len(ok),
        "duration_s": duration,
        "output_throughput": sum(r.output_tokens for r in ok) / duration if duration else 0.0,
        "total_throughput": sum(r.output_tokens + r.prompt_tokens for r in ok) / duration
        if duration
        else 0.0,
        "peak_output_throughput": peak_output_throughput(ok),
        "dispatch_lag_ms": stats([r.dispatch_lag for r in recs if r.sent_at], 1000),
        **_latency(ok),
        "by_priority": {
            p: _latency([r for r in ok if r.priority == p]) for p in sorted({r.priority for r in recs})
        },
        "errors": _errors(recs),
    }
    if slo is not None:
        out["goodput"] = goodput(recs, duration, *slo)
    return out


def _latency(ok: Sequence[RequestRecord]) -> dict:
    return {
        "ttft_ms": stats([r.ttft for r in ok], 1000),
        "tpot_ms": stats([t for r in ok if (t := r.tpot) is not None], 1000),
        "itl_ms": stats([x for r in ok for x in r.itls], 1000),
        "e2el_ms": stats([r.e2el for r in ok], 1000),
        "queue_ms": stats([r.queue_ms for r in ok if r.queue_ms is not None]),
    }


def _errors(recs: Sequence[RequestRecord]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in recs:
        if not r.ok:
            key = r.error.split(":")[0] or f"HTTP {r.status}"
            out[key] = out.get(key, 0) + 1
    return out
