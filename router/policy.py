"""The bind/release policy (paper section 5): a pure, deterministic function of a cluster snapshot -> decisions.

No Redis, no clocks, no randomness: the live router (router.dispatcher), the unit tests and the simulator
(sim.simulator) all call :func:`decide` with a :class:`Snapshot` and apply the :class:`Decision` it returns.

The three use cases, each switchable in :class:`PolicyConfig`:

- *load adaptation*: after ``calm_s`` of light load engines bind into ``light_width`` groups (by default the whole
  node: a group's large steps run sequence-parallel, its small ones TP) and normal traffic goes to them. A group
  bound narrower (a priority group, or a block that could bind before the rest drained) is released by scatter
  once the ``light_width`` block around it could bind whole ("widening"). Light and busy are judged (``regime``) by demand (queued + inflight against
  ``light_load`` / ``busy_load`` of the groups' capacity, ``tp_inflight_per_engine`` per engine) or by the admission
  rate per engine (``light_rate`` / ``busy_rate``, an exponential average over ``rate_tau_s``), which sees a burst
  begin and end at once while demand lags behind its backlog. An idle block binds at once. A busy one binds at
  once with its DP work *kept* running beside the group's steps where every member runs mixed steps
  (``mixed_steps``; no live worker does yet, the simulator models it), else by *adoption* where every member transforms KV (``kv_transform``) and the transformation is cheap
  (``adopt_max_ms``; members holding at most ``adopt_max_inflight`` requests each, a larger backlog stays in DP);
  otherwise it drains first (sequential: it gets no new work, at most half of the blocks still in DP drain at a
  time), so nothing is paused or recomputed. With ``drain_inflight`` set, a block whose members hold more than that
  many requests each (a burst's backlog) stays in DP, which decodes it faster, while one ``drain_width`` block of
  its node binds for the new requests and is widened once the backlog has drained, or ``drain_s`` after load
  turned light. Under *pressure* (a normal request waited ``busy_wait_s``, or demand or
  rate above the busy threshold) load groups are released at once, by *scatter* (each TP request continues in DP on
  the engine that owns it, KV moved, no recompute) where the members transform KV, else by retraction (recomputed
  in DP on the leader), and everything runs DP until load is light again;
- *priority*: high-priority requests are placed before anything else. One goes to a group with room that forms
  at the next step boundary, else binds a ``priority_width`` group (``priority_preempt``, hard by default: the
  members' DP requests pause with their KV kept; by adoption where the members transform KV: they continue in the
  group) that leaves DP engines for everyone else: under light load the least loaded block, under pressure only an
  idle one (pausing busy engines costs more than the group saves), else it jumps the queue in DP;
- *long context*: a request whose prompt plus max tokens exceeds one engine's KV goes to the narrowest long group
  whose pooled KV holds it, or an idle group (re-labelled), or binds the smallest width that fits
  (``long_preempt``, sequential by default so the members' KV is free; hard only where their free KV holds it, and
  then by adoption where the members transform KV).
  One of normal priority first waits for calm (admissions within ``long_calm_rate``, small backlog, no other long request
  running), at most ``long_wait_s`` (:mod:`router.long_wait`); long groups hold at most ``long_max_share`` of the
  engines (one is always allowed). Where every engine parks (``park``, :mod:`router.parking`) it runs on a group of
  its own, at least ``long_min_width`` wide, which a burst *parks* (the long request stops with its KV where it is,
  the members serve the burst in DP) and calm resumes on the same members; it does not start during a burst
  (up to twice ``long_wait_s``). Elsewhere it runs on the widest group there is (the load group, or a bind as wide
  as the calm allows), and a group running a long request cannot be released: under busy load it keeps taking the
  work DP has no room for until the long request ends, as a group serving a high-priority one does anywhere.

KV transformation (Gyges-style) is used only where every member's heartbeat reports ``kv_transform`` and
``PolicyConfig.kv_transform`` is on (``flying-router --no-kv-transform``); otherwise every decision is as without it.
Its cost enters the decision: an adoption's stall is estimated from the members' KV in use (head slices of
``kv_bytes_per_token`` over ``kv_link_gbps`` plus ``kv_transform_fixed_ms``, :mod:`router.transform_cost`); above
``adopt_max_ms`` the block drains instead. A group bound by adoption pauses nothing, so ``max_defer_s`` does not
apply to it; its adopted requests stay owned by their members, so it is never released by retraction (only by
scatter, or by waiting). Hysteresis: light needs ``calm_s`` of light load, the thresholds leave a band between
light and busy, and a queue that only waits for load groups forming at their members' next step boundary is not
pressure. DP dispatch is least loaded, counting requests sent within about ``spread_s`` twice (an engine that
has just become free would otherwise take every new request at once); cache-aware
(``dispatch``) it follows the prompt's prefix (:func:`router.dp_dispatch.pick_dp`) to the engine whose cache probably
holds most of it (:mod:`router.prefix_index`, which the caller keeps), unless loads are out of balance. TP
dispatches ignore prefixes: a group's requests bypass the prefix cache.

Groups are reused (Gyges): the next high-priority or long request goes to a group that is already bound; priority
and long groups are released only after ``keep_s`` without TP work. DP work a bind pauses (hard preemption) waits at
most ``max_defer_s``: the group is then released by retraction (its requests continue in DP on the leader, unless
one needs the pooled KV), so the paused work resumes at the next step boundary.

Safety: every bind gets a fresh epoch (assigned by the caller), its record is written before its commands are sent,
members are picked only among engines in no group record, so groups never overlap and an engine is in at most one
epoch; members that do not acknowledge a bind within ``ack_timeout_s`` (or finish it within ``bind_timeout_s``)
roll it back with a release and are not picked for another bind for ``suspect_s``.
"""

from __future__ import annotations

import msgspec

from router import parking
from router.config import DispatchRule, PolicyConfig
from router.decision import Decision, Dispatch, DpRule
from router.engine_view import EngineView
from router.long_wait import forget_old
from router.placement import fast_targets, load_binds, need_width, place
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
    "PolicyConfig",
    "Snapshot",
    "decide",
    "need_width",
]


def decide(s: Snapshot, cfg: PolicyConfig) -> Decision:
    """One policy round: reconcile group records, update the load regime, release, bind, dispatch."""
    rnd = Round(s, cfg)
    reconcile(rnd)
    update_regime(rnd)
    rnd.out.state = msgspec.structs.replace(rnd.out.state, suspect=rnd.suspect)
    release_groups(rnd)
    parking.resume(rnd)
    forget_old(rnd)
    for r in s.waiting:  # high priority first, before load binds take the engines
        if r.priority == "high":
            place(rnd, r)
    load_binds(rnd)
    for r in s.waiting:
        if r.priority != "high":
            place(rnd, r)
    rnd.out.state = msgspec.structs.replace(rnd.out.state, recent=rnd.recent)
    rnd.out.fast = [] if rnd.out.binds or rnd.out.commands else fast_targets(rnd)  # a switch: the next round
    return rnd.out
