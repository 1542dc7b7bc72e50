"""Which groups a round releases, and how (paper section 5; the causes: :class:`router.decision.ReleaseCause`).

:func:`reconcile` moves records along with the members' heartbeats (a group forms, a release completes, a bind
times out or breaks up); :func:`release_groups` ends the groups the regime or their idleness no longer justifies;
:func:`release_idle_blocking` clears a block for a long-context group. A release is sent at once (by scatter, else
by retraction) where that loses nothing, else it waits for the group's TP requests (:func:`release_now`).
"""

from __future__ import annotations

from flying.messages import Group
from router import parking
from router.decision import DistrustNote, ReleaseCause, ReleaseMode
from router.engine_view import EngineView
from router.round import Round, replace_group

# seconds: a priority or long-context group without TP work for this long is released (a request that follows
# within it finds the group still bound)
KEEP_S = 1.0


def reconcile(rnd: Round) -> None:
    """Move records along with what the engines' heartbeats say."""
    for g in list(rnd.groups.values()):
        beats = [rnd.live.get(m) for m in g.members]
        age = rnd.now - g.since
        if g.state == "releasing":
            if all(
                b is None or (b.epoch != g.epoch and b.pending != g.epoch and b.beat_ts >= g.since)
                for b in beats
            ):
                if g.park:
                    parking.settle(rnd, g)  # its parked requests keep the record until they resume
                else:
                    rnd.drop(g)
                    if g.carries and g.carries[-1] not in rnd.parked:
                        parking.unresumed(rnd, g)  # (a resume rolled back: its requests stay parked)
            continue
        present = [b for b in beats if b is not None]
        if len(present) < len(beats):
            rnd.release(g, ReleaseCause.MEMBER_GONE)
        elif g.state == "binding":
            if all(b.epoch == g.epoch for b in present):
                rnd.put(replace_group(g, state="bound", since=rnd.now, last_used=rnd.now))
            elif age > rnd.limits.ack_timeout_s and (
                silent := [
                    b.engine
                    for b in present
                    if g.epoch not in (b.epoch, b.pending) and not changing(rnd, b, g)
                ]
            ):
                rnd.release(
                    g, ReleaseCause.NOT_ACKNOWLEDGED, seconds=rnd.limits.ack_timeout_s, engines=tuple(silent)
                )
                distrust(rnd, silent)
            elif age > rnd.limits.bind_timeout_s:
                rnd.release(g, ReleaseCause.NOT_BOUND, seconds=rnd.limits.bind_timeout_s)
                distrust(rnd, [b.engine for b in present if b.epoch != g.epoch])
        elif any(b.epoch != g.epoch for b in present):
            rnd.release(g, ReleaseCause.BROKE_UP)
    unknown_epochs(rnd)
    distrust_paused(rnd)
    parking.reconcile(rnd)


def changing(rnd: Round, b: EngineView, g: Group) -> bool:
    """``b`` is bound in a group whose leader has read ``g``'s bind as a width change: it ends its epoch (and
    ``b`` follows it into ``g``) once that epoch's TP requests allow, up to ``bind_timeout_s``; a follower reads
    no commands meanwhile, so its leader's acknowledgement is its own."""
    leader = rnd.live.get(b.group[0]) if b.epoch and b.group else None
    return leader is not None and leader.epoch == b.epoch and leader.pending == g.epoch


def unknown_epochs(rnd: Round) -> None:
    """Engines bound in an epoch that no record knows are released from it at once: a bind that reached them
    after its record was rolled back (a member that entered it late, say once a width change had waited for its
    TP requests) would otherwise keep them in a group nobody dispatches to, every request waiting for DP room
    until its queue timeout. The release is recorded, so the record goes once they have left."""
    binding = {m for g in rnd.groups.values() if g.state == "binding" for m in g.members}
    bound: dict[int, list[EngineView]] = {}
    for e in rnd.live.values():
        if e.epoch and e.epoch not in rnd.groups and e.epoch not in rnd.parked:
            leader = rnd.live.get(e.group[0]) if e.group else e
            if e.engine in binding or (e.group and e.group[0] in binding):
                continue  # a width change under way (`flyctl bind` replaced the old record by the new one)
            if leader is not None and leader.pending in rnd.groups:
                continue  # (the same, its leader has read it)
            bound.setdefault(e.epoch, []).append(e)
    for epoch, engines in sorted(bound.items()):
        members = engines[0].group or tuple(sorted(e.engine for e in engines))
        g = Group(
            epoch=epoch, members=members, reason="manual", state="bound", since=rnd.now, last_used=rnd.now
        )
        rnd.put(g)
        if all(m in rnd.live for m in members):
            release_now(rnd, g, ReleaseCause.UNKNOWN_EPOCH)
        else:  # a member is gone (or its breaker is open), maybe its leader: a plain release to them all
            rnd.release(g, ReleaseCause.UNKNOWN_EPOCH)


def distrust(rnd: Round, engines: list[int], paused: int = 0) -> None:
    """Members that failed a bind are left out of binds for ``suspect_s`` (retrying at once would stall the
    requests waiting for a group again); they keep serving DP. ``paused``: the DP requests their adoption paused."""
    rnd.distrust(tuple(engines))
    rnd.note(DistrustNote(tuple(engines), rnd.limits.suspect_s, paused))


def distrust_paused(rnd: Round) -> None:
    """A group bound by adoption whose members report paused DP work (the adoption could not move it: the workers
    bound hard instead) is a hard bind's: released after ``max_defer_s`` (:meth:`Round.paused_dp`). Its members are
    distrusted, so that the released block does not adopt again at once and pause the same work again."""
    for g in rnd.groups.values():
        if g.adopt and g.state == "bound":
            paused = [m for m in g.members if m in rnd.live and rnd.live[m].paused and m not in rnd.suspect]
            if paused:
                distrust(rnd, paused, sum(rnd.live[m].paused for m in paused))


def retractable(rnd: Round, g: Group) -> bool:
    """The group's requests can continue in DP on its leader (none needs the group's pooled KV)."""
    return rnd.tp_max.get(g.epoch, 0) <= min(rnd.live[m].max_total_tokens for m in g.members)


def release_now(rnd: Round, g: Group, cause: ReleaseCause, seconds: float = 0.0, width: int = 0) -> None:
    """Release at once: by scatter where the members transform KV (each TP request continues in DP on its
    owner, KV moved, no recompute), else by retraction (recomputed in DP on the leader); a group holding a
    request that needs the pooled KV is parked where its members park (router.parking), else it waits for its
    TP requests, as does one bound by adoption whose members cannot scatter (its adopted requests' streams are on
    their owners, not on the leader)."""
    if not retractable(rnd, g):
        park(rnd, g, cause, parking.release_mode(rnd, g), seconds, width)
    elif rnd.kv.possible(g.members):
        rnd.release(g, cause, ReleaseMode.SCATTER, seconds, width=width)
    else:
        mode = ReleaseMode.WAIT if g.adopt else ReleaseMode.RETRACT
        rnd.release(g, cause, mode, seconds, width=width)


def park(
    rnd: Round, g: Group, cause: ReleaseCause, mode: ReleaseMode, seconds: float = 0.0, width: int = 0
) -> None:
    """Release ``g`` in ``mode``; parking, its record notes it (its parked requests keep it once released)."""
    if mode is ReleaseMode.PARK:
        g = replace_group(g, park=True)
    rnd.release(g, cause, mode, seconds, width=width)


def release_groups(rnd: Round) -> None:
    """Load groups go when the planner changes their node's width; a group that pauses DP work goes after ``max_defer_s``; a priority
    or long group without TP work for ``KEEP_S`` goes (one of its node's planned width is kept as a load
    group instead). Operator (manual) groups stay."""
    busy, cfg, s = rnd.out.state.busy, rnd.cfg, rnd.s
    queued_dp = any(s.dp_fit(r) for r in s.waiting)
    queued_tp = any(  # requests that would go to a group: an idle one is not released under them
        (r.priority == "high" and cfg.on("priority")) or not s.fits_one(r) for r in s.waiting
    )
    for g in list(rnd.groups.values()):
        if g.state == "releasing" or g.reason == "manual":
            continue
        if g.reason in ("load", "long") and not retractable(rnd, g) and not rnd.paused_dp(g):
            if busy and g.state == "bound" and parking.can_park(rnd, g) and parking.surge(rnd):
                # the burst runs in DP; it resumes after
                park(rnd, g, ReleaseCause.LOAD_ROSE, ReleaseMode.PARK)
            continue  # it serves a long request (router.long_wait): it stays, taking work, until that ends (one
            # that pauses DP work is released after max_defer_s as any, and ends when the long request does)
        tp_busy = rnd.group_n(g) > 0
        if tp_busy and g.state == "bound" and rnd.now - g.last_used > 0.5:
            # in use, maybe by fast-path requests the round never placed
            g = replace_group(g, last_used=rnd.now)
            rnd.put(g)
        if g.reason == "load" and (planned := planned_width(rnd, g)) != g.width:
            # its requests continue in DP (scattered to their owners, or retracted to the leader), unless one
            # of them needs the group's pooled KV; a width change binds the node again at the new width
            if planned == 1:
                release_now(rnd, g, ReleaseCause.LOAD_ROSE)
            else:
                release_now(rnd, g, ReleaseCause.WIDENING, width=planned)
        elif (
            g.state == "bound"
            and rnd.now - g.since >= rnd.limits.max_defer_s
            and (rnd.paused_dp(g) > 0 or (busy and queued_dp))
        ):
            # paused DP work resumes now: the group's requests continue in DP (unless one of them needs the
            # group's pooled KV); DP work that only queues waits for the group's requests instead, unless they
            # can move to their owners by scatter (no recompute)
            why, after = ReleaseCause.DP_DEFERRED, rnd.limits.max_defer_s
            if rnd.paused_dp(g) > 0 or rnd.kv.possible(g.members):
                release_now(rnd, g, why, seconds=after)
            else:
                rnd.release(g, why, seconds=after)
        elif g.state == "bound" and (block := widen_block(rnd, g)) is not None:
            release_now(rnd, g, ReleaseCause.WIDENING, width=len(block))
        elif g.state == "bound" and not tp_busy and not queued_tp and rnd.now - g.last_used >= KEEP_S:
            if g.width == planned_width(rnd, g) and rnd.cfg.on("load") and not rnd.paused_dp(g):
                rnd.put(replace_group(g, reason="load"))  # light load: keep it, as a load group
            else:  # (not a load group's width, or a long group, or paused DP work beside it)
                rnd.release(g, ReleaseCause.NO_TP_WORK, seconds=KEEP_S)


def planned_width(rnd: Round, g: Group) -> int:
    """The load width the planner chose for ``g``'s node this round (1: DP; a group whose leader is gone: its own)."""
    leader = rnd.live.get(g.leader)
    return g.width if leader is None else rnd.load_width(leader.pool)


def widen_block(rnd: Round, g: Group) -> tuple[int, ...] | None:
    """The planned-width block around priority group ``g`` (narrower than that) whose other engines are DP and
    free, or in such narrower groups, and whose work the wide group can adopt at once (every member transforms KV,
    at most ``tp_inflight_per_engine`` requests a member): releasing ``g`` by scatter lets the next rounds bind
    the block at the planned width. None if there is no such block."""
    width = planned_width(rnd, g)
    if g.reason != "priority" or g.width >= width or rnd.paused_dp(g) or not rnd.cfg.on("load"):
        return None
    block = next((ms for ms in rnd.merge_sets(width) if set(g.members) <= set(ms)), None)
    if block is None or not all(m in rnd.live for m in block) or not rnd.kv.possible(block):
        return None
    inside = {x.epoch: x for x in rnd.groups.values() if set(x.members) & set(block)}
    for x in inside.values():
        if not set(x.members) <= set(block) or x.reason not in ("load", "priority") or x.state != "bound":
            return None
        if rnd.paused_dp(x) or not retractable(rnd, x):
            return None
    grouped = {m for x in inside.values() for m in x.members}
    for m in set(block) - grouped:
        e = rnd.live[m]
        if e.mode != "dp" or e.pending or m in rnd.reserved or m in rnd.suspect:
            return None
    load = sum(rnd.dp_inflight[m] for m in set(block) - grouped) + sum(
        rnd.group_n(x) for x in inside.values()
    )
    return block if load <= rnd.limits.tp_inflight_per_engine * width else None


def release_idle_blocking(rnd: Round, width: int) -> None:
    """A long request needs ``width`` engines but groups occupy every block: release the idle ones in one. (A
    width with no such block this round has none for the round's later requests either.)"""
    if width in rnd.no_idle_block:
        return
    group_of = {m: g for g in rnd.groups.values() for m in g.members}
    order = {ep: i for i, ep in enumerate(rnd.groups)}
    for ms in rnd.merge_sets(width):  # (any node's)
        inside = sorted({group_of[m] for m in ms if m in group_of}, key=lambda g: order[g.epoch])
        if all(g.state == "bound" and g.reason != "manual" and not rnd.group_n(g) for g in inside):
            for g in inside:
                rnd.release(g, ReleaseCause.MAKING_ROOM, width=width)
            return
    rnd.found_no_idle_block(width)
