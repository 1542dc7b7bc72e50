"""What loadgen's PNG draws: the series of each panel (whole run, failures by kind, TTFT per priority), and one
column per run."""

from __future__ import annotations

import math

from loadgen.metrics import RequestRecord, timeseries
from loadgen.plots import panel_lines, timeline


def _ok(i: int, sent: float, first: float, priority: str) -> RequestRecord:
    return RequestRecord(
        index=i, priority=priority, scheduled_at=sent, sent_at=sent, event_times=[first, first + 0.1],
        output_tokens=2, status=200, ended_at=first + 0.1,
    )  # fmt: skip


def _failed(i: int, sent: float, ended: float, status: int, error: str) -> RequestRecord:
    return RequestRecord(
        index=i,
        priority="normal",
        scheduled_at=sent,
        sent_at=sent,
        status=status,
        error=error,
        ended_at=ended,
    )


def overload_run() -> dict:
    records = [
        _ok(0, 0.0, 0.3, "high"),
        _ok(1, 0.5, 1.5, "normal"),
        _failed(2, 1.0, 1.2, 429, "HTTP 429: full"),
    ]
    records += [_failed(3 + k, 2.0, 6.5, 0, "timeout: no complete response within 4.5 s") for k in range(3)]
    return timeseries(records)


def test_panels_cover_the_whole_run_with_failures_by_kind_and_ttft_by_priority():
    lines = panel_lines(overload_run())
    t, timeouts = lines["failed"]["timeout"]
    assert t[-2:] == [6.0, 7.0] and timeouts[6:] == [3.0, 3.0]  # drawn as steps, the last bucket spans [6, 7)
    assert lines["failed"]["HTTP 429"][1][1] == 1.0
    assert set(lines["ttft"]) == {"all", "high", "normal"}
    assert lines["ttft"]["high"][1][0] == 300.0 and lines["ttft"]["normal"][1][0] == 1000.0
    assert lines["concurrency"]["in flight"][1][4] == 3.0  # the three timed-out requests, still in flight


def test_older_result_files_without_the_new_series_still_plot():
    old = {"t": [0.0, 1.0], "concurrency": [1, 0], "ttft_p90_ms": [None, 5.0], "queue_p90_ms": [1.0, None],
           "output_tokens_per_s": [3.0, 0.0]}  # fmt: skip
    lines = panel_lines(old)
    assert lines["failed"] == {} and list(lines["ttft"]) == ["all"]
    assert math.isnan(lines["ttft"]["all"][1][0])


def test_compare_plot_has_a_column_per_run(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok_run = timeseries([_ok(0, 0.0, 0.3, "normal")])
    out = timeline({"overload": overload_run(), "calm": ok_run}, tmp_path / "c.png")
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert not plt.get_fignums()  # closed


def test_a_run_with_no_requests_still_plots(tmp_path):
    out = timeline({"empty": timeseries([])}, tmp_path / "empty.png")
    assert out.stat().st_size > 1000
