"""The command intake rule both the worker and the simulator apply."""

from __future__ import annotations

import pytest

from flying.messages import Bind, Release
from worker_ext.intake import Intake, intake

BIND5 = Bind(epoch=5, members=[0, 1])


@pytest.mark.parametrize(
    ("cmd", "engine", "last", "epoch", "pending", "want"),
    [
        (BIND5, 0, 0, 0, 0, Intake.BIND),
        (BIND5, 1, 0, 0, 0, Intake.BIND),
        (BIND5, 2, 0, 0, 0, Intake.IGNORE),  # not a member
        (BIND5, 0, 5, 0, 0, Intake.IGNORE),  # served already (a follower re-reading its stream)
        (BIND5, 0, 4, 4, 0, Intake.WIDTH_CHANGE),  # bound in 4: end it, enter 5 directly
        (Release(epoch=4), 0, 4, 4, 0, Intake.RELEASE),
        (Release(epoch=3), 0, 4, 4, 0, Intake.IGNORE),  # an older epoch's
        (Release(epoch=5), 0, 0, 0, 5, Intake.CANCEL),  # rolled back before it was entered
        (Release(epoch=5), 0, 0, 0, 0, Intake.IGNORE),
    ],
)
def test_intake(cmd, engine, last, epoch, pending, want):
    assert intake(cmd, engine, last, epoch, pending) is want
