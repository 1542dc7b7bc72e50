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


def test_a_forward_is_timed_and_its_result_passed_on():
    c = StepCosts("cpu")
    assert c.timed("tp", 2, 8, lambda: "logits") == "logits"
    (s,) = c.samples()
    assert (s.mode, s.width, s.n, s.tokens) == ("tp", 2, 1, 8.0) and s.ms >= 0


def test_on_a_gpu_only_every_nth_forward_is_timed(monkeypatch):
    c = StepCosts("cuda", cuda_every=4)
    synced = []
    monkeypatch.setattr("torch.cuda.synchronize", lambda: synced.append(1))
    for _ in range(8):
        c.timed("dp", 1, 16, lambda: None)
    assert len(synced) == 2 and c.samples()[0].n == 2


@pytest.mark.parametrize("mode", ["dp", "tp"])
def test_the_binding_times_its_forwards_in_either_mode(mode):
    from flying.messages import Bind
    from tests.test_binding import make

    b, *_ = make()
    if mode == "tp":
        b.on_step([Bind(epoch=1, members=(0, 1))])
    b.around_forward(lambda runner, fb: None, None, {"tokens": [("r", 6, 6)]})
    st = b.status()
    assert st["device"] == "cpu" and [(s.mode, s.width, s.n) for s in st["step_costs"]] == [
        (mode, 1 if mode == "dp" else 2, 1)
    ]
