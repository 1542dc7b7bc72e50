"""When a long-context request runs, and on how wide a group (paper section 5, long context).

A request one engine's KV cannot hold needs a group for its whole prefill and decode, which a burst would miss. So
one of normal or low priority waits for calm (:func:`unrest`: the planner sees light load, the backlog is small, no
other long request runs), for at most ``long_wait_s``. Where engines park groups (router.parking) it then runs on a
group of its own at least ``LONG_MIN_WIDTH`` wide, which a burst parks and calm resumes; elsewhere on the widest
group there is (the load group, else the width its KV needs), kept through busy load until it ends. High priority
never waits and is never parked. Why a request waits, and why its wait ended, are decision-log notes
(:class:`router.decision.LongWaitNote`), once each.
"""

from __future__ import annotations

from flying.messages import Group, QueuedRequest
from router import parking, releases
from router.decision import LongWaitNote, ReleaseCause, WaitCause
from router.round import Round


def unrest(rnd: Round, request: str = "", turn: bool = True) -> WaitCause | None:
    """Why the load is not calm for a long request now (None: it is calm): the planner keeps every node in DP
    and some work is queued or running,
    more queued and inflight requests than the groups would hold (``tp_inflight_per_engine`` per engine: a burst's
    backlog), or another long request runs (one at a time keeps most of the node serving the rest)."""
    n = len(rnd.live)
    if rnd.out.state.busy and rnd.s.demand > 0:  # (an idle cluster is calm whatever the plan)
        return WaitCause.BUSY
    if rnd.s.demand > rnd.limits.tp_inflight_per_engine * n:
        return WaitCause.BACKLOG
    if turn and running_long(rnd, request):
        return WaitCause.TURN
    return None


def long_groups(rnd: Round) -> int:
    """Groups running a long request or about to: any group holding a request one engine cannot, a long group
    still binding, and the long (or resuming) binds of this round."""
    one = rnd.s.max_kv
    n = sum(
        1
        for g in rnd.groups.values()
        if (g.reason == "long" and g.state == "binding") or rnd.tp_max.get(g.epoch, 0) > one
    )
    return n + sum(1 for g in rnd.out.binds if g.reason == "long" or g.carries)


def running_long(rnd: Round, request: str = "") -> int:
    """Long requests running or about to: those in groups (:func:`long_groups`), parked, dispatched this round,
    and those whose wait ended but that are not placed yet."""
    one = rnd.s.max_kv
    n = long_groups(rnd)
    n += len(rnd.parked)  # parked (router.parking): each holds a long request that resumes
    placed = {x.request.id for x in rnd.out.dispatches}
    n += sum(1 for x in rnd.out.dispatches if x.request.kv_tokens > one)
    ended = rnd.out.state.long_waits
    return n + sum(1 for r in rnd.s.waiting if ended.get(r.id, 0.0) < 0 and r.id not in placed | {request})


def waits(rnd: Round, r: QueuedRequest) -> bool:
    """``r`` (a long request) waits this round: its priority is not high, the load is not calm and it has waited
    less than ``long_wait_s``. Notes the start of a wait and its end (calm, or the bound); a wait that ended does
    not begin again."""
    if r.priority == "high":
        return False
    noted = rnd.out.state.long_waits.get(r.id)
    waited = rnd.now - r.enqueued_at
    if (
        noted is not None and noted < 0
    ):  # its wait ended: it runs as soon as it can (not while busy: it would park)
        return parking.holds_off(rnd, r)
    cause = unrest(rnd, r.id)
    # (held off: calm by the long request's own measure while the regime is still busy, it would bind its group
    # and then be held, the group idle, until the regime turned light)
    if (cause is not None and waited < rnd.cfg.long_wait_s) or parking.holds_off(rnd, r):
        if noted is None:
            remember(rnd, r.id, rnd.now)
            why = cause or WaitCause.BUSY
            rnd.note(LongWaitNote(r.id, r.kv_tokens, why, rnd.cfg.long_wait_s, rnd.s.demand))
        return True
    end = WaitCause.BOUND if cause is not None else WaitCause.CALM
    remember(rnd, r.id, -rnd.now)
    if noted is not None:
        rnd.note(LongWaitNote(r.id, r.kv_tokens, end, rnd.cfg.long_wait_s, rnd.s.demand, waited))
    return False


def remember(rnd: Round, request: str, at: float) -> None:
    """Keep in the router's state that ``request`` waits for calm since ``at`` (negative: its wait ended then)."""
    waits = {**rnd.out.state.long_waits, request: at}
    rnd.update_state(long_waits=waits)


def forget_old(rnd: Round) -> None:
    """Drop the waits noted more than twice ``long_wait_s`` ago (the request has long been served or cancelled:
    a wait ends within ``long_wait_s``)."""
    waits, horizon = rnd.out.state.long_waits, rnd.now - 2 * rnd.cfg.long_wait_s
    if any(abs(t) < horizon for t in waits.values()):
        keep = {k: t for k, t in waits.items() if abs(t) >= horizon}
        rnd.update_state(long_waits=keep)


def make_room(rnd: Round, width: int) -> bool:
    """Load or priority groups hold every block of ``width``: release at once (by scatter, else retracting) those
    in the least loaded block whose groups are all bound, of those reasons, and can move to DP, so the long
    request binds there next. False if there is no such block."""
    group_of = {m: g for g in rnd.groups.values() for m in g.members}
    for ms in sorted(rnd.merge_sets(width), key=rnd.block_load):
        if any(m in rnd.reserved or rnd.live[m].pending for m in ms):
            continue
        inside: list[Group] = list({group_of[m].epoch: group_of[m] for m in ms if m in group_of}.values())
        if inside and all(
            g.state == "bound" and g.reason in ("load", "priority") and releases.retractable(rnd, g)
            for g in inside
        ):
            for g in inside:
                releases.release_now(rnd, g, ReleaseCause.MAKING_ROOM, width=width)
            return True
    return False


def resume_parked(rnd: Round) -> None:
    """The oldest parked group whose members are free binds again, in the same order, resuming its requests:
    in calm (:func:`unrest`) with no other long request running; or whatever the load once parked for
    ``long_wait_s``, or where a waiting request can be served nowhere else (:func:`router.parking.blocked`),
    and then never parked again. Idle members bind at once, busy ones by adoption where they may, else drain."""
    # (calm is the planner's: without load adaptation, parked groups are the operator's to resume)
    calm = rnd.cfg.on("load") and not rnd.out.state.busy and unrest(rnd, turn=False) is None
    resuming = any(g.carries and g.state == "binding" for g in rnd.groups.values())
    taken, stuck = rnd.in_groups(), not resuming and parking.blocked(rnd)
    for g in sorted(rnd.parked.values(), key=lambda g: g.epoch):
        overdue = rnd.now - g.since >= rnd.cfg.long_wait_s
        forced = stuck and not overdue
        if not (overdue or forced) and (not calm or long_groups(rnd)):
            continue  # (a long request's calm: stricter than light load, so a resume does not meet the next burst;
            # one long group at a time: the others stay parked until it ends)
        ms = g.members
        if any(
            m not in rnd.live
            or rnd.live[m].mode != "dp"
            or rnd.live[m].pending
            or m in taken
            or m in rnd.suspect
            for m in ms
        ):  # (a member distrusted after a failed bind, the resume's included, is not asked again meanwhile)
            continue
        own = rnd.s.tp_load.get(g.epoch)  # (its parked requests sit in their owners' inflight sets)
        busy = rnd.block_load(ms) - (own.inflight if own else 0) > 0
        adopt = busy and rnd.kv.may_adopt(ms)
        rnd.drop(g)
        rnd.bind(
            ms,
            g.reason,
            "sequential" if busy and not adopt else "hard",
            adopt=adopt,
            carries=(*g.carries, g.epoch),
            hold=overdue or forced,
        )
        taken, stuck = rnd.in_groups(), stuck and not forced
