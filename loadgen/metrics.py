"""Per-request records and the serving metrics computed from them.

Definitions follow vLLM's ``bench serve`` (and SGLang's ``bench_serving``): TTFT is the first event carrying a
non-empty ``choices`` entry minus the send time; E2EL the last such event; N comes from ``usage``; TPOT is
(E2EL - TTFT) / (N - 1) for N > 1; ITL pools the gaps between consecutive ``choices`` events (TTFT excluded).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    index: int
    priority: str
    scheduled_at: float  # when the arrival process wanted it sent (run clock, s)
    sent_at: float = math.nan  # t0: when it was actually sent (NaN: never sent)
    event_times: list[float] = field(default_factory=list)  # times of events carrying choices
    event_tokens: list[int] = field(default_factory=list)  # tokens each event carried (from per-chunk usage)
    output_tokens: int = 0  # usage.completion_tokens (or counted client-side, see tokens_from_usage)
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (None: the server gave none)
    tokens_from_usage: bool = True
    queue_ms: float | None = None  # from the gateway's X-Queue-Time-Ms header
    status: int = 0
    error: str = ""
    warmup: bool = False
    # when it ended: its last event, or the failure (NaN: not recorded, older files)
    ended_at: float = math.nan

    @property
    def ok(self) -> bool:
        return not self.error and self.status == 200 and bool(self.event_times)

    @property
    def end(self) -> float:
        """When the request ended (run clock): ``ended_at``, else its last event, else its send time."""
        if not math.isnan(self.ended_at):
            return self.ended_at
        return self.event_times[-1] if self.event_times else self.sent_at

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
        """Gaps between consecutive events (one per event after the first)."""
        t = self.event_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def itls_per_token(self) -> list[float]:
        """Gaps between the events that carried tokens, each split over its tokens (k tokens -> k x gap/k);
        without per-event counts, the event gaps."""
        if len(self.event_tokens) != len(self.event_times):
            return self.itls
        ev = [(t, k) for t, k in zip(self.event_times, self.event_tokens) if k > 0]
        return [(b - a) / k for (a, _), (b, k) in zip(ev, ev[1:]) for _ in range(k)]


def stats(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean / p50 / p90 / p99 (numpy's linear interpolation), scaled (e.g. 1000 for ms)."""
    if not len(values):
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "n": 0}
    a = np.asarray(values, dtype=float) * scale
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99), "n": len(a)}


def token_times(rec: RequestRecord) -> list[float]:
    """Time of every output token: each event's time repeated for the tokens it carried; without per-event
    counts, the request's tokens spread evenly over its events."""
    n, t = rec.output_tokens, rec.event_times
    if n <= 0 or not t:
        return []
    if len(rec.event_tokens) == len(t):
        return [x for x, k in zip(t, rec.event_tokens) for _ in range(k)]
    if len(t) >= n:
        return t[:n]
    per = n / len(t)
    return [t[min(int(i / per), len(t) - 1)] for i in range(n)]


def peak_output_throughput(records: Sequence[RequestRecord], bucket_s: float = 1.0) -> float:
    """Output tokens/s in the busiest ``bucket_s`` bucket of the run clock, [k*bucket_s, (k+1)*bucket_s).

    The last bucket is cut short by the last token (at T): its tokens are divided by its real span, from
    k*bucket_s to T; a span shorter than half a bucket is counted together with the bucket before it (one
    sliver's few tokens over a millisecond would be no peak), and a run shorter than one bucket gives its own
    rate, tokens over [0, T]. The spans so partition [0, T], so the peak is never below the mean rate over it (nor
    below the run's output throughput, over a duration of at least T)."""
    times = np.asarray([x for r in records if r.ok for x in token_times(r)], dtype=float)
    if not len(times):
        return 0.0
    counts = np.bincount(np.floor(times / bucket_s).astype(int))
    last, end = len(counts) - 1, float(times.max())
    whole = counts[:last].max(initial=0) / bucket_s  # the buckets that end before the last token
    tail = end - last * bucket_s
    if last and tail < bucket_s / 2:  # a sliver: count it with the bucket before it
        last, tail = last - 1, tail + bucket_s
    if tail <= 0:  # every token at 0
        return float(counts.sum() / bucket_s)
    return float(max(whole, counts[last:].sum() / tail))


def concurrency_series(records: Sequence[RequestRecord], bucket_s: float = 1.0) -> list[float]:
    """Mean number of requests in flight during each bucket [k*bucket_s, (k+1)*bucket_s) (time-weighted: a
    request in flight for half the bucket counts 0.5), from send to its end (the last event, or the failure)."""
    spans = [(r.sent_at, r.end) for r in records if not r.warmup and not math.isnan(r.sent_at)]
    if not spans:
        return []
    n = int(max(e for _, e in spans) // bucket_s) + 1
    out = [0.0] * n
    for s, e in spans:
        for k in range(int(s // bucket_s), int(e // bucket_s) + 1):
            lo, hi = max(s, k * bucket_s), min(e, (k + 1) * bucket_s)
            out[k] += max(0.0, hi - lo) / bucket_s
    return out


SLO_KEYS = ("ttft", "tpot", "e2el")


def meets(r: RequestRecord, slo: dict[str, float]) -> bool:
    """All SLOs met (values in ms; a one-token request has no TPOT to miss). Failed requests never meet them."""
    if not r.ok:
        return False
    got = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el}
    return all(got[k] is None or got[k] * 1000 <= v for k, v in slo.items())  # type: ignore[operator]


def goodput(
    records: Sequence[RequestRecord],
    duration: float,
    slo: dict[str, float],
    by_priority: Mapping[str, dict[str, float]] | None = None,
) -> float:
    """Requests per second meeting every SLO of their priority (ms by key ttft / tpot / e2el): ``by_priority``'s
    for a priority it names, else ``slo``."""
    by_priority = by_priority or {}
    good = sum(1 for r in records if not r.warmup and meets(r, by_priority.get(r.priority, slo)))
    return good / duration if duration > 0 else 0.0


def summarize(
    records: Sequence[RequestRecord],
    duration: float,
    slo: dict[str, float] | None = None,
    slo_by_priority: Mapping[str, dict[str, float]] | None = None,
) -> dict:
    """Overall and per-priority metrics (times in ms). Warm-up records are excluded. With SLOs (``slo`` for all,
    ``slo_by_priority`` for the priorities it names), goodput overall and per priority."""
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
        "dispatch_lag_ms": stats([r.dispatch_lag for r in recs if not math.isnan(r.sent_at)], 1000),
        **_latency(ok),
        "by_priority": {
            p: _latency([r for r in ok if r.priority == p]) for p in sorted({r.priority for r in recs})
        },
        "errors": _errors(recs),
        "errors_span_s": _error_spans(recs),
        "tokens_counted_client_side": sum(1 for r in ok if not r.tokens_from_usage),
        **prefix_cache(ok),
    }
    if slo or slo_by_priority:
        slo, by_prio = dict(slo or {}), dict(slo_by_priority or {})
        out["slo_ms"] = slo
        out["goodput"] = goodput(recs, duration, slo, by_prio)
        if by_prio:
            out["slo_ms_by_priority"] = by_prio
        out["goodput_by_priority"] = {
            p: goodput([r for r in recs if r.priority == p], duration, slo, by_prio)
            for p in out["by_priority"]
        }
    return out


def prefix_cache(ok: Sequence[RequestRecord]) -> dict:
    """Prompt tokens the server found in its prefix cache, over the requests that report them
    (``usage.prompt_tokens_details.cached_tokens``): ``cache_hit_rate`` = sum cached / sum prompt tokens (None:
    no request reported cached tokens)."""
    rep = [r for r in ok if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in rep)
    cached = sum(r.cached_tokens or 0 for r in rep)
    return {
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": cached if rep else None,
        "cache_hit_rate": cached / prompt if rep and prompt else None,
    }


def _latency(ok: Sequence[RequestRecord]) -> dict:
    return {
        "ttft_ms": stats([r.ttft for r in ok], 1000),
        "tpot_ms": stats([t for r in ok if (t := r.tpot) is not None], 1000),
        "itl_ms": stats([x for r in ok for x in r.itls], 1000),
        "itl_per_token_ms": stats([x for r in ok for x in r.itls_per_token], 1000),
        "e2el_ms": stats([r.e2el for r in ok], 1000),
        "queue_ms": stats([r.queue_ms for r in ok if r.queue_ms is not None]),
    }


def error_kind(r: RequestRecord) -> str:
    """A failure's kind: "HTTP 503", "timeout", "transport", "stream error", ..."""
    return r.error.split(":")[0] or f"HTTP {r.status}"


def _errors(recs: Sequence[RequestRecord]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in recs:
        if not r.ok:
            out[error_kind(r)] = out.get(error_kind(r), 0) + 1
    return out


def _error_spans(recs: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Per failure kind, when the first and the last such failure ended (run clock, s)."""
    ends: dict[str, list[float]] = {}
    for r in recs:
        if not r.ok and not math.isnan(r.end):
            ends.setdefault(error_kind(r), []).append(r.end)
    return {k: [min(v), max(v)] for k, v in ends.items()}


def _p90(xs: Sequence[float]) -> float:
    return float(np.percentile(xs, 90)) if len(xs) else float("nan")


def timeseries(records: Sequence[RequestRecord], bucket_s: float = 1.0) -> dict:
    """Per bucket of the run clock, from the first send to the last request's end (failures included, so the
    series covers what ended after the last arrival): requests in flight, P90 TTFT and P90 queue time of the
    requests sent in the bucket (ms; NaN where none), P90 TTFT per priority, output tokens/s, and failures per
    second by kind (counted when they ended). The series of the paper's Figure 8; ``last_sent_s`` marks the last
    send."""
    recs = [r for r in records if not r.warmup and not math.isnan(r.sent_at)]
    conc = concurrency_series(recs, bucket_s)
    n = len(conc)
    at = lambda x: min(int(x // bucket_s), n - 1)  # noqa: E731
    by_bucket: list[list[RequestRecord]] = [[] for _ in range(n)]
    tokens = [0.0] * n
    failed: dict[str, list[float]] = {}
    for r in recs:
        if r.ok:
            by_bucket[at(r.sent_at)].append(r)
            for x in token_times(r):
                tokens[at(x)] += 1 / bucket_s
        else:
            failed.setdefault(error_kind(r), [0.0] * n)[at(r.end)] += 1 / bucket_s
    priorities = sorted({r.priority for r in recs})
    return {
        "t": [k * bucket_s for k in range(n)],
        "concurrency": conc,
        "ttft_p90_ms": [_p90([r.ttft * 1000 for r in b]) for b in by_bucket],
        "ttft_p90_ms_by_priority": {
            p: [_p90([r.ttft * 1000 for r in b if r.priority == p]) for b in by_bucket] for p in priorities
        },
        "queue_p90_ms": [_p90([r.queue_ms for r in b if r.queue_ms is not None]) for b in by_bucket],
        "output_tokens_per_s": tokens,
        "failed_per_s": dict(sorted(failed.items())),
        "last_sent_s": max((r.sent_at for r in recs), default=0.0),
    }
