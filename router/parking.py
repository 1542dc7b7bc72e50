"""Parked groups: a long-context request set aside for a burst, its KV kept where it is (paper section 5, long
context; the mechanism: ``Release.park`` and ``Bind.resume``, worker_ext.parking).

A group running a request no engine holds alone can be released neither by scatter nor by retraction, so under
busy load it used to serve through the burst until that request ended, leaving the burst fewer DP engines. Where
every member reports ``park``, such a group is *parked* instead (:func:`release_mode`): its other requests
scatter to their owners, the long ones stay where they are (their KV head slices on every member, no steps), and
the members serve the burst in DP. The group's record stays, in state ``parked``, while the members report the
parked epoch; its members bind into no other group meanwhile. Once load is light again the same members bind in
the same order with ``Bind.resume`` (:func:`router.long_wait.resume_parked`), and the parked requests continue where they stopped.

A member that is gone, or no longer reports the parked epoch (restarted: its slices are lost), ends them: the
survivors get the epoch's release, which aborts the parked requests and frees their KV (:func:`reconcile`). So do
parked requests whose clients all left (:func:`left`).
"""

from __future__ import annotations

from flying.groups import widths
from flying.messages import Group, QueuedRequest, Release
from router.decision import ReleaseCause, ReleaseMode, ReleaseNote
from router.round import Round, replace_group


def counts_toward(g: Group, epoch: int, kv_tokens: int, one: int) -> bool:
    """A request dispatched in ``epoch`` with ``kv_tokens`` is one of ``g``'s TP requests: dispatched to ``g``
    (not parked), or parked in an epoch ``g`` is (its record parked) or carries. Of a parked epoch only those no
    engine holds alone (more KV than ``one`` engine's) count: the park kept those, the epoch's other requests were
    scattered back to DP on their owners (worker_ext.parking picks by the same measure)."""
    if epoch == g.epoch and g.state != "parked":
        return True
    return (epoch == g.epoch or epoch in g.carries) and kv_tokens > one


def can_park(rnd: Round, g: Group) -> bool:
    """``g``'s members all park (``Release.park``) and transform KV (its other requests scatter), the policy
    parks, and ``g`` serves no high-priority request no engine holds alone (that one runs on: parking it would cost
    it the burst's length) nor one resumed after ``long_wait_s`` parked."""
    return (
        rnd.cfg.on("park")
        and not g.hold
        and all(m in rnd.live and rnd.live[m].park for m in g.members)
        and rnd.kv.possible(g.members)
    )


def surge(rnd: Round) -> bool:
    """A burst: the planner predicts no node to serve better bound (:mod:`router.regime`); without load
    adaptation there are no bursts to park for (the operator parks)."""
    return rnd.cfg.on("load") and rnd.out.state.busy


def parks(rnd: Round) -> bool:
    """The policy parks and every live engine does (``Release.park``)."""
    return rnd.cfg.on("park") and all(e.park for e in rnd.s.engines)


def holds_off(rnd: Round, r: QueuedRequest) -> bool:
    """Groups park in bursts and one is on (:func:`surge`): a normal-priority long request does not start yet (it
    would be parked at once), until the surge is over or it has waited twice ``long_wait_s`` (then it is never
    parked). One past ``long_wait_s``, or re-queued after a park caught its prefill, also waits for the regime to
    turn light: started on a dip, such requests were parked again and again, their prefills recomputed."""
    waited = rnd.now - r.enqueued_at
    if not parks(rnd) or waited >= 2 * rnd.cfg.long_wait_s:
        return False
    if surge(rnd):
        return True
    late = waited >= rnd.cfg.long_wait_s or r.attempts > 0
    return late and rnd.cfg.on("load") and rnd.out.state.busy  # (without it the regime is always busy)


def release_mode(rnd: Round, g: Group) -> ReleaseMode:
    """How to release at once a group holding a request no engine holds alone: park it where the members can,
    else wait for that request to end."""
    return ReleaseMode.PARK if can_park(rnd, g) else ReleaseMode.WAIT


def settle(rnd: Round, g: Group) -> None:
    """``g`` (released by parking) has left its epoch on every member: keep its record as ``parked`` while they
    report its requests parked, else (nothing was left to park) drop it."""
    if any(g.epoch in rnd.live[m].parked for m in g.members if m in rnd.live):
        rnd.put(replace_group(g, state="parked", since=rnd.now))
    else:
        rnd.drop(g)


def unresumed(rnd: Round, g: Group) -> None:
    """``g``, which was to resume parked requests, is gone before it bound (rolled back): its members still hold
    them, so they are parked again (a later round resumes them)."""
    ep, held = g.carries[-1], rnd.s.parked_held
    if all(ep in held.get(m, ()) for m in g.members):
        back = Group(
            epoch=ep,
            members=g.members,
            reason=g.reason,
            state="parked",
            since=rnd.now,
            park=True,
            carries=g.carries[:-1],
        )
        rnd.put(back)


def reconcile(rnd: Round) -> None:
    """Parked records whose requests cannot resume (a member gone or no longer holding them: its heartbeat, an
    engine whose breaker is open included) end: the members that still hold them get the epoch's release
    (aborting the parked requests, freeing their KV). So do engines holding parked requests of an epoch no record
    knows (its record was deleted by hand, say)."""
    held = rnd.s.parked_held
    known = {*rnd.parked, *(ep for g in rnd.groups.values() for ep in (g.epoch, *g.carries))}
    orphans: dict[int, list[int]] = {}
    for engine, epochs in held.items():
        for ep in epochs:
            if ep not in known:
                orphans.setdefault(ep, []).append(engine)
    for ep, engines in orphans.items():
        note = ReleaseNote(ep, tuple(engines), "manual", ReleaseMode.WAIT, ReleaseCause.PARKED_LOST)
        rnd.note(note)
        rnd.command(tuple(engines), Release(epoch=ep))
    for g in list(rnd.parked.values()):
        lost = [m for m in g.members if g.epoch not in held.get(m, ())]
        if not lost:
            left(rnd, g)
            continue
        holders = tuple(m for m in g.members if g.epoch in held.get(m, ()))
        rnd.drop(g)
        note = ReleaseNote(
            g.epoch, g.members, g.reason, ReleaseMode.WAIT, ReleaseCause.PARKED_LOST, engines=tuple(lost)
        )
        rnd.note(note)
        if holders:
            rnd.command(holders, Release(epoch=g.epoch))


def left(rnd: Round, g: Group) -> None:
    """Count ``g``'s parked requests in the inflight sets; where it had some and none is left (their clients
    disconnected, or timed out, while parked: the gateway ended them), end the epoch on its members, freeing the
    KV their resume would have wasted a group's time on. (Requests sent to an engine directly are never counted:
    their epoch stays until resumed or released by hand.)"""
    load = rnd.s.tp_load.get(g.epoch)
    if load is None:
        return
    if load.inflight:
        if load.inflight != g.parked_requests:
            rnd.put(replace_group(g, parked_requests=load.inflight))
        return
    if g.parked_requests:
        rnd.drop(g)
        rnd.note(ReleaseNote(g.epoch, g.members, g.reason, ReleaseMode.WAIT, ReleaseCause.PARKED_LEFT))
        rnd.command(g.members, Release(epoch=g.epoch))


def dp_limit(rnd: Round, m: int) -> int:
    """The most KV a DP request may ever have on parked engine ``m``: its KV less its head slices of the parked
    requests (each parked epoch's requests' KV over its width, as the members hold them)."""
    held = sum(
        -(-rnd.s.tp_load[g.epoch].kv_tokens // g.width)
        for g in rnd.parked.values()
        if m in g.members and g.epoch in rnd.s.tp_load
    )
    return rnd.live[m].max_total_tokens - held


def blocked(rnd: Round) -> bool:
    """A request that has waited ``max_defer_s`` can be served only where requests are parked: no engine outside
    the parked groups holds it, and no parked engine could hold it in DP beside its parked slices (:func:`dp_limit`).
    Its wait would last as long as the parking, so the parked group resumes. A normal-priority long request does
    not count: it waits for calm, as the parked groups do."""
    parked = rnd.parked_members()
    if not parked:
        return False
    outside = [e for e in rnd.s.engines if e.engine not in parked]
    widest = max((e.num_engines for e in rnd.s.engines), default=1)
    room = max(
        [e.max_total_tokens for e in outside]
        + [
            sum(rnd.live[m].max_total_tokens for m in ms)
            for width in widths(widest)[1:]
            for ms in rnd.merge_sets(width)
            if parked.isdisjoint(ms)
        ],
        default=0,
    )
    parked_room = max(
        (max(dp_limit(rnd, m), rnd.live[m].dp_room) for m in parked if m in rnd.live), default=0
    )
    for r in rnd.s.waiting:
        if not rnd.s.fits_one(r) and r.priority != "high":
            continue  # (a long one of normal priority waits for calm anyway, when the parked groups resume too)
        if rnd.now - r.enqueued_at < rnd.limits.max_defer_s or r.kv_tokens <= room:
            continue
        if rnd.s.fits_one(r) and r.kv_tokens <= parked_room:
            continue
        return True
    return False
