"""Where the requests of a round go, and the groups bound for them (paper section 5's three use cases).

- a request one engine's KV cannot hold goes to a long-context group (:func:`place_long`), bound at the width
  whose pooled KV holds it (:func:`need_width`);
- a high-priority one to a group with room, else a new group of :data:`PRIORITY_WIDTH` (:func:`place_priority`);
- under light load normal work goes to the load groups (:func:`load_binds` binds them), else to DP
  (:mod:`router.dp_dispatch`);
- a bound group's TP requests go to its members in turn (:func:`owner`), each streaming its own;
- :func:`fast_targets`: where a short normal request arriving before the next round may go at once.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from flying.groups import widths as group_widths
from flying.messages import FastTarget, Group, GroupReason, GroupState, QueuedRequest
from router import long_wait, parking
from router.decision import Dispatch
from router.dp_dispatch import nothing_dispatches, to_dp
from router.engine_view import EngineView
from router.regime import forming
from router.releases import release_idle_blocking
from router.round import SHORT, USABLE, Round, replace_group

# engines in a group bound for a high-priority request: the narrowest, so the rest of the node stays in DP
PRIORITY_WIDTH = 2
# a normal-priority long-context group is at least this wide where groups are parked (at most half a node): parked
# for a burst, its request's KV head slices leave each member more room for DP
LONG_MIN_WIDTH = 4
# long-context groups hold at most this share of the engines (one is always allowed)
LONG_MAX_SHARE = 0.5


def need_width(kv_tokens: int, engines: Sequence[EngineView]) -> int | None:
    """1 if one engine holds ``kv_tokens``; else the smallest group width whose pooled KV does; None if none."""
    if not engines:
        return None
    if any(e.max_total_tokens >= kv_tokens for e in engines):
        return 1
    bindable = [e for e in engines if e.num_engines > 1]
    if not bindable:
        return None
    per_engine = min(e.max_total_tokens for e in bindable)
    for w in group_widths(max(e.num_engines for e in bindable))[1:]:
        if w * per_engine >= kv_tokens:
            return w
    return None


def place_rest(rnd: Round) -> None:
    """Place the queue's requests other than high priority, in order. Once nothing dispatches
    (:func:`nothing_dispatches`), nothing changes until a request no engine holds alone is placed (it may bind):
    the requests in between are passed over without a look."""
    waiting, long_at = rnd.s.waiting, rnd.s.too_long_at
    i = 0
    while i < len(waiting):
        r = waiting[i]
        if r.priority != "high":
            if nothing_dispatches(rnd, r):
                j = bisect.bisect_right(long_at, i)
                if j == len(long_at):
                    return
                i = long_at[j]
                continue
            _place(rnd, r)
        i += 1


def place(rnd: Round, r: QueuedRequest) -> None:
    """Send ``r`` where it goes this round (or bind the group it waits for); it stays queued otherwise."""
    if not nothing_dispatches(rnd, r):  # (else busy, no groups, every DP engine full: the rest waits)
        _place(rnd, r)


def _place(rnd: Round, r: QueuedRequest) -> None:
    """:func:`place` for a request that may dispatch."""
    width = need_width(r.kv_tokens, rnd.s.engines)
    if width is None:
        return  # no group can hold it now (the gateway rejects such requests while engines are up)
    if r.suspect and width == 1:
        to_dp(rnd, r)  # alone among suspects on a DP engine: if that engine dies too, the cause is known
        return
    if width > 1:
        place_long(rnd, r, width)
    elif r.priority == "high" and rnd.cfg.on("priority") and place_priority(rnd, r):
        pass
    elif not rnd.out.state.busy and (g := group_for(rnd, r, 1, USABLE, SHORT, imminent=True)) is not None:
        to_group(rnd, g, r)
    elif (
        not to_dp(rnd, r)
        and (g := group_for(rnd, r, 1, ("bound",), reasons=("manual", "load", "long"))) is not None
        and (g.reason == "manual" or not rnd.paused_dp(g))
    ):
        # an operator bound the engines, or a load group serves a long request to its end (never one that
        # pauses DP work: its release would wait for this request): traffic still flows through their groups
        to_group(rnd, g, r)


def group_for(
    rnd: Round,
    r: QueuedRequest,
    width: int,
    states: tuple[GroupState, ...],
    reasons: tuple[GroupReason, ...] | None = None,
    imminent: bool = False,
) -> Group | None:
    """The narrowest, least-loaded group with room for ``r``; ``imminent``: binding groups only if hard
    (they form at the members' next step boundary, a sequential one waits for their DP work)."""
    fits = groups_for(rnd, r, width, states, reasons, imminent)
    return fits[0] if fits else None


def groups_for(
    rnd: Round,
    r: QueuedRequest,
    width: int,
    states: tuple[GroupState, ...],
    reasons: tuple[GroupReason, ...] | None = None,
    imminent: bool = False,
) -> list[Group]:
    """Every group with room for ``r`` (see :func:`group_for`), the one it picks first."""
    fits = [
        g
        for g in rnd.groups.values()
        if g.state in states
        and not (imminent and g.state == "binding" and g.preempt != "hard")
        and g.width >= width
        and (reasons is None or g.reason in reasons)
        and not rnd.avoid(r, g.members)
        and rnd.group_room(g, r)
    ]
    # a bound group serves now; a binding one once its members reach a step boundary (one long DP step, maybe)
    return sorted(fits, key=lambda g: (g.width, g.state != "bound", rnd.group_n(g), g.epoch))


def to_group(rnd: Round, g: Group, r: QueuedRequest) -> None:
    """``r`` is the group's: dispatched to the member that is to own it (:func:`owner`) if the group is bound,
    else it waits for the group to form."""
    n = rnd.tp.get(g.epoch, (0, 0))[0]
    rnd.sent_tp(g.epoch, r.kv_tokens)  # (retractable() sees it this round)
    # (router.parking: never parked) while it serves a high-priority long request, or one that waited twice
    # long_wait_s, or the requests its bind held for; a bound group with no request left holds for nothing
    held = g.hold and (n > 0 or g.state != "bound")
    long = r.kv_tokens > rnd.s.max_kv
    overdue = long and rnd.now - r.enqueued_at >= 2 * rnd.cfg.long_wait_s
    hold = held or (long and r.priority == "high") or overdue
    if g.state == "bound":
        e = rnd.live[g.leader] if r.leader_only else owner(rnd, g)
        rnd.dispatch(Dispatch(r, e.engine, e.url, g.epoch))
        rnd.put(replace_group(g, last_used=rnd.now, hold=hold))
    elif hold != g.hold:
        rnd.put(replace_group(g, hold=hold))


def spread(rnd: Round, g: Group) -> bool:
    """The group's TP requests are spread over its members (``spread_ownership``): each member owns (streams,
    and keeps on a release) the requests sent to its endpoint, so a release by scatter leaves them evenly. Only
    where every member transforms KV: a release by retraction recomputes the group's requests on its leader, which
    cannot stream a request another member owns."""
    return rnd.cfg.on("spread-ownership") and rnd.kv.possible(g.members)


def owner(rnd: Round, g: Group) -> EngineView:
    """The member a bound group's next TP request goes to: the leader, or, spread, the member holding the fewest
    requests (its inflight set: its paused or adopted DP work and the TP requests it owns, plus what this round
    sent it; the first in member order on a tie), so the members take the group's requests in turn and each
    engine's load after a release is as even as it can be."""
    if not spread(rnd, g):
        return rnd.live[g.leader]
    return min((rnd.live[m] for m in g.members), key=lambda e: e.inflight + sent_to(rnd, e.engine))


def sent_to(rnd: Round, engine: int) -> int:
    """Requests this round dispatched to ``engine`` so far."""
    return sum(1 for x in rnd.out.dispatches if x.engine == engine)


def may_keep(rnd: Round, ms: tuple[int, ...]) -> bool:
    """Block ``ms`` may bind with its members' DP work kept running beside the group's steps (``mixed_steps`` on,
    every member reporting it): nothing paused, moved or drained first, and the backlog decodes at DP's rate."""
    return rnd.cfg.on("mixed-steps") and all(m in rnd.live and rnd.live[m].mixed_steps for m in ms)


def adopt_fits(rnd: Round, ms: tuple[int, ...]) -> float:
    """The most DP requests a block adopts (``adopt_max_inflight`` per member). A block holding more serves
    them in DP while new work goes to the groups."""
    return rnd.limits.adopt_max_inflight * len(ms)


def load_binds(rnd: Round) -> None:
    """Every node planned at a width of 2 or more (:mod:`router.regime`) binds its free blocks of that width as
    load groups, once its load groups of other widths are released. An idle block binds at once; a busy one keeps
    its DP work beside the group's steps (:func:`may_keep`), else adopts it if that is cheap (``ADOPT_MAX_MS``),
    else drains first, at most half of the node's blocks at a time."""
    if not rnd.cfg.on("load"):
        return
    if any(need_width(r.kv_tokens, rnd.s.engines) not in (1, None) for r in rnd.s.too_long):
        return  # a long request waits for engines: leave them to it
    for pool, width in rnd.plan.items():
        other = any(
            (g.reason == "load" and g.width != width) or g.state == "releasing"
            for g in rnd.groups.values()
            if g.leader in rnd.live and rnd.live[g.leader].pool == pool
        )
        if width >= 2 and not other:
            bind_blocks(rnd, width, pool)


def bind_blocks(rnd: Round, width: int, pool: tuple[str, int, int]) -> None:
    """Bind node ``pool``'s free blocks of ``width`` that may bind now (see :func:`load_binds`)."""
    sets = [ms for ms in rnd.free_sets(width) if rnd.live[ms[0]].pool == pool]
    draining = sum(
        1
        for g in rnd.groups.values()
        if g.reason == "load"
        and g.state == "binding"
        and rnd.live.get(g.leader, None) is not None
        and rnd.live[g.leader].pool == pool
    )
    in_dp = len(sets) + draining
    for ms in sets:  # least loaded first
        if not rnd.block_load(ms):
            rnd.bind(ms, "load", "hard")
        elif may_keep(rnd, ms):  # its backlog runs on beside the group's steps, at DP's rate
            rnd.bind(ms, "load", "hard", keep=True)
        elif rnd.kv.possible(ms) and rnd.block_load(ms) > adopt_fits(rnd, ms):
            continue  # it serves its backlog in DP (new work goes to the groups) and adopts once it fits
        elif rnd.kv.may_adopt(ms):
            rnd.bind(ms, "load", "hard", adopt=True)
        elif 2 * (draining + 1) <= in_dp:  # no KV transformation, or one too costly: drain
            rnd.bind(ms, "load", "sequential")
            draining += 1


def place_priority(rnd: Round, r: QueuedRequest) -> bool:
    """A group with room that forms at the next step boundary, else a new group of :data:`PRIORITY_WIDTH` that
    leaves DP engines for the rest: under light load the least loaded block (its few DP requests pause, or are
    adopted where it may), otherwise only an idle one (pausing busy DP work costs more than the group saves). Else
    False: the request jumps the queue in DP."""
    if (g := group_for(rnd, r, 1, USABLE, SHORT, imminent=True)) is not None:
        to_group(rnd, g, r)
        return True
    if reuse_idle(rnd, r, 1, ("long",), "priority"):
        return True  # (an idle long group is kept while a high-priority request waits: it must take it)
    taken = rnd.in_groups()
    light = not rnd.out.state.busy
    for ms in rnd.free_sets(PRIORITY_WIDTH):
        if rnd.load_width(rnd.live[ms[0]].pool) > 1:
            continue  # its node's load groups serve it once they form (meanwhile it jumps the queue in DP)
        dp_left = any(e.mode == "dp" and e.engine not in taken and e.engine not in ms for e in rnd.s.engines)
        if dp_left and (light or not rnd.block_load(ms)):
            adopt = keep = False
            if rnd.block_load(ms) and may_keep(rnd, ms):
                keep = True  # its DP requests run on beside the group's steps
            elif rnd.block_load(ms) and rnd.kv.possible(ms):
                if rnd.block_load(ms) > adopt_fits(rnd, ms) or not rnd.kv.may_adopt(ms):
                    break  # a backlog: it would run in TP at lower throughput (the least loaded block first)
                adopt = True
            rnd.bind(ms, "priority", rnd.cfg.preempt, adopt=adopt, keep=keep)
            return True  # it waits for the group (the next round finds it binding)
    return False


def place_long(rnd: Round, r: QueuedRequest, width: int) -> None:
    """A normal-priority request first waits for calm (:mod:`router.long_wait`). Then the narrowest long or manual
    group that holds it, an idle load or priority group without paused DP work, or, where groups are not parked,
    the bound load group; else bind the width it needs, at least :data:`LONG_MIN_WIDTH` where groups are parked (a
    group of its own: in the load group its long steps slow every light-load request), releasing groups in the
    way."""
    cfg = rnd.cfg
    if cfg.on("long-context") and long_wait.waits(rnd, r):
        return  # it waits for calm, at most long_wait_s (high priority never waits)
    need, parked = width, r.priority != "high" and parking.parks(rnd)
    if (
        parked
    ):  # parked for a burst, a wider group's head slices leave each member more KV (half the node at most);
        # a high-priority one runs at once, through a burst: as narrow as it can
        width = max(width, min(LONG_MIN_WIDTH, rnd.engines_n() // 2))
    g = group_for(rnd, r, width, USABLE, ("long", "manual"))
    if g is None and parked:
        g = group_for(rnd, r, need, USABLE, ("manual",))  # an operator's (or static) group, however narrow
    if g is not None:
        to_group(rnd, g, r)  # bound: dispatched; binding: it waits for this group
        return
    if reuse_idle(rnd, r, width, ("load", "priority"), "long"):
        return
    if not cfg.on("long-context"):
        return
    if not parking.parks(rnd) and (g := group_for(rnd, r, width, ("bound",), ("load",))) is not None:
        to_group(rnd, g, r)  # the widest group there is, the load group, in SP (router.long_wait)
        return
    in_long = sum(  # (an idle one holds no share: release_idle_blocking may release it for this one)
        g.width for g in rnd.groups.values() if g.reason == "long" and (g.state != "bound" or rnd.group_n(g))
    ) + sum(g.width for g in rnd.out.binds if g.reason == "long")
    if in_long and in_long + width > LONG_MAX_SHARE * len(rnd.live):
        return  # long groups already hold their share (one is always allowed): the rest stays DP
    if sets := rnd.free_sets(width):
        preempt, adopt = cfg.preempt, False
        if preempt == "hard" and r.kv_tokens > rnd.hard_cap(sets[0]):
            preempt = "sequential"  # the members' paused DP work would hold KV the request needs
        elif preempt == "hard" and rnd.block_load(sets[0]):
            adopt = rnd.kv.may_adopt(sets[0])  # their DP work continues in the group instead of pausing
        overdue = rnd.now - r.enqueued_at >= 2 * cfg.long_wait_s  # (router.parking.holds_off: it runs on now)
        rnd.bind(sets[0], "long", preempt, adopt=adopt, hold=r.priority == "high" or overdue)
    elif not long_wait.make_room(rnd, width):
        release_idle_blocking(rnd, width)


def reuse_idle(
    rnd: Round, r: QueuedRequest, width: int, reasons: tuple[GroupReason, ...], reason: GroupReason
) -> bool:
    """Send ``r`` to a bound group of ``reasons`` that is idle (no TP work, no paused DP work) and holds it,
    the narrowest; the group becomes a ``reason`` group (reused: no release and re-bind)."""
    idle = [
        g
        for g in rnd.groups.values()
        if g.state == "bound"
        and g.reason in reasons
        and not rnd.group_n(g)
        and not rnd.paused_dp(g)
        and g.width >= width
        and not rnd.avoid(r, g.members)
        and rnd.group_room(g, r)
    ]
    if not idle:
        return False
    g = min(idle, key=lambda g: (g.width, g.epoch))
    rnd.put(replace_group(g, reason=reason))
    to_group(rnd, rnd.groups[g.epoch], r)
    return True


def fast_targets(rnd: Round) -> list[FastTarget]:
    """Where :func:`place` would send a short normal request arriving after this round: the light load's group
    (its leader, or each member with a share of the group's room), or the DP engines with a free slot (not for
    high priority, which may get a group of its own). None while a group forms, or when a round would bind or
    choose among groups for the request."""
    probe = QueuedRequest(
        id="", priority="normal", model="", prompt_tokens=1, max_tokens=1, gateway="", enqueued_at=rnd.now
    )
    if forming(rnd.groups.values(), rnd.now, rnd.limits.ack_timeout_s) or not rnd.live:
        return []
    if not rnd.out.state.busy and (gs := groups_for(rnd, probe, 1, USABLE, SHORT, imminent=True)):
        if gs[0].state != "bound" or gs[0].leader not in rnd.live:
            return []
        width = gs[0].width  # every bound group of the width the round would pick (one per node, say)
        whole = [
            g for g in gs if g.width == width and g.state == "bound" and all(m in rnd.live for m in g.members)
        ]
        return [t for g in whole for t in group_targets(rnd, g)]
    taken = rnd.in_groups()
    affinity = rnd.cfg.dispatch == "cache-aware"  # requests with a prefix chain wait for a round
    return [
        FastTarget(
            engine=e.engine,
            url=e.url,
            cap=rnd.limits.max_inflight_per_worker,
            max_kv=e.dp_room,
            affinity=affinity,
        )
        for e in rnd.s.engines
        if e.mode == "dp" and not e.pending and e.engine not in taken
    ]


def group_targets(rnd: Round, g: Group) -> list[FastTarget]:
    """A bound group's fast targets (every member live): its leader, or, spread, each member with a share of the
    group's room."""
    n, kv = rnd.tp.get(g.epoch, (0, 0))
    full = g.width * min(rnd.live[m].max_total_tokens for m in g.members)
    pooled = g.kv_cap if g.kv_cap and rnd.other_work(g) > 0 else full
    room = g.width * rnd.tp_room_per_engine(g) - n
    members = [rnd.live[m] for m in g.members] if spread(rnd, g) else [rnd.live[g.leader]]
    shares = [room // len(members) + (i < room % len(members)) for i in range(len(members))]
    return [
        FastTarget(
            engine=e.engine,
            url=e.url,
            epoch=g.epoch,
            cap=e.inflight + sent_to(rnd, e.engine) + share,
            max_kv=min(pooled - kv, rnd.s.max_kv),  # (a long request goes through a round: router.long_wait)
            follower=e.engine != g.leader,
        )
        for e, share in zip(members, shares)
    ]
