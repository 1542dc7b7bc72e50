"""What the engine's forwards cost (worker_ext.step_costs), as the heartbeat reports it."""

from __future__ import annotations

import pytest

from flying.messages import StepCost
from worker_ext.step_costs import StepCosts, bucket


def test_steps_are_kept_per_mode_width_and_power_of_two_size():
    c = StepCosts("cpu")
    c.record("dp", 1, 100, 10.0)
    c.record("dp", 1, 120, 14.0)  # the same bucket (64-127)
    c.record("dp", 1, 300, 30.0)
    c.record("sp", 2, 300, 20.0)
    assert c.samples() == (
        StepCost("dp", 1, 2, 110.0, 12.0),
        StepCost("dp", 1, 1, 300.0, 30.0),
        StepCost("sp", 2, 1, 300.0, 20.0),
    )
    assert [bucket(t) for t in (0, 1, 2, 3, 4, 127, 128)] == [1, 1, 2, 2, 3, 7, 8]


def test_a_step_lasts_from_its_forward_to_the_next_and_idle_gaps_are_not_counted(monkeypatch):
    clock = iter([0.0, 0.010, 0.030, 0.045, 0.200, 0.210])  # (start, end) of three forwards
    monkeypatch.setattr("worker_ext.step_costs.time.perf_counter", lambda: next(clock))
    c = StepCosts("cpu")
    assert c.timed("tp", 2, 8, lambda: "logits") == "logits"
    assert not c.samples(), "a step is counted once the next one starts"
    c.timed("tp", 2, 8, lambda: None)  # starts 20 ms after the first ended: the first lasted 30 ms
    c.timed("tp", 2, 8, lambda: None)  # starts 155 ms after the second ended: idle, not counted
    (s,) = c.samples()
    assert (s.mode, s.width, s.n, s.tokens) == ("tp", 2, 1, 8.0) and s.ms == pytest.approx(30.0)


def test_on_a_gpu_only_every_nth_step_is_sampled():
    c = StepCosts("cuda", cuda_every=4)
    for _ in range(9):
        c.timed("dp", 1, 16, lambda: None)
    assert c.samples()[0].n == 2


@pytest.mark.parametrize("mode", ["dp", "tp"])
def test_the_binding_times_its_forwards_in_either_mode(mode):
    from flying.messages import Bind
    from tests.test_binding import make

    b, *_ = make()
    if mode == "tp":
        b.on_step([Bind(epoch=1, members=(0, 1))])
    for _ in range(2):  # (a step is counted when the next one starts)
        b.around_forward(lambda runner, fb: None, None, {"tokens": [("r", 6, 6)]})
    st = b.status()
    assert st["device"] == "cpu" and [(s.mode, s.width, s.n) for s in st["step_costs"]] == [
        (mode, 1 if mode == "dp" else 2, 1)
    ]
