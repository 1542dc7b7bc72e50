"""One bound epoch of an engine: its group, its rank in it, and what the router asked of it since it bound.

The binding (``worker_ext.binding``) creates an ``Epoch`` when it binds and drops it when it leaves; the asks
arrive at step boundaries (``ask_release``, ``ask_width_change``) or from the forward hook (``fail``), and the
leader acts on them at its next clean step boundary (``next_action``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from flying.messages import Bind

if TYPE_CHECKING:
    from worker_ext.comm_pool import MergedGroup


class NotEntered(RuntimeError):
    """A bind's collective failed before anything moved into the group (the handshake, or the adoption's
    manifests): the engine's DP work is where it was, so the bind is undone and nothing is aborted."""


class Leave(Enum):
    """How a leader ends its epoch at a clean step boundary."""

    STAY = "stay"  # nothing asked, or not possible yet
    SCATTER = "scatter"  # every TP request continues in DP on its owner, KV moved
    RETRACT = "retract"  # the TP requests are recomputed in DP on the leader
    PARK = "park"  # those no member holds alone stay parked, KV kept; the rest scatter
    DRAINED = "drained"  # no TP request is left: release (or change width) at once


@dataclass
class Epoch:
    epoch: int
    members: tuple[int, ...]
    rank: int
    group: MergedGroup
    sp_threshold: int = 0  # steps of this many batched tokens run sequence-parallel (0: never)
    release_asked: bool = False
    retract: bool = False  # release at once: the TP requests are recomputed in DP on the leader
    scatter: bool = False  # release at once: the TP requests go back to DP on their owners with their KV
    park: bool = False  # release at once: as scatter, and those no member holds alone are parked (KV kept)
    next_bind: Bind | None = None  # a width change: go straight to this group once released
    # the group broke mid-step (leader): end the epoch at the next boundary
    failed: BaseException | None = None

    @property
    def width(self) -> int:
        return len(self.members)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def ask_release(self, retract: bool = False, scatter: bool = False, park: bool = False) -> None:
        self.release_asked, self.retract, self.scatter, self.park = True, retract, scatter, park

    def ask_width_change(self, cmd: Bind) -> None:
        self.next_bind, self.release_asked = cmd, True

    def cancel_width_change(self) -> int:
        """The router rolled the width change back before the leader applied it: the current epoch still ends
        (its record was replaced by the new one's), back to DP. Returns the epoch rolled back."""
        if self.next_bind is None:
            raise RuntimeError("no width change to cancel")
        epoch, self.next_bind = self.next_bind.epoch, None
        return epoch

    @property
    def changing_to(self) -> int:
        """The epoch of the width change asked and not applied yet (0: none)."""
        return self.next_bind.epoch if self.next_bind is not None else 0

    def fail(self, exc: BaseException) -> None:
        if self.failed is None:
            self.failed = exc

    def next_action(self, live: bool, has_copies: bool) -> Leave:
        """What the leader does at a clean step boundary, given whether TP requests are live and whether it runs
        copies of other members' requests."""
        if not self.release_asked:
            return Leave.STAY
        if not live:
            return Leave.DRAINED
        adopting = self.next_bind is not None and self.next_bind.adopt
        if self.park and self.next_bind is None:
            return Leave.PARK
        if self.scatter or (self.retract and has_copies) or adopting:
            return Leave.SCATTER
        if self.retract:
            return Leave.RETRACT
        return Leave.STAY
