"""What a bind or release command does to an engine, decided from its switching state alone: the one rule the
worker's step boundary (:meth:`worker_ext.binding.Binding.on_step`) and the simulator's engine model
(:meth:`sim.simulator.Engine.command`) both apply. Pure: no SGLang, no Redis."""

from __future__ import annotations

from enum import Enum

from flying.messages import Bind, Command, Release


class Intake(Enum):
    IGNORE = "ignore"  # not for this engine, or already served
    BIND = "bind"  # a bind to enter at a step boundary (pending until then)
    WIDTH_CHANGE = "width_change"  # bound already: end this epoch, then enter the new one directly
    RELEASE = "release"  # end the current epoch
    CANCEL = "cancel"  # the router rolled back the pending bind before it was entered


def intake(cmd: Command, engine: int, last_epoch: int, epoch: int = 0, pending: int = 0) -> Intake:
    """``epoch``: the epoch the engine is bound in (0: DP); ``pending``: the bind it waits to enter (0: none);
    ``last_epoch``: the newest epoch it has served (a follower reads its stream only between epochs, so it can
    see a bind it has served again)."""
    if isinstance(cmd, Bind):
        if cmd.epoch <= last_epoch or engine not in cmd.members:
            return Intake.IGNORE
        return Intake.WIDTH_CHANGE if epoch and cmd.epoch != epoch else Intake.BIND
    if isinstance(cmd, Release):
        if epoch and cmd.epoch == epoch:
            return Intake.RELEASE
        if pending and cmd.epoch == pending:
            return Intake.CANCEL
    return Intake.IGNORE
