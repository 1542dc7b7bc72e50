"""The router's stall watchdog: requests wait or run, and nothing moves.

Every request in Redis moves through counters of ``flying:stats``: assigned (by a round or the admission fast
path), then completed, failed or cancelled, or requeued; while it runs, its engine's free KV (heartbeat) changes
with every prefill chunk and every page of decoded tokens. While requests are queued or in flight, one of them moves
within seconds on a working cluster, even one running a single long generation; when none has moved for
``stall_s`` the cluster is stalled (nothing dispatched, or every assigned request held without progress: a group
that never releases, work paused and never resumed, every engine's breaker open), and the router says so instead of
hanging silently: one WARNING with what it sees when the stall begins, one when things move again, and the
``flying_router_stalled`` gauge in between.

:class:`Watchdog` is pure (times and counts are passed in); :mod:`router.dispatcher` reads its input from Redis
every few seconds while it leads.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

# the flying:stats counters a request moves
MOVES = (
    "assigned",
    "completed",
    "failed",
    "cancelled",
    "requeued",
)


@dataclass(frozen=True)
class Progress:
    """One reading: the requests ``queued`` and ``inflight`` (per engine), ``moved``, the sum of the :data:`MOVES`
    counters (it changes whenever a request is assigned, ends or is re-queued), and ``kv``, the live engines' free
    KV tokens (they change while an engine prefills or decodes)."""

    queued: int
    inflight: dict[int, int]
    moved: int
    kv: tuple[int, ...] = ()

    @property
    def pending(self) -> int:
        return self.queued + sum(self.inflight.values())


class Change(Enum):
    STALLED = "stalled"
    RESUMED = "resumed"


@dataclass(frozen=True)
class StallEvent:
    """A stall began (``STALLED``: nothing moved for ``seconds`` while ``progress.pending`` requests waited or ran)
    or ended (``RESUMED``, after ``seconds``)."""

    change: Change
    seconds: float
    progress: Progress

    def __str__(self) -> str:
        p = self.progress
        if self.change is Change.RESUMED:
            return f"requests move again after a stall of {self.seconds:.0f} s"
        inflight = " ".join(f"{e}:{n}" for e, n in sorted(p.inflight.items()) if n)
        return (
            f"stalled: no request assigned, finished or re-queued, and no engine's KV changed, for "
            f"{self.seconds:.0f} s while "
            f"{p.queued} wait in the queue and {sum(p.inflight.values())} are in flight ({inflight or 'none'})"
        )


class Watchdog:
    """Tracks when the :data:`MOVES` counters last moved while requests were pending. ``stall_s`` <= 0: off."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self._marks: tuple[int, tuple[int, ...]] | None = None  # moved and kv when last seen
        self._since = 0.0  # when they last moved, or when requests became pending
        self.stalled = False

    def observe(self, now: float, p: Progress) -> StallEvent | None:
        """One reading at ``now``: a :class:`StallEvent` when a stall begins or ends, else None."""
        if self.stall_s <= 0:
            return None
        marks = (p.moved, p.kv)
        if marks != self._marks or p.pending == 0:
            event = StallEvent(Change.RESUMED, now - self._since, p) if self.stalled else None
            self._marks, self._since, self.stalled = marks, now, False
            return event
        if not self.stalled and now - self._since >= self.stall_s:
            self.stalled = True
            return StallEvent(Change.STALLED, now - self._since, p)
        return None
