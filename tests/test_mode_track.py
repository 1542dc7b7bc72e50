"""The mode track (devstack.mode_track) read from a real Redis: the decision log, each phase's TP/DP split."""

from __future__ import annotations

from devstack import mode_track
from flying.messages import DecisionEvent, encode
from loadgen.metrics import RequestRecord


def log(r, keys, *events: DecisionEvent) -> None:
    for e in events:
        r.xadd(keys.decisions, {"event": encode(e)}, id=f"{int(e.ts * 1000)}-*")


def record(i: int, ttft_s: float, status: int = 200) -> RequestRecord:
    return RequestRecord(index=i, priority="normal", scheduled_at=0.0, sent_at=0.0, event_times=[ttft_s], status=status)  # fmt: skip


BIND = DecisionEvent(
    ts=1010.0, kind="bind", text="bind (0, 1) (load, hard preemption)", epoch=3, members=(0, 1)
)
RELEASE = DecisionEvent(ts=1030.0, kind="release", text="release epoch 3 (0, 1) (load) by scatter: load rose", epoch=3)  # fmt: skip
LIGHT = DecisionEvent(ts=1010.0, kind="regime", text="light load (0 requests, 0.0/s on 2 engines): TP groups allowed")  # fmt: skip


def test_the_decision_log_is_read_from_a_time_on(sync_redis, keys):
    old = DecisionEvent(ts=900.0, kind="bind", text="an earlier run's bind")
    log(sync_redis, keys, old, LIGHT, BIND, RELEASE)
    assert mode_track.decision_log(sync_redis, keys, since=1000.0) == [LIGHT, BIND, RELEASE]
    assert mode_track.binds_per_minute([BIND, RELEASE], 30.0) == 2.0


def test_a_phases_requests_are_counted_by_where_they_were_assigned(sync_redis, keys):
    rows = [("a", 1001.0, "3", "done"), ("b", 1002.0, "0", "done"), ("c", 1003.0, "3", "assigned"),
            ("d", 1004.0, "", "queued"), ("e", 1100.0, "0", "done")]  # fmt: skip
    for rid, at, epoch, state in rows:
        sync_redis.hset(keys.request(rid), mapping={"enqueued_at": at, "epoch": epoch, "state": state})
    assert mode_track.modes(sync_redis, keys, 1000.0, 1050.0) == mode_track.PhaseModes(tp=2, dp=1)


def test_the_track_marks_the_phases_and_says_why_the_engines_switched():
    quiet = mode_track.Phase("quiet", [record(0, 0.030), record(1, 0.050)], 1005.0, 1020.0, 0.5, 15.0)
    burst = mode_track.Phase("burst", [record(2, 0.2), record(3, 0.0, status=503)], 1025.0, 1040.0, 8.0, 15.0)
    assert mode_track.track([LIGHT, BIND, RELEASE], [quiet, burst]) == [
        "t=    0.0s  -- quiet phase begins",
        "t=    5.0s  light load (0 requests, 0.0/s on 2 engines): TP groups allowed",
        "t=    5.0s  bind (0, 1) (load, hard preemption)",
        "t=   20.0s  -- burst phase begins",
        "t=   25.0s  release epoch 3 (0, 1) (load) by scatter: load rose",
    ]
    early = mode_track.track([BIND], [mode_track.Phase("quiet", [], 1012.5, 1020.0, 0.5, 7.5)])
    assert early[0] == "t=   -2.5s  bind (0, 1) (load, hard preemption)", "a bind before the first request"
    line = mode_track.phase_line(quiet, mode_track.PhaseModes(tp=2, dp=0))
    assert line == "quiet    2 requests at 0.5 req/s: TTFT p50 40.0 ms; 2 ran in TP groups, 0 in DP"
    assert "TTFT p50 200.0 ms" in mode_track.phase_line(burst, mode_track.PhaseModes(dp=2)), (
        "failed ones left out"
    )
