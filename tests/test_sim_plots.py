"""flying-sim's picture: the series it draws (the mode track, shift's steps, burst phases) and the CLI that writes
the table and the picture for all four systems."""

from __future__ import annotations

import json

import pytest

from router.decision import ReleaseCause
from sim import cli as sim_cli
from sim.plots import burst_spans, decision_label, mode_counts, shift_share
from sim.simulator import SimDecision


def test_mode_counts_are_time_weighted_per_bucket_and_add_up_to_the_engines():
    track = [
        (0.0, ("dp", "dp", "dp"), 0),
        (0.5, ("binding", "binding", "dp"), 1),  # a hard bind paused one DP request
        (1.5, ("tp2", "tp2", "dp"), 1),
        (2.5, ("releasing", "releasing", "dp"), 3),
        (2.75, ("dp", "dp", "dp"), 0),
    ]
    c = mode_counts(track, t_end=3.5, bucket_s=1.0)
    assert c["dp"] == pytest.approx([2.0, 1.0, 1.5, 3.0])
    assert c["binding"] == pytest.approx([1.0, 1.0, 0.0, 0.0])
    assert c["tp2"] == pytest.approx([0.0, 1.0, 1.0, 0.0])
    assert c["releasing"] == pytest.approx([0.0, 0.0, 0.5, 0.0])
    assert c["paused"] == [1, 1, 3, 0]  # the most paused at once
    for k in range(4):  # the last bucket is half long: its mean is over what it covers
        assert sum(v[k] for s, v in c.items() if s != "paused") == pytest.approx(3)


def test_shift_share_splits_each_bucket_between_full_tp_sp_and_idle():
    steps = [(0.0, 0.25, True), (0.25, 0.5, False), (1.5, 1.0, True)]
    s = shift_share(steps, t_end=3.0, bucket_s=1.0)
    assert s["full TP"] == pytest.approx([0.25, 0.5, 0.5])
    assert s["SP"] == pytest.approx([0.5, 0.0, 0.0])


def test_burst_spans_follow_the_two_level_cycle_and_stop_at_the_end():
    assert burst_spans(60, 30, 200) == [(60, 90), (150, 180)]
    assert burst_spans(60, 30, 170) == [(60, 90), (150, 170)]


def test_decision_labels_name_the_reason_or_the_typed_cause_without_numbers():
    rel = SimDecision(1.0, "release", 7, (2, 3), "priority", ReleaseCause.DP_DEFERRED)
    assert rel.cause == "DP work deferred" and decision_label(rel) == "release: DP work deferred"
    assert (
        decision_label(SimDecision(1.0, "release", 3, (0, 1), "load", ReleaseCause.NOT_BOUND))
        == "release: not bound"
    )
    assert decision_label(SimDecision(1.0, "bind", 7, (2, 3), "priority")) == "bind (priority)"


def test_flying_sim_prints_and_plots_four_systems(tmp_path, capsys):
    out = tmp_path / "sim"
    assert sim_cli.main(["--requests", "120", "--low-s", "6", "--burst-s", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| metric | static DP | static TP | shift | dynamic |" in text
    assert "full TP" in text and "KV per GPU 296,595 tokens" in text
    summary = json.loads((out / "summary.json").read_text())["summary"]
    assert set(summary) == {"dp", "tp", "shift", "dynamic"}
    assert all(s["served"] + s["rejected"] == 120 for s in summary.values())
    assert (out / "timeline.png").stat().st_size > 10_000
