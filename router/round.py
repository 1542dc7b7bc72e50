"""One policy round's working state (:class:`Round`): the snapshot, the group records as the round changes them,
what it has handed out so far, and the bookkeeping every job of the round shares (records, binds, releases, group
load). The jobs themselves live in their own modules: :mod:`router.regime`, :mod:`router.releases`,
:mod:`router.placement`, :mod:`router.dp_dispatch`; :func:`router.policy.decide` runs them in order."""

from __future__ import annotations

import math
from collections.abc import Mapping

import msgspec

from flying.groups import pool_sets
from flying.messages import (
    FastTarget,
    Group,
    GroupReason,
    GroupState,
    Preempt,
    QueuedRequest,
    Release,
    RouterState,
)
from router.config import PolicyConfig
from router.decision import BindMode, BindNote, Decision, Dispatch, ReleaseCause, ReleaseMode, ReleaseNote
from router.engine_view import EngineView
from router.snapshot import GroupLoad, Snapshot
from router.transform_cost import TransformCost

# seconds: DP dispatch counts the requests an engine was sent within about this long twice (their prefill is still
# ahead); without it an engine that has just become free would take every new request at once
SPREAD_S = 3.0

USABLE: tuple[GroupState, ...] = ("bound", "binding")
# groups a request one engine holds may go to (a long prefill would stall it)
SHORT: tuple[GroupReason, ...] = ("load", "priority", "manual")


def replace_group(g: Group, **kw: object) -> Group:
    return msgspec.structs.replace(g, **kw)


def decayed_recent(
    state: RouterState, now: float, tau: float, live: Mapping[int, EngineView]
) -> dict[int, float]:
    """DP dispatches per live engine, decayed with time constant ``tau`` (:data:`SPREAD_S`) since the last round
    (``state.rate_ts``); negligible ones dropped."""
    if tau <= 0 or not state.recent:
        return {}
    f = math.exp(-max(0.0, now - state.rate_ts) / tau) if state.rate_ts else 1.0
    return {e: v * f for e, v in state.recent.items() if v * f >= 0.01 and e in live}


class Round:
    """One call of :func:`router.policy.decide`: the snapshot plus what this round has already handed out."""

    def __init__(self, s: Snapshot, cfg: PolicyConfig) -> None:
        self.s, self.cfg, self.now, self.limits = s, cfg, s.now, s.limits
        self.live = {e.engine: e for e in s.engines}
        # the groups that exist (binding, bound, releasing); parked ones apart: their members are DP engines
        self.groups: dict[int, Group] = {g.epoch: g for g in s.groups if g.state != "parked"}
        self.parked: dict[int, Group] = {g.epoch: g for g in s.groups if g.state == "parked"}
        self.out = Decision(
            state=msgspec.structs.replace(
                s.state,
                long_context=cfg.on("long-context"),
                long_wait_s=cfg.long_wait_s if cfg.on("long-context") else 0.0,
            ),
            sp_threshold=cfg.sp_threshold,
        )
        self.dp_inflight = {e.engine: e.inflight for e in s.engines}
        self.dp_kv = {e.engine: 0 for e in s.engines}  # KV of the DP requests this round sends each engine
        self.tp = {ep: (ld.inflight, ld.kv_tokens) for ep, ld in s.tp_load.items()}
        self.tp_max = {ep: ld.max_kv_tokens for ep, ld in s.tp_load.items()}
        self.reserved: set[int] = set()  # members of binds planned this round
        # node (pool) -> its load width this round: as last planned, until router.regime plans again
        self.plan = {e.pool: s.state.widths.get(e.node_key, 1) for e in s.engines}
        self.suspect = {e: t for e, t in s.state.suspect.items() if t > s.now}
        self.recent = decayed_recent(s.state, s.now, SPREAD_S, self.live)
        # engines running a suspect request, this round's included
        self.suspect_holders = set(s.suspect_holders)
        self.sent: dict[int, set[int]] = {}  # engine -> chain hashes this round sends it (DP)
        self.kv = TransformCost(cfg, s.cost, self.live, self.dp_kv)
        self._engines_n = max((e.num_engines for e in s.engines), default=1)
        self._taken: frozenset[int] | None = None  # in_groups(), until a record's members or a bind change it
        self._sets: dict[int, list[tuple[int, ...]]] = {}  # width -> merge sets of live engines (merge_sets)
        # engine -> where what failed on it is not sent (failed_domain)
        self._failed: dict[int, set[int]] = {}
        # widths router.releases.release_idle_blocking found no block for
        self.no_idle_block: set[int] = set()

    # --- what the round decides, besides group records --------------------------------------------------

    def note(self, event: object) -> None:
        """A decision-log entry (a note of :mod:`router.decision`)."""
        self.out.events.append(event)  # type: ignore[arg-type]

    def command(self, members: tuple[int, ...], cmd: Release) -> None:
        self.out.commands.append((members, cmd))

    def dispatch(self, d: Dispatch) -> None:
        self.out.dispatches.append(d)

    def update_state(self, **changes: object) -> None:
        """The router state this round leaves, with ``changes``."""
        self.out.state = msgspec.structs.replace(self.out.state, **changes)

    def set_state(self, state: RouterState) -> None:
        self.out.state = state

    def set_plan(self, plan: dict[tuple[str, int, int], int]) -> None:
        """Each node's load width for this round (router.regime)."""
        self.plan = plan

    def set_fast(self, targets: list[FastTarget]) -> None:
        self.out.fast = targets

    def sent_dp(self, e: int, chain: tuple[int, ...], kv: int) -> None:
        """A DP request of ``kv`` tokens with prefix ``chain`` goes to engine ``e`` this round."""
        self.sent.setdefault(e, set()).update(chain)
        self.dp_inflight[e] += 1
        if SPREAD_S > 0:
            self.recent[e] = self.recent.get(e, 0.0) + 1
        self.dp_kv[e] += kv

    def sent_tp(self, epoch: int, kv: int) -> None:
        """A TP request of ``kv`` tokens goes to group ``epoch`` this round."""
        n, total = self.tp.get(epoch, (0, 0))
        self.tp[epoch] = (n + 1, total + kv)
        self.tp_max[epoch] = max(self.tp_max.get(epoch, 0), kv)

    def distrust(self, engines: tuple[int, ...]) -> None:
        """Leave ``engines`` out of binds for ``suspect_s`` (they did not acknowledge one)."""
        for e in engines:
            self.suspect[e] = self.now + self.limits.suspect_s

    def found_no_idle_block(self, width: int) -> None:
        self.no_idle_block.add(width)

    # --- group records ------------------------------------------------------------------------------------

    def put(self, g: Group) -> None:
        if g.state == "parked":  # (released: its members are in no group now)
            self.groups.pop(g.epoch, None)
            self.parked[g.epoch] = g
            self._taken = None
            self.out.put[g.epoch] = g
            return
        old = self.groups.get(g.epoch)
        if old is None or old.members != g.members:
            self._taken = None
        self.groups[g.epoch] = g
        self.out.put[g.epoch] = g

    def drop(self, g: Group) -> None:
        """The group (or its parked requests) is gone: delete its record."""
        self.groups.pop(g.epoch, None)
        self.parked.pop(g.epoch, None)
        self._taken = None
        self.out.put.pop(g.epoch, None)
        self.out.drop.append(g.epoch)

    def release(
        self,
        g: Group,
        cause: ReleaseCause,
        mode: ReleaseMode = ReleaseMode.WAIT,
        seconds: float = 0.0,
        engines: tuple[int, ...] = (),
        width: int = 0,
    ) -> None:
        """Mark ``g`` releasing and send its members the release (the figures: :class:`ReleaseNote`'s)."""
        self.put(replace_group(g, state="releasing", since=self.now, released=mode.value))
        self.out.release(ReleaseNote(g.epoch, g.members, g.reason, mode, cause, seconds, engines, width))

    def bind(
        self,
        members: tuple[int, ...],
        reason: GroupReason,
        preempt: Preempt,
        adopt: bool = False,
        keep: bool = False,
        carries: tuple[int, ...] = (),
        hold: bool = False,
    ) -> Group:
        """A new group record; ``adopt``: by adoption (the members' DP requests become its TP requests, their KV
        transformed; it forms at the members' next step boundary, like a hard bind, and pauses nothing); ``keep``:
        the members' DP requests keep running beside its steps (it forms at their next step boundary too, and its
        TP requests get the KV the members have free)."""
        g = Group(
            epoch=0,
            members=members,
            reason=reason,
            preempt="hard" if adopt or keep else preempt,
            since=self.now,
            last_used=self.now,
            kv_cap=self.hard_cap(members) if preempt == "hard" or adopt or keep else 0,
            adopt=adopt,
            keep=keep,
            carries=carries,
            hold=hold,
        )
        self.out.binds.append(g)
        self.reserved |= set(members)
        self._taken = None
        mode = BindMode.ADOPT if adopt else BindMode.KEEP if keep else BindMode(preempt)
        adopt_ms = self.kv.adopt_ms(members) if adopt else 0.0
        self.out.events.append(
            BindNote(members, reason, mode, adopt_ms, self.cfg.sp_threshold, self.engines_n(), g.resumes)
        )
        return g

    # --- what the groups hold -----------------------------------------------------------------------------

    def in_groups(self) -> frozenset[int]:
        """Engines in a group record or a bind planned this round (the same object until that changes)."""
        if self._taken is None:
            self._taken = frozenset({m for g in self.groups.values() for m in g.members} | self.reserved)
        return self._taken

    def parked_members(self) -> frozenset[int]:
        """Engines holding a parked group's requests (router.parking)."""
        return frozenset(m for g in self.parked.values() for m in g.members)

    def other_work(self, g: Group) -> int:
        """Requests on the members that were not dispatched to the group (their inflight, less its TP requests):
        the DP work its bind set aside, or, bound by adoption, the DP requests it adopted, or, bound with the
        members' DP work kept, the DP requests still running beside it."""
        n = sum(self.live[m].inflight for m in g.members if m in self.live)
        return n - self.s.tp_load.get(g.epoch, GroupLoad()).inflight  # (the snapshot's: inflight is too)

    def paused_dp(self, g: Group) -> int:
        """DP requests the bind set aside on its members. Bound by adoption, those the members report paused
        (none when every member's work moved into the group; an adoption that could not move it, a member short of
        KV for the slices it would receive or holding a request that cannot move, pauses it as a hard bind does).
        Bound with the members' DP work kept, likewise: that work runs beside the group, nothing is set aside."""
        if g.adopt or g.keep:
            return sum(self.live[m].paused for m in g.members if m in self.live)
        return self.other_work(g)

    def group_n(self, g: Group) -> int:
        """The group's TP requests: those dispatched to it, and those it adopted."""
        return self.tp.get(g.epoch, (0, 0))[0] + (self.other_work(g) if g.adopt else 0)

    def group_room(self, g: Group, r: QueuedRequest) -> bool:
        """Room for ``r``: fewer TP requests than the group takes, and KV for it. A hard-bound group's KV is capped
        while its members hold paused DP work (kv_cap); once they hold none, the members' whole KV is the group's."""
        kv = self.tp.get(g.epoch, (0, 0))[1]
        full = g.width * min(self.live[m].max_total_tokens for m in g.members)
        pooled = g.kv_cap if g.kv_cap and self.other_work(g) > 0 else full
        # (adopted requests do not count: they were the members' own load)
        n = self.tp.get(g.epoch, (0, 0))[0]
        # under busy load a load or long group still bound serves a long request to its end (router.long_wait):
        # it takes DP's share of work
        busy_serving = self.out.state.busy and g.reason in ("load", "long")
        per = self.limits.max_inflight_per_worker if busy_serving else self.tp_room_per_engine(g)
        return n < g.width * per and kv + r.kv_tokens <= pooled

    def tp_room_per_engine(self, g: Group) -> int:
        """TP requests a member of ``g`` takes under light load: ``sp_inflight_per_engine`` for a load or priority
        group running only requests one engine holds (its SP steps keep up with what the members would hold in
        DP), else ``tp_inflight_per_engine`` (a long request's prefill chunks hold up everything else)."""
        short = g.reason in ("load", "priority") and self.tp_max.get(g.epoch, 0) <= self.s.max_kv
        return self.limits.sp_inflight_per_engine if short else self.limits.tp_inflight_per_engine

    def holds_suspect(self, e: int) -> None:
        """Engine ``e`` was sent a suspect request this round: it takes no other."""
        self.suspect_holders.add(e)

    def avoid(self, r: QueuedRequest, engines: tuple[int, ...]) -> bool:
        """The request failed on one of ``engines`` (it died before answering, its heartbeat may not have expired
        yet): send it elsewhere, unless that engine is the only live one. Its node may be gone whole (the other
        engines' heartbeats not expired yet either): while another node is live, it goes there."""
        if r.failed_on < 0:
            return False
        return bool(set(engines) & self.failed_domain(r.failed_on))

    def failed_domain(self, engine: int) -> set[int]:
        """Where a request that failed on ``engine`` is not sent: the live engines of ``engine``'s node (those
        whose pool spans it) and ``engine`` itself, while a live engine outside them remains; else ``engine``
        alone while another engine is live; else nothing."""
        if engine not in self._failed:
            node = {e.engine for e in self.s.engines if e.pool_first <= engine < e.pool_first + e.num_engines}
            node = {e for e in node if self.live[e].pool == self.live[min(node)].pool} if node else set()
            node.add(engine)
            if len(self.live.keys() - node) > 0:
                self._failed[engine] = node
            else:
                self._failed[engine] = {engine} if len(self.live) > 1 else set()
        return self._failed[engine]

    def engines_n(self) -> int:
        """The engines of the largest node's pool (as the heartbeats report it): the widest group there can be."""
        return self._engines_n

    def load_width(self, pool: tuple[str, int, int]) -> int:
        """The width the planner chose for node ``pool``'s load groups this round (1: DP)."""
        return self.plan.get(pool, 1)

    # --- blocks of engines --------------------------------------------------------------------------------

    def block_load(self, ms: tuple[int, ...]) -> int:
        return sum(self.dp_inflight[m] for m in ms)

    def merge_sets(self, width: int) -> list[tuple[int, ...]]:
        """Merge sets of ``width`` whose members are all live, in one node's pool and have it built (every node's,
        in engine order): a group never spans two nodes, and a member whose pool still connects (a restarted
        engine's) would refuse the bind, which the router would roll back and retry, every request waiting for the
        group meanwhile. (The live engines do not change within a round: computed once per width.)"""
        if width not in self._sets:
            self._sets[width] = self._merge_sets(width)
        return self._sets[width]

    def _merge_sets(self, width: int) -> list[tuple[int, ...]]:
        pools = sorted(
            {e.pool for e in self.s.engines if 1 < width <= e.num_engines}, key=lambda p: (p[1], p[0])
        )
        return [
            ms
            for pool in pools
            for ms in pool_sets(pool[1], pool[2], (width,))
            if all(m in self.live and self.live[m].pool == pool and self.live[m].pool_ready for m in ms)
        ]

    def free_sets(self, width: int) -> list[tuple[int, ...]]:
        """Merge sets of ``width`` (any node's) whose members are live, bindable, in DP and in no group, nor
        holding parked requests (their group resumes there); least loaded first."""
        taken = self.in_groups() | self.parked_members()
        ok = [
            ms
            for ms in self.merge_sets(width)
            if all(
                self.live[m].mode == "dp"
                and not self.live[m].pending
                and m not in taken
                and m not in self.suspect
                for m in ms
            )
        ]
        return sorted(ok, key=lambda ms: (self.block_load(ms), ms))

    def hard_cap(self, members: tuple[int, ...]) -> int:
        """KV a hard-preempted group can use: its members' paused DP requests keep theirs, those this round sends
        them included (with a margin of a tenth, for the tokens they decode before they read the bind)."""
        return int(0.9 * sum(self.live[m].free_kv_tokens - self.dp_kv[m] for m in members))
