"""The policy settings the policy's unit tests are written against: the demand (inflight) regime with small
capacities, so a handful of requests in a snapshot is light or busy load. (The live and simulated default,
:class:`router.config.PolicyConfig`, judges load by the admission rate.)"""

from __future__ import annotations

import dataclasses

from router.config import PolicyConfig

UNIT_POLICY = PolicyConfig(
    regime="inflight",
    light_width=2,
    max_inflight_per_worker=32,
    spread_s=0.0,
    tp_inflight_per_engine=4,
    sp_inflight_per_engine=4,  # a load group takes as many as any other (tests/test_round.py: more)
    light_load=0.5,
    calm_s=2.0,
    busy_load=1.0,
    rate_tau_s=2.0,
    busy_wait_s=0.25,
    adopt_max_inflight=64,
    long_preempt="sequential",  # the tests of long binds were written against draining first
)


def unit_policy(**changes: object) -> PolicyConfig:
    """:data:`UNIT_POLICY` with ``changes``."""
    return dataclasses.replace(UNIT_POLICY, **changes)  # type: ignore[arg-type]
