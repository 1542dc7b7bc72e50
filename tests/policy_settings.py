"""The policy settings the policy's unit tests are written against: small capacities and groups of two, so a
handful of requests in a snapshot fills them."""

from __future__ import annotations

import dataclasses

from flying.messages import RouterState
from router.config import MANUAL_OFF, Limits, PolicyConfig

UNIT_POLICY = PolicyConfig(max_width=2)
UNIT_LIMITS = Limits(
    max_inflight_per_worker=32,
    tp_inflight_per_engine=4,
    sp_inflight_per_engine=4,  # a load group takes as many as any other (tests/test_round.py: more)
    adopt_max_inflight=64,
)
# no automatic groups: DP dispatch alone
DP_ONLY = PolicyConfig(off=MANUAL_OFF)


def unit_policy(**changes: object) -> PolicyConfig:
    """:data:`UNIT_POLICY` with ``changes``."""
    return dataclasses.replace(UNIT_POLICY, **changes)  # type: ignore[arg-type]


def unit_limits(**changes: object) -> Limits:
    """:data:`UNIT_LIMITS` with ``changes``."""
    return dataclasses.replace(UNIT_LIMITS, **changes)  # type: ignore[arg-type]


def off(*mechanisms: str, base: PolicyConfig = UNIT_POLICY) -> PolicyConfig:
    """``base`` without ``mechanisms``."""
    return dataclasses.replace(base, off=base.off | frozenset(mechanisms))  # type: ignore[arg-type]


def planned(width: int, now: float = 100.0, nodes: tuple[str, ...] = ("0",), **kw: object) -> RouterState:
    """A router state whose planner chose ``width`` for ``nodes`` at ``now`` (rounds within
    ``router.regime.PLAN_EVERY_S`` keep it): 1 is DP everywhere (busy), 2 or more binds load groups (light)."""
    return RouterState(busy=width == 1, widths=dict.fromkeys(nodes, width), planned_at=now, **kw)  # type: ignore[arg-type]


LIGHT = planned(2)
BUSY = planned(1)
# light by the planner's verdict, but no load groups (max_width 1, or load adaptation off): priority groups form
LIGHT_NO_LOAD = RouterState(busy=False, widths={"0": 1}, planned_at=100.0)
