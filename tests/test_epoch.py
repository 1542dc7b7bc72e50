"""What a bound leader does at a clean step boundary (worker_ext.epoch.Epoch.next_action)."""

from __future__ import annotations

import pytest

from flying.messages import Bind
from worker_ext.epoch import Epoch, Leave


def epoch(**asks) -> Epoch:
    e = Epoch(1, (0, 1), 0, group=None)
    if asks.pop("width", False):
        e.ask_width_change(Bind(epoch=2, members=(0, 1, 2, 3), adopt=asks.pop("adopt", False)))
    elif asks.pop("release", True):
        e.ask_release(**asks)
    return e


@pytest.mark.parametrize(
    ("asks", "live", "copies", "action"),
    [
        ({"release": False}, True, False, Leave.STAY),
        ({}, True, False, Leave.STAY),  # a plain release waits for the TP requests to finish
        ({}, False, False, Leave.DRAINED),
        ({"retract": True}, True, False, Leave.RETRACT),
        ({"retract": True}, True, True, Leave.SCATTER),  # copies cannot be recomputed here: they go home
        ({"scatter": True}, True, False, Leave.SCATTER),
        ({"scatter": True}, False, False, Leave.DRAINED),
        ({"width": True}, True, False, Leave.STAY),
        ({"width": True, "adopt": True}, True, False, Leave.SCATTER),
        ({"width": True}, False, False, Leave.DRAINED),
    ],
)
def test_next_action(asks, live, copies, action):
    assert epoch(**asks).next_action(live, copies) is action


def test_the_first_failure_is_kept():
    e = epoch(release=False)
    first = RuntimeError("first")
    e.fail(first)
    e.fail(RuntimeError("second"))
    assert e.failed is first and e.leader and e.width == 2
