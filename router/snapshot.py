"""The policy's input: one :class:`Snapshot` of the cluster (queue head, live engines, group records, regime)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from flying.cost_model import H200_LLAMA70B, CostModel
from flying.messages import Group, QueuedRequest, RouterState
from router.config import Limits
from router.engine_view import EngineView
from router.prefix_index import PrefixIndex


@dataclass(frozen=True)
class GroupLoad:
    """TP requests assigned to one group (epoch) and not finished."""

    inflight: int = 0
    kv_tokens: int = 0
    max_kv_tokens: int = 0  # the largest one's (a request one engine cannot hold cannot be retracted to DP)


@dataclass(frozen=True)
class Snapshot:
    now: float
    waiting: Sequence[QueuedRequest]  # the head of the queue in dispatch order (priority class, then arrival)
    queued: int  # the whole queue's depth
    engines: Sequence[EngineView]  # live engines only
    groups: Sequence[Group]  # the router's group records
    tp_load: Mapping[int, GroupLoad] = field(default_factory=dict)
    state: RouterState = field(default_factory=RouterState)
    admitted: int = 0  # requests admitted so far (a monotonic counter; the planner's arrival rate) ...
    prompt_tokens: int = 0  # ... their prompt tokens ...
    output_tokens: int = 0  # ... their max_tokens ...
    admitted_high: int = 0  # ... and those of high priority
    cost: CostModel = H200_LLAMA70B  # the engines' step times, as the planner predicts them
    sp_threshold: int = 256  # the workers' SP threshold (batched tokens), where binds do not set one
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)  # read only: the caller syncs and records
    # (prompt tokens dispatched, those a cache of their node could have held) since the router started (router.reuse)
    reuse: tuple[int, int] = (0, 0)
    # engine -> the parked epochs it holds, for every live engine, a dispatchable one or not (None: ``engines``')
    held: Mapping[int, tuple[int, ...]] | None = None
    probe: Mapping[str, int] = field(default_factory=dict)  # node -> the width an idle probe plans it at
    # engines running a suspect request (an engine died holding it: flying:suspects): they take no other
    suspect_holders: frozenset[int] = frozenset()
    limits: Limits = field(default_factory=Limits)  # what the engines and the bind protocol allow

    @cached_property
    def parked_held(self) -> Mapping[int, tuple[int, ...]]:
        """Every live engine's parked epochs (an engine whose breaker is open still holds its KV)."""
        return self.held if self.held is not None else {e.engine: e.parked for e in self.engines}

    @cached_property
    def demand(self) -> int:
        """Queued and inflight requests, less those parked (router.parking): no engine can run them until their
        group resumes, which waits for calm."""
        parked = sum(
            self.tp_load[g.epoch].inflight
            for g in self.groups
            if g.state == "parked" and g.epoch in self.tp_load
        )
        # (never below the queue: an engine whose breaker is open is not in ``engines``, its parked requests are
        # in ``tp_load``)
        return self.queued + max(0, sum(e.inflight for e in self.engines) - parked)

    @cached_property
    def max_kv(self) -> int:
        """The largest engine's KV in tokens (-1: no engine)."""
        return max((e.max_total_tokens for e in self.engines), default=-1)

    @cached_property
    def too_long_at(self) -> list[int]:
        """Positions in ``waiting`` of the requests no one engine's KV holds (they wait for groups of their own)."""
        cap = self.max_kv
        return [i for i, r in enumerate(self.waiting) if r.prompt_tokens + r.n * r.max_tokens > cap]

    @cached_property
    def too_long(self) -> list[QueuedRequest]:
        """The waiting requests no one engine's KV holds."""
        return [self.waiting[i] for i in self.too_long_at]

    def fits_one(self, r: QueuedRequest) -> bool:
        """One engine's KV holds ``r``."""
        return r.kv_tokens <= self.max_kv

    def dp_fit(self, r: QueuedRequest) -> bool:
        """``r`` is normal work DP serves (not high priority, and one engine holds it)."""
        return r.priority != "high" and self.fits_one(r)
