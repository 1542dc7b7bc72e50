"""The bind/release policy: a pure, deterministic function of a cluster snapshot -> decisions.

No Redis, no clocks, no randomness: the live router (router.dispatcher), the unit tests and the simulator
(sim.simulator) all call :func:`decide` with a :class:`Snapshot` and apply the :class:`Decision` it returns.

A round: reconcile the group records with the heartbeats (:mod:`router.releases`); plan each node's load width from
the cost model's predictions (:mod:`router.regime`, :mod:`router.planner`); release the groups the plan or their
idleness no longer justifies; resume parked groups (:mod:`router.parking`); place high-priority requests (a group
with room, or a group of two); bind the planned load groups (:mod:`router.placement`); place the rest:
long-context requests on a group whose pooled KV holds them, after waiting for calm (:mod:`router.long_wait`),
normal ones in a load group or in DP (:mod:`router.dp_dispatch`). docs/architecture.md, "The policy", has the
whole round.

KV transformation (adopt at a bind, scatter at a release) is used only where every member's heartbeat reports
``kv_transform`` and the policy uses it (``PolicyConfig.off``); its stall comes from the cost model
(:mod:`router.transform_cost`). Safety: every bind gets a fresh epoch (assigned by the caller), its record is
written before its commands are sent, groups never overlap, and members that do not acknowledge a bind within
``Limits.ack_timeout_s`` (or finish it within ``bind_timeout_s``) roll it back and are left out of binds for
``suspect_s``.
"""

from __future__ import annotations

from router import long_wait
from router.config import DispatchRule, Limits, PolicyConfig
from router.decision import Decision, Dispatch, DpRule
from router.engine_view import EngineView
from router.long_wait import forget_old
from router.placement import fast_targets, load_binds, need_width, place, place_rest
from router.regime import update as update_regime
from router.releases import reconcile, release_groups
from router.round import Round
from router.snapshot import GroupLoad, Snapshot

__all__ = [
    "Decision",
    "Dispatch",
    "DispatchRule",
    "DpRule",
    "EngineView",
    "GroupLoad",
    "Limits",
    "PolicyConfig",
    "Snapshot",
    "decide",
    "need_width",
]


def decide(s: Snapshot, cfg: PolicyConfig) -> Decision:
    """One policy round: reconcile group records, update the load regime, release, bind, dispatch (within the
    snapshot's :class:`Limits`)."""
    rnd = Round(s, cfg)
    reconcile(rnd)
    update_regime(rnd)
    rnd.update_state(suspect=rnd.suspect)
    release_groups(rnd)
    long_wait.resume_parked(rnd)
    forget_old(rnd)
    for r in s.waiting:  # high priority first, before load binds take the engines
        if r.priority == "high":
            place(rnd, r)
    load_binds(rnd)
    place_rest(rnd)
    rnd.update_state(recent=rnd.recent)
    rnd.set_fast([] if rnd.out.binds or rnd.out.commands else fast_targets(rnd))  # a switch: the next round
    return rnd.out
