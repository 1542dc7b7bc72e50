"""A discrete-event, trace-driven simulation of N engines run by the *live* policy (:func:`router.policy.decide`).

This module is the event loop and the simulated router: it snapshots the engines as the router does (their
heartbeats, :meth:`router.engine_view.EngineView.from_heartbeat`) and applies each decision as the router does
(:func:`router.decision.plan`). The engines are :mod:`sim.engine`; the workloads :mod:`sim.workload` and
:mod:`sim.prefix_workload`; the settings :class:`sim.config.SimConfig`.

Each engine is a continuous-batching scheduler whose step times come from :mod:`flying.cost_model`; a bound group is
one scheduler at its width with the members' pooled KV. Commands behave as the workers' (worker_ext.binding) do:
a member acknowledges a bind on reading it (``pending``), applies it at its next step boundary (hard: its DP work
pauses with its KV kept; sequential: once its running DP requests finish), the group forms when every member is
there (plus ``switch_ms``), a release takes effect once the group's TP requests have finished and the paused DP work
resumes where it stopped. The router's state lives where the live router keeps it (group records, regime), so a
router outage is just time in which no decisions are taken.

KV transformation (``SimConfig.kv_transform``: the engines report ``kv_transform`` and apply it). A bind with
``adopt`` is applied at the member's next step boundary like a hard one, but its running and waiting DP requests
become the group's (running ones keep their KV and progress); the group forms ``switch_ms`` plus the transformation
(:meth:`flying.cost_model.CostModel.transform_ms` over each member's moved head slices) after the last member
arrives. Every request is *owned* by the engine it was dispatched to (for a TP dispatch the group's member the
policy named, :func:`router.placement.owner`) and stays assigned there. A release with ``scatter`` takes effect at
the leader's next step boundary: each running TP request goes back to DP on its owner with its KV if the owner's
free KV holds it (whole), else it is retracted there (recomputed in DP); unstarted ones join the owner's queue; the
members resume DP after ``switch_ms`` plus the transformation. A release with ``retract`` recomputes every TP request on its owner.

Static baselines run the same machinery: ``dp`` with every use case off, ``tp`` with every engine in a permanent
(unmerged) group of ``tp_width``. ``shift`` is Shift Parallelism (seed 001): one permanent scheduler over all the
engines whose every step runs in sequence parallelism, or in full TP when it batches at most ``shift_threshold``
tokens (:meth:`flying.cost_model.CostModel.shift_step_ms`), with as many running requests and prefill tokens per
step per GPU as a DP engine and the KV that the second, TP-sharded weight copy leaves. Both keep a prefix cache
of their own (their engines cache prefixes in TP as in DP); a dynamic run's bound groups do not (the workers' do
not yet).

For pictures the simulator records each engine's mode whenever it changes (:attr:`Simulator.track`:
``dp``, ``binding``, ``tp<width>``, ``releasing``, with the paused DP requests), the router's bind and release
decisions with their reason (:attr:`Simulator.decisions`) and, under ``shift``, which configuration each step ran
in (:attr:`Simulator.shift_steps`).
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from flying.groups import pooled_limit
from flying.messages import PRIORITY_CLASS, Bind, Group, GroupReason, QueuedRequest, RouterState
from flying.prefix import MAX_BLOCKS, encode_chain
from loadgen.metrics import RequestRecord
from router.decision import Decision, ReleaseCause, plan
from router.policy import GroupLoad, Snapshot, decide
from router.prefix_index import PrefixIndex
from router.reuse import Reuse
from sim.config import Mode, SimConfig
from sim.engine import Engine, Req, SimGroup, kv_in_use
from sim.workload import SimRequest

__all__ = ["Mode", "SimConfig", "SimDecision", "SimRequest", "Simulator"]


@dataclass(frozen=True)
class SimDecision:
    """A bind or release the router decided: ``reason`` is the group's (load, priority, long), ``cause`` why a
    release was sent (None for a bind)."""

    at: float
    kind: Literal["bind", "release"]
    epoch: int
    members: tuple[int, ...]
    reason: GroupReason
    cause: ReleaseCause | None = None


class Simulator:
    def __init__(self, cfg: SimConfig, requests: Sequence[SimRequest], check: bool = False) -> None:
        self.cfg, self.policy, self.check = cfg, cfg.effective_policy(), check
        self.limits = cfg.effective_limits()
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.engines = [Engine(self, i) for i in range(cfg.engines)]
        self.reqs = [
            Req(
                i,
                s,
                QueuedRequest(
                    id=str(i),
                    priority=s.priority,  # type: ignore[arg-type]
                    model="sim",
                    prompt_tokens=s.prompt,
                    max_tokens=s.output,
                    gateway="sim",
                    enqueued_at=s.at,
                    seq=i,
                    prefix=encode_chain(s.prompt_blocks[:MAX_BLOCKS]),
                ),
            )
            for i, s in enumerate(requests)
        ]
        self.queue: dict[int, dict[str, Req]] = {c: {} for c in sorted(PRIORITY_CLASS.values())}
        self.records: dict[int, Group] = {}  # "Redis": the router's group records
        self.state = RouterState(busy=True)
        self.prefixes = PrefixIndex()  # the router's mirror of the engines' prefix caches
        self.reuse = Reuse()  # the router's measure of how much of the prompts repeats
        self.dp_rules: collections.Counter[str] = collections.Counter()  # DP dispatches by Dispatch.rule
        self.epochs = itertools.count(1)
        self.groups: dict[int, SimGroup] = {}
        self.parked: dict[
            int, tuple[tuple[int, ...], list[Req]]
        ] = {}  # epoch -> (members, its parked requests)
        self.tp_load: dict[int, list[int]] = {}
        self.tp_max: dict[int, int] = {}  # epoch -> the largest request one engine holds it was sent
        self.tp_long: dict[int, dict[int, int]] = {}  # epoch -> its unfinished long requests' KV, by request
        self.dispatched: set[int] = set()
        self.finished = 0
        self.admitted = 0
        self.admitted_tokens = (0, 0)  # prompt and output tokens admitted (the gateways' counters)
        self.admitted_high = 0
        self._router_due: float | None = None
        self.bound_at: dict[int, float] = {}
        self.log: list[tuple[float, str]] = []
        # transformations and retractions, for reports
        self.stats: collections.Counter[str] = collections.Counter()
        self.transforms: list[tuple[float, str, float, int]] = []  # (at, "adopt"/"scatter", ms, requests)
        self.track: list[
            tuple[float, tuple[str, ...], int]
        ] = []  # (at, every engine's state, paused DP requests)
        self.decisions: list[SimDecision] = []
        self.shift_steps: list[tuple[float, float, bool]] = []  # (at, seconds, full TP) of every shift step
        if cfg.mode in ("tp", "shift"):
            self._static_groups(cfg.per_node if cfg.mode == "shift" else cfg.tp_width, cfg.mode == "shift")
        self.note_states()

    @property
    def kv_per_engine(self) -> int:
        cost = self.cfg.cost
        return cost.shift_kv_tokens(self.cfg.per_node) if self.cfg.mode == "shift" else cost.kv_tokens

    def note_states(self) -> None:
        """Append to the mode track if an engine's state or the paused DP work changed."""
        entry = (tuple(e.state for e in self.engines), sum(e.paused for e in self.engines))
        if not self.track or self.track[-1][1:] != entry:
            self.track.append((self.now, *entry))

    # --- event loop ---------------------------------------------------------------------------------------

    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self) -> list[RequestRecord]:
        for r in self.reqs:
            self.at(r.spec.at, self.arrive_request, r)
        self.at(0.0, self.tick)
        while self._events and self.finished < len(self.reqs):
            t, _, fn, args = heapq.heappop(self._events)
            if t > self.cfg.horizon_s:
                break
            self.now = t
            fn(*args)
        return [self.record(r) for r in self.reqs]

    def router_up(self) -> bool:
        return not any(a <= self.now < b for a, b in self.cfg.router_down)

    def poke_router(self) -> None:
        due = self.now + self.cfg.router_ms / 1000
        if self._router_due is None or self._router_due > due:
            self._router_due = due
            self.at(due, self.router_round)

    def tick(self) -> None:
        self.poke_router()
        self.at(self.now + self.cfg.tick_s, self.tick)

    # --- requests -----------------------------------------------------------------------------------------

    def context_limit(self) -> int:
        kv, cfg = self.kv_per_engine, self.cfg
        if cfg.mode == "tp":
            return cfg.tp_width * kv
        if cfg.mode == "shift":
            return cfg.per_node * kv
        return pooled_limit(cfg.per_node, kv) if self.policy.on("long-context") else kv

    def arrive_request(self, r: Req) -> None:
        if r.kv > self.context_limit():  # the gateway answers 400: longer than the deployment's context
            r.done = True
            self.finished += 1
            return
        self.queue[PRIORITY_CLASS[r.spec.priority]][r.q.id] = r
        self.admitted += 1
        self.admitted_tokens = (
            self.admitted_tokens[0] + r.spec.prompt,
            self.admitted_tokens[1] + r.spec.output,
        )
        self.admitted_high += r.spec.priority == "high"
        self.poke_router()

    def group_max_kv(self, epoch: int) -> int:
        """The largest unfinished TP request of the group (as the live router reads it from the inflight set; one
        engine holds any request below this: those count as the largest it was ever sent)."""
        return max(self.tp_long.get(epoch, {}).values(), default=self.tp_max.get(epoch, 0))

    def group_loads(self) -> dict[int, GroupLoad]:
        """The TP requests of each epoch, as the live router reads them from the inflight sets: by the epoch of
        their dispatch, a group's own and those of the parked epochs it carries (``Group.carries``) together."""
        loads = {ep: GroupLoad(n, kv, self.group_max_kv(ep)) for ep, (n, kv) in self.tp_load.items()}
        for g in self.records.values():
            if not (g.carries or g.state == "parked"):
                continue
            own = g.state != "parked"  # (of a parked epoch, only the requests it parked: router.parking)
            kept = [
                kv
                for ep in (g.carries if own else (g.epoch, *g.carries))
                for kv in self.tp_long.get(ep, {}).values()
            ]
            n, kv = self.tp_load.get(g.epoch, (0, 0)) if own else (0, 0)
            top = max([*kept, self.group_max_kv(g.epoch) if own else 0])
            loads[g.epoch] = GroupLoad(n + len(kept), kv + sum(kept), top)
        return loads

    def finish(self, r: Req) -> None:
        assert not r.done, f"request {r.i} finished twice"
        r.done = True
        self.finished += 1
        self.engines[r.engine].assign(-1)
        if r.epoch:
            load = self.tp_load[r.epoch]
            load[0] -= 1
            load[1] -= r.kv
            self.tp_long.get(r.epoch, {}).pop(r.i, None)
        self.poke_router()

    def record(self, r: Req) -> RequestRecord:
        return RequestRecord(
            index=r.i,
            priority=r.spec.priority,
            scheduled_at=r.spec.at,
            sent_at=r.spec.at,
            event_times=list(r.times),
            ended_at=r.times[-1] if r.times else r.spec.at,
            event_tokens=[1] * len(r.times),
            output_tokens=len(r.times),
            prompt_tokens=r.spec.prompt,
            queue_ms=(r.started - r.spec.at) * 1000 if r.times else None,
            status=200 if r.times and r.done else 400 if r.done and not r.lost else 0,
            error=self.outcome(r),
        )

    @staticmethod
    def outcome(r: Req) -> str:
        """Why ``r`` was not served ("": it was)."""
        if r.lost:
            return "its parked group lost a member"
        if not r.done:
            return "not served"
        return "" if r.times else "longer than the context limit"

    # --- router -------------------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        waiting = [
            r.q for r in itertools.islice(itertools.chain(*(q.values() for q in self.queue.values())), 256)
        ]
        engines = [e.view() for e in self.engines]
        self.prefixes.sync(engines)
        self.reuse.sync(engines)
        return Snapshot(
            now=self.now,
            limits=self.limits,
            waiting=waiting,
            queued=sum(len(q) for q in self.queue.values()),
            engines=engines,
            groups=list(self.records.values()),
            tp_load=self.group_loads(),
            state=self.state,
            admitted=self.admitted,
            prompt_tokens=self.admitted_tokens[0],
            output_tokens=self.admitted_tokens[1],
            admitted_high=self.admitted_high,
            prefixes=self.prefixes,
            reuse=self.reuse.counters,
            cost=self.cfg.cost,
            sp_threshold=self.policy.sp_threshold
            if self.policy.sp_threshold is not None
            else self.cfg.sp_threshold,
        )

    def router_round(self) -> None:
        self._router_due = None
        if not self.router_up():
            return
        self.apply(decide(self.snapshot(), self.policy))
        if self.check:
            self.check_invariants()

    def apply(self, d: Decision) -> None:
        """As the router applies a decision (:func:`router.decision.plan`): records, then commands (each member
        reads its command ``command_ms`` later), then assignments."""
        p = plan(d, itertools.islice(self.epochs, len(d.binds)))
        for g in p.records:
            self.records[g.epoch] = g
        for ep in p.drop:
            self.records.pop(ep, None)
        self.state = p.state
        self.log += [(self.now, str(n)) for n in p.events]
        self.note_decisions(d, p.binds)
        for members, cmd in p.sends:
            if self.check and (getattr(cmd, "adopt", False) or getattr(cmd, "scatter", False)):
                lacking = [m for m in members if not self.engines[m].transforms]
                assert not lacking, f"{cmd} sent to {members}, but {lacking} cannot transform KV"
            for m in members:
                self.at(self.now + self.cfg.command_ms / 1000, self.engines[m].command, cmd)
        p.record_dispatches(self.prefixes, self.reuse)
        for x in p.dispatches:
            r = self.queue[PRIORITY_CLASS[x.request.priority]].pop(x.request.id)
            assert r.i not in self.dispatched, f"request {r.i} dispatched twice"
            self.dispatched.add(r.i)
            r.engine, r.epoch = x.engine, x.epoch  # its owner (in a group: the member the policy named)
            self.engines[r.engine].assign()
            if not x.epoch:
                self.dp_rules[x.rule or ""] += 1
            if x.epoch:
                load = self.tp_load.setdefault(x.epoch, [0, 0])
                load[0] += 1
                load[1] += r.kv
                if r.kv > self.kv_per_engine:  # a long request: the group is not retractable while it runs
                    self.tp_long.setdefault(x.epoch, {})[r.i] = r.kv
                else:  # (not lowered: conservative, and below one engine's KV whatever it is)
                    self.tp_max[x.epoch] = max(self.tp_max.get(x.epoch, 0), r.kv)
            e = self.engines[x.engine]
            sg = e.group
            if sg is not None and sg.epoch == x.epoch and x.epoch:
                sg.unit.queue.append(r)
                sg.boundary()
            else:
                e.dp.queue.append(r)
                e.boundary()

    def note_decisions(self, d: Decision, binds: list[Group]) -> None:
        self.decisions += [SimDecision(self.now, "bind", g.epoch, g.members, g.reason) for g in binds]
        self.decisions += [
            SimDecision(self.now, "release", n.epoch, n.members, n.reason, n.cause) for n in d.releases
        ]

    # --- binding ------------------------------------------------------------------------------------------

    def arrive(self, b: Bind, idx: int) -> None:
        if all(self.engines[m].arrived == b.epoch for m in b.members):
            g = SimGroup(self, b, merged=True, cache=True)
            for m in b.members:
                self.engines[m].join(g, b.epoch)
            self.groups[b.epoch] = g
            self.at(self.now + (self.cfg.cost.switch_ms + g.transform_ms) / 1000, self.formed, g)
        self.note_states()

    def note_transform(self, kind: str, ms: float, requests: int) -> None:
        self.transforms.append((self.now, kind, ms, requests))

    def formed(self, g: SimGroup) -> None:
        g.form()
        self.bound_at[g.epoch] = self.now
        for m in g.members:
            self.engines[m].beat(self.now)
        self.note_states()
        self.poke_router()
        g.boundary()

    def dissolve(self, g: SimGroup) -> None:
        self.groups.pop(g.epoch, None)
        for m in g.members:
            self.engines[m].leave(self.now)
        for m in g.members:
            self.engines[m].boundary()
        self.note_states()
        self.poke_router()

    # --- parking --------------------------------------------------------------------------------------------

    def park(self, g: SimGroup, reqs: list[Req]) -> None:
        """``reqs`` stay on ``g``'s members, each holding its head slices of their KV, until a bind resumes them."""
        self.parked[g.epoch] = (g.members, reqs)
        share = -(-sum(kv_in_use(r) for r in reqs) // len(g.members))
        for m in g.members:
            self.engines[m].parked[g.epoch] = share
        self.stats["parked"] += len(reqs)

    def unpark(self, epoch: int) -> list[Req]:
        members, reqs = self.parked.pop(epoch)
        for m in members:
            self.engines[m].parked.pop(epoch, None)
        self.stats["resumed"] += len(reqs)
        return reqs

    def requeue(self, r: Req) -> None:
        """``r`` ended on its engine before its first token (a group gave it up): the gateway queues it again."""
        if r.epoch:
            load = self.tp_load[r.epoch]
            load[0] -= 1
            load[1] -= r.kv
            self.tp_long.get(r.epoch, {}).pop(r.i, None)
        self.engines[r.engine].assign(-1)
        self.dispatched.discard(r.i)
        r.engine, r.epoch, r.started = -1, 0, float("nan")
        self.queue[PRIORITY_CLASS[r.spec.priority]][r.q.id] = r
        self.stats["requeued"] += 1
        self.poke_router()

    def discard(self, epoch: int) -> None:
        """The router ended ``epoch``'s parked requests (a member was lost): they end unserved."""
        if epoch not in self.parked:
            return
        for r in self.unpark(epoch):
            r.done = r.lost = True
            self.finished += 1
            self.engines[r.engine].assign(-1)
        self.stats["parked_lost"] += 1

    def _static_groups(self, w: int, shift: bool) -> None:
        """Static groups of ``w`` engines, inside each node."""
        n = self.cfg.per_node
        for start in (s for node in range(0, self.cfg.engines, n) for s in range(node, node + n - w + 1, w)):
            epoch = next(self.epochs)
            members = tuple(range(start, start + w))
            b = Bind(epoch=epoch, members=members)
            g = SimGroup(self, b, merged=False, shift=shift, cache=True)
            g.form()
            for m in members:
                self.engines[m].join(g, epoch)
            self.groups[epoch] = g
            self.records[epoch] = Group(epoch=epoch, members=members, reason="manual", state="bound")

    # --- invariants (tests) -------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        seen: dict[int, int] = {}
        for g in self.records.values():
            if g.state == "parked":  # (released: its members serve DP, and resume it)
                continue
            assert len({self.cfg.node_of(m) for m in g.members}) == 1, (
                f"epoch {g.epoch} spans nodes {g.members}"
            )
            for m in g.members:
                assert m not in seen, f"engine {m} in epochs {seen[m]} and {g.epoch}"
                seen[m] = g.epoch
        for e in self.engines:
            if e.group is not None:
                assert seen.get(e.idx) == e.group.epoch or self.records.get(e.group.epoch) is None, (
                    f"engine {e.idx} bound in epoch {e.group.epoch} but recorded in {seen.get(e.idx)}"
                )
        grace = self.limits.max_defer_s + self.cfg.tick_s + 2 * self.cfg.router_ms / 1000
        for ep, sg in self.groups.items():
            paused = any(self.engines[m].paused_running or self.engines[m].paused_queue for m in sg.members)
            rec = self.records.get(ep)
            start = self.bound_at.get(ep, self.now)  # the router's clock: it restarts after a router outage
            start = max([start] + [b for a, b in self.cfg.router_down if a < self.now and b > start])
            late = self.now - start > grace
            if sg.formed and paused and rec is not None and rec.reason != "manual" and late:
                assert rec.state == "releasing", f"epoch {ep} defers DP work beyond {grace:.2f} s"
                # and the release retracts (the paused work resumes after one group step), unless a request
                # needs the group's pooled KV
                top = self.group_loads()[ep].max_kv_tokens if rec.carries else self.group_max_kv(ep)
                stuck = self.now - rec.since > 1.0 and top <= self.cfg.cost.kv_tokens
                assert not stuck, f"epoch {ep} released {self.now - rec.since:.2f} s ago still defers DP work"
        places = sum(len(q) for q in self.queue.values()) + len(self.dispatched)
        arrived = sum(1 for r in self.reqs if r.spec.at <= self.now and not (r.done and not r.times))
        assert places == arrived, "a request was lost or duplicated"
