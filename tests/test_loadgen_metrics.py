"""Metric code on synthetic event streams with hand-computed expectations."""

import math

import pytest

from loadgen.metrics import RequestRecord, concurrency_series, peak_output_throughput, stats, summarize


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
    assert concurrency_series([a, b]) == [1, 2, 1]


def test_dispatch_lag_is_reported_not_hidden():
    r = rec(0, 0.0, [0.1], n=1)
    r.scheduled_at, r.sent_at = 1.0, 1.02
    assert summarize([r], 1.0)["dispatch_lag_ms"]["p50"] == pytest.approx(20)
