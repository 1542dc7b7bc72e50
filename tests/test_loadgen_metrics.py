"""Metric code on synthetic event streams with hand-computed expectations."""

import io
import math

import pytest

from loadgen import report
from loadgen.metrics import (
    RequestRecord,
    concurrency_series,
    peak_output_throughput,
    stats,
    summarize,
    timeseries,
    token_times,
)


def rec(i, sent, events, n, priority="normal", **kw):
    return RequestRecord(
        index=i,
        priority=priority,
        scheduled_at=sent,
        sent_at=sent,
        event_times=events,
        output_tokens=n,
        status=200,
        **kw,
    )


def test_ttft_tpot_itl_e2el():
    r = rec(0, 1.0, [1.2, 1.3, 1.5], n=5)  # last chunk carried 3 tokens
    assert r.ttft == pytest.approx(0.2)
    assert r.e2el == pytest.approx(0.5)
    assert r.tpot == pytest.approx((0.5 - 0.2) / 4)  # N - 1, TTFT excluded
    assert r.itls == pytest.approx([0.1, 0.2])  # TTFT is not an ITL


def test_one_token_request_has_no_tpot_and_no_itl():
    r = rec(0, 0.0, [0.3], n=1)
    assert r.tpot is None and r.itls == []


def test_failed_request_excluded_from_latency_and_counted():
    ok = rec(0, 0.0, [0.1, 0.2], n=2, queue_ms=4.0)
    bad = RequestRecord(
        index=1, priority="high", scheduled_at=0.0, sent_at=0.01, status=503, error="HTTP 503: busy"
    )
    s = summarize([ok, bad], duration=2.0)
    assert (s["completed"], s["failed"]) == (1, 1)
    assert s["errors"] == {"HTTP 503": 1}
    assert s["ttft_ms"]["p50"] == pytest.approx(100)
    assert s["tpot_ms"]["p50"] == pytest.approx(100)
    assert s["queue_ms"]["p50"] == pytest.approx(4.0)
    assert s["output_throughput"] == pytest.approx(1.0)
    assert s["by_priority"]["high"]["ttft_ms"]["n"] == 0


def test_percentiles_use_linear_interpolation():
    s = stats([1, 2, 3, 4], scale=1)
    assert (s["p50"], s["p90"], s["mean"]) == (2.5, pytest.approx(3.7), 2.5)
    assert math.isnan(stats([])["p50"])


def test_peak_throughput_uses_tokens_not_chunks():
    a = rec(0, 0.0, [0.5], n=10)  # one chunk, ten tokens, all in second 0
    b = rec(1, 0.0, [1.5, 1.6], n=2)
    assert peak_output_throughput([a, b]) == 10


def test_concurrency_series():
    a = rec(0, 0.0, [0.5, 2.5], n=2)
    b = rec(1, 1.2, [1.4], n=1)
    assert concurrency_series([a, b]) == pytest.approx([1.0, 1.2, 0.5])  # time-weighted per 1 s bucket


def test_dispatch_lag_is_reported_not_hidden():
    r = rec(0, 0.0, [0.1], n=1)
    r.scheduled_at, r.sent_at = 1.0, 1.02
    assert summarize([r], 1.0)["dispatch_lag_ms"]["p50"] == pytest.approx(20)


def test_chunk_carrying_several_tokens_gives_per_token_itl_and_token_times():
    r = rec(0, 0.0, [0.1, 0.2, 0.5], n=6, event_tokens=[1, 2, 3])  # 2nd event: 2 tokens, 3rd: 3 tokens
    assert r.itls == pytest.approx([0.1, 0.3])  # per event
    assert r.itls_per_token == pytest.approx([0.05, 0.05, 0.1, 0.1, 0.1])  # each gap split over its tokens
    assert r.tpot == pytest.approx(0.4 / 5)
    assert token_times(r) == [0.1, 0.2, 0.2, 0.5, 0.5, 0.5]


def test_events_without_new_tokens_do_not_count_as_token_gaps():
    r = rec(0, 0.0, [0.1, 0.15, 0.3], n=2, event_tokens=[1, 0, 1])
    assert r.itls_per_token == pytest.approx([0.2])


def test_goodput_counts_failed_requests_as_missing_the_slo():
    fast = rec(0, 0.0, [0.05, 0.06], n=2)
    slow_first = rec(1, 0.0, [0.5, 0.51], n=2)
    one_token = rec(2, 0.0, [0.1], n=1)  # no TPOT to miss
    failed = RequestRecord(
        index=3, priority="normal", scheduled_at=0.0, sent_at=0.0, status=500, error="HTTP 500: x"
    )
    s = summarize([fast, slow_first, one_token, failed], duration=2.0, slo={"ttft": 200, "tpot": 50})
    assert s["goodput"] == pytest.approx(1.0)  # fast and one_token, over 2 s
    assert s["slo_ms"] == {"ttft": 200, "tpot": 50}


def test_goodput_holds_each_priority_to_its_own_slo():
    """High priority within 100 ms, the others within 1 s: a 0.5 s first token is good for normal, not for high."""
    recs = [rec(0, 0.0, [0.05], n=1, priority="high"), rec(1, 0.0, [0.5], n=1, priority="high"),
            rec(2, 0.0, [0.5], n=1), rec(3, 0.0, [1.5], n=1, priority="low")]  # fmt: skip
    s = summarize(recs, duration=1.0, slo={"ttft": 1000}, slo_by_priority={"high": {"ttft": 100}})
    assert s["goodput"] == pytest.approx(2.0)
    assert s["goodput_by_priority"] == {"high": 1.0, "low": 0.0, "normal": 1.0}
    assert s["slo_ms_by_priority"] == {"high": {"ttft": 100}}
    assert "goodput 2.00 req/s (high 1.00, low 0.00, normal 1.00)" in report.table(s)


def test_timeseries_buckets_by_send_time():
    a = rec(0, 0.2, [0.3, 0.4], n=2, queue_ms=3.0)
    b = rec(1, 1.5, [1.7], n=1, queue_ms=9.0)
    s = timeseries([a, b])
    assert s["t"] == [0.0, 1.0]
    assert s["ttft_p90_ms"] == pytest.approx([100, 200])
    assert s["queue_p90_ms"] == pytest.approx([3.0, 9.0])
    assert s["output_tokens_per_s"] == [2.0, 1.0]
    assert s["concurrency"] == pytest.approx([0.2, 0.2])


def test_warmup_records_are_excluded():
    w = rec(0, 0.0, [5.0], n=1, warmup=True)
    r = rec(1, 0.0, [0.1], n=1)
    s = summarize([w, r], 1.0)
    assert (s["requests"], s["ttft_ms"]["p50"]) == (1, pytest.approx(100))


def test_timeseries_runs_to_the_last_failure_and_counts_failures_by_kind_when_they_ended():
    """An overload run: the last request is sent at 1.0 s, a timeout ends at 9.2 s; the series covers the whole
    run, the timed-out request is in flight until then, and each failure is counted in the bucket it ended in."""
    ok = rec(0, 0.0, [0.2, 0.4], n=2, priority="high")
    timeout = RequestRecord(
        index=1, priority="normal", scheduled_at=0.5, sent_at=0.5, error="timeout: no complete response within 8.7 s",
        ended_at=9.2,
    )  # fmt: skip
    busy = RequestRecord(
        index=2,
        priority="normal",
        scheduled_at=1.0,
        sent_at=1.0,
        status=503,
        error="HTTP 503: busy",
        ended_at=1.1,
    )
    s = timeseries([ok, timeout, busy])
    assert s["t"] == [float(k) for k in range(10)]
    assert s["last_sent_s"] == 1.0
    assert s["failed_per_s"] == {"HTTP 503": [0, 1] + [0] * 8, "timeout": [0] * 9 + [1]}
    assert s["concurrency"][5] == pytest.approx(1.0)  # the timed-out request, in flight
    summary = summarize([ok, timeout, busy], duration=9.2)
    assert summary["errors"] == {"timeout": 1, "HTTP 503": 1}
    assert summary["errors_span_s"] == {"timeout": [9.2, 9.2], "HTTP 503": [1.1, 1.1]}


def test_ttft_per_priority_series():
    a = rec(0, 0.0, [0.1], n=1, priority="high")
    b = rec(1, 0.2, [0.7], n=1, priority="normal")
    c = rec(2, 1.0, [1.3], n=1, priority="normal")
    s = timeseries([a, b, c])
    by = s["ttft_p90_ms_by_priority"]
    assert by["high"][0] == pytest.approx(100) and math.isnan(by["high"][1])
    assert by["normal"] == pytest.approx([500, 300])


def test_end_of_a_record_without_ended_at_is_its_last_event_or_its_send():
    assert rec(0, 0.0, [0.2, 0.4], n=2).end == 0.4
    failed = RequestRecord(index=1, priority="normal", scheduled_at=0.0, sent_at=0.3, error="transport: x")
    assert failed.end == 0.3


def test_peak_of_a_run_shorter_than_a_bucket_is_its_own_rate_not_below_the_mean():
    """A 0.6 s run once printed 1016 tok/s mean and a peak of 640: a partial bucket divided by a whole one."""
    recs = [
        rec(i, 0.0, [0.1 + 0.05 * k for k in range(10)], n=10) for i in range(6)
    ]  # 60 tokens, last at 0.55
    s = summarize(recs, duration=0.6)
    assert s["peak_output_throughput"] == pytest.approx(60 / 0.55)
    assert s["peak_output_throughput"] >= s["output_throughput"] == pytest.approx(100)


def test_peak_counts_a_partial_last_bucket_over_its_span_and_a_sliver_with_the_bucket_before():
    steady = [rec(0, 0.0, [0.01 * k for k in range(1, 100)], n=99)]  # 99 tokens in [0, 1)
    tail = rec(1, 1.0, [1.0 + 0.01 * k for k in range(1, 61)], n=60)  # 60 tokens in [1, 1.6]
    assert peak_output_throughput([*steady, tail]) == pytest.approx(60 / 0.6)
    sliver = rec(1, 1.0, [1.001, 1.002], n=2)  # 2 tokens a millisecond after the last whole bucket
    assert peak_output_throughput([*steady, sliver]) == pytest.approx(101 / 1.002)  # not 2 / 0.002 = 1000
    assert peak_output_throughput([rec(0, 0.0, [0.0], n=3)]) == 3  # every token at 0: a bucket's count


def test_peak_is_never_below_the_mean_rate():
    rng = __import__("numpy").random.default_rng(0)
    for _ in range(300):
        recs = []
        for i in range(int(rng.integers(1, 6))):
            times = sorted(float(x) for x in rng.uniform(0, rng.uniform(0.05, 5), int(rng.integers(1, 40))))
            recs.append(rec(i, 0.0, times, n=len(times)))
        end = max(r.event_times[-1] for r in recs)
        bucket = float(rng.choice([0.5, 1.0, 10.0]))
        assert peak_output_throughput(recs, bucket) >= sum(r.output_tokens for r in recs) / end - 1e-9


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_progress_redraws_on_a_terminal_and_writes_tenths_elsewhere(tty):
    out = _Stream(tty)
    progress = report.Progress(20, stream=out, hz=1e9)
    for i in range(20):
        progress(rec(i, 0.0, [0.1], 1, error="x" if i == 3 else None))
    text = out.getvalue()
    if tty:
        assert text.count("\r") == 20 and text.endswith("20/20  failed 1\n")
    else:
        assert "\r" not in text and text.splitlines() == [
            f"  {2 * k}/20 done, failed {int(2 * k > 3)}" for k in range(1, 11)
        ]
