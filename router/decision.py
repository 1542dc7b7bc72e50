"""What one policy round decides (:class:`Decision`), the typed reasons behind it, and how it is applied.

The policy (:func:`router.policy.decide`) states every group change as a value: a :class:`BindNote` (the group's
reason and :class:`BindMode`), a :class:`ReleaseNote` (its :class:`ReleaseCause` and :class:`ReleaseMode`), a
:class:`PlanNote`, a :class:`DistrustNote`. Log text is made from them (``str(note)``), never parsed back.

Both appliers, the live router (:mod:`router.dispatcher`, against Redis) and the simulator (:mod:`sim.simulator`,
as events), apply a decision through :func:`plan`: it numbers the new groups and lists, in the order that keeps
the cluster consistent, the records to write, the commands to send (to whom) and the assignments to make.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

import msgspec

from flying.messages import (
    Bind,
    Command,
    DecisionEvent,
    FastTarget,
    Group,
    GroupReason,
    QueuedRequest,
    Release,
    RouterState,
)
from router.planner import Choice, Demand
from router.prefix_index import PrefixIndex
from router.reuse import Reuse

# why a DP dispatch went where it did: followed its prefix; least loaded because dispatch is least-loaded, the
# request has no chain, no engine holds router.dp_dispatch.CACHE_THRESHOLD of it, or loads are out of balance (metrics label values)
DpRule = Literal["prefix", "least-loaded", "no-chain", "no-match", "imbalanced"]


class BindMode(StrEnum):
    """How a bind takes its members' DP work (the ``mode`` label of ``flying_router_binds``)."""

    HARD = "hard"  # paused, KV kept
    SEQUENTIAL = "sequential"  # drained first
    SOFT = "soft"
    ADOPT = "adopt"  # becomes the group's (KV transformed)
    KEEP = "keep"  # keeps running beside the group's steps (mixed steps)

    @classmethod
    def of(cls, g: Group) -> BindMode:
        return cls.ADOPT if g.adopt else cls.KEEP if g.keep else cls(g.preempt)


class ReleaseMode(StrEnum):
    """How a release treats the group's TP requests (the ``mode`` label of ``flying_router_releases``)."""

    WAIT = "wait"  # they finish in the group first
    RETRACT = "retract"  # recomputed in DP on the leader
    SCATTER = "scatter"  # continue in DP on their owners, KV moved
    PARK = "park"  # as scatter; those no owner holds stay parked on the members (KV kept) until a resume

    @classmethod
    def of(cls, cmd: Release | None) -> ReleaseMode:
        return cls.WAIT if cmd is None else cls(cmd.kind)

    def command(self, epoch: int) -> Release:
        return Release(
            epoch=epoch,
            retract=self is ReleaseMode.RETRACT,
            scatter=self is ReleaseMode.SCATTER,
            park=self is ReleaseMode.PARK,
        )


class ReleaseCause(StrEnum):
    """Why the policy released a group."""

    MEMBER_GONE = "a member is gone"
    NOT_ACKNOWLEDGED = "did not acknowledge"  # a member did not acknowledge the bind within ack_timeout_s
    NOT_BOUND = "not bound"  # the bind did not complete within bind_timeout_s
    BROKE_UP = "the group broke up (a member aborted the epoch)"
    LOAD_ROSE = "load rose"
    DP_DEFERRED = "DP work deferred"  # the bind paused DP work for max_defer_s
    NO_TP_WORK = "no TP work"  # for releases.KEEP_S
    MAKING_ROOM = "making room"  # for a wider (long-context) group
    PARKED_LOST = "a member of the parked group is gone"  # its parked requests cannot resume: they end
    # their clients left (or timed out) while parked: their KV is freed
    PARKED_LEFT = "its parked requests ended"
    WIDENING = "widening"  # light load: the block around it can bind at the load groups' full width
    # engines bound in an epoch whose record is gone (a late bind)
    UNKNOWN_EPOCH = "no record knows the epoch"


@dataclass(frozen=True)
class ReleaseNote:
    """One release the round sends: the group, how and why. ``seconds``: the timeout or wait that triggered it;
    ``engines``: the members that did not acknowledge; ``width``: the group it makes room for."""

    epoch: int
    members: tuple[int, ...]
    reason: GroupReason
    mode: ReleaseMode
    cause: ReleaseCause
    seconds: float = 0.0
    engines: tuple[int, ...] = ()
    width: int = 0

    @property
    def command(self) -> Release:
        return self.mode.command(self.epoch)

    @property
    def why(self) -> str:
        c, s = self.cause, self.seconds
        if c is ReleaseCause.NOT_ACKNOWLEDGED:
            return f"{list(self.engines)} {c} within {s:g} s: rolled back"
        if c is ReleaseCause.NOT_BOUND:
            return f"{c} within {s:g} s: rolled back"
        if c in (ReleaseCause.DP_DEFERRED, ReleaseCause.NO_TP_WORK):
            return f"{c} for {s:g} s"
        if c is ReleaseCause.MAKING_ROOM:
            return f"{c} for a width-{self.width} group"
        if c is ReleaseCause.WIDENING:
            return f"{c}: its block binds at width {self.width}"
        return str(c)

    def __str__(self) -> str:
        how = {
            ReleaseMode.SCATTER: " by scatter",
            ReleaseMode.RETRACT: " retracting",
            ReleaseMode.PARK: " parking what no owner holds",
        }.get(self.mode, "")
        return f"release epoch {self.epoch} {self.members} ({self.reason}){how}: {self.why}"


@dataclass(frozen=True)
class BindNote:
    """One bind the round plans: its members, reason and mode (``adopt_ms``: an adoption's estimated stall), the
    step mode its bind sets (``sp_threshold``: prefill steps of at least this many batched tokens run
    sequence-parallel, smaller and decode steps TP; 0: TP only; None: the workers' own threshold) and the cluster's
    ``engines`` (a group as wide as the cluster runs every prefill over all of them)."""

    members: tuple[int, ...]
    reason: GroupReason
    mode: BindMode
    adopt_ms: float = 0.0
    sp_threshold: int | None = None
    engines: int = 0
    resumes: int = 0  # the parked epoch whose requests it continues

    @property
    def steps(self) -> str:
        """How the group's steps run, in words."""
        if self.sp_threshold == 0:
            return "TP steps"
        at = "the workers' threshold" if self.sp_threshold is None else f"{self.sp_threshold} tokens"
        return f"SP steps from {at}, TP below"

    def __str__(self) -> str:
        if self.mode is BindMode.ADOPT:
            how = f"adoption, {self.adopt_ms:.0f} ms"
        elif self.mode is BindMode.KEEP:
            how = "DP work kept running beside it"
        else:
            how = f"{self.mode} preemption"
        of = f" of {self.engines} engines" if self.engines else ""
        resume = f"; resumes epoch {self.resumes}'s parked requests" if self.resumes else ""
        return (
            f"bind {self.members} ({self.reason}, {how}; width {len(self.members)}{of}: {self.steps}{resume})"
        )


@dataclass(frozen=True)
class PlanNote:
    """Node ``node`` changes its load width from ``was`` to the planner's choice (1: DP), with the predictions
    it compared (the chosen width's and the best other's) and the demand they were made for."""

    node: str
    was: int
    plan: Choice
    demand: Demand

    @property
    def busy(self) -> bool:
        return self.plan.width == 1

    def __str__(self) -> str:
        d, w = self.demand, self.plan.width
        what = "back to DP" if w == 1 else f"load groups of width {w}"
        mix = f"{d.rate:.1f} req/s of {d.prompt:.0f}/{d.output:.0f} tokens, {d.backlog:.0f} queued"
        if d.cached:
            mix += f", {d.cached:.0%} of prompts cached"
        return f"node {self.node}: {what} ({self.plan}; {mix})"


@dataclass(frozen=True)
class DistrustNote:
    """Engines that failed a bind and are left out of binds for ``seconds``; ``paused``: the DP requests their
    bind by adoption paused instead of moving (0: the bind itself failed)."""

    engines: tuple[int, ...]
    seconds: float
    paused: int = 0

    def __str__(self) -> str:
        why = f" (their adoption paused {self.paused} DP requests)" if self.paused else ""
        return f"engines {list(self.engines)} not picked for binds for {self.seconds:g} s{why}"


class WaitCause(StrEnum):
    """Why a long request waits for calm (:mod:`router.long_wait`), or why its wait ended."""

    BUSY = "load is not light"
    BACKLOG = "the engines hold a backlog"
    TURN = "another long request runs"
    CALM = "calm"  # the wait ended: the load is calm
    BOUND = "waited long_wait_s"  # the wait ended: its bound

    @property
    def ended(self) -> bool:
        return self in (WaitCause.CALM, WaitCause.BOUND)


@dataclass(frozen=True)
class LongWaitNote:
    """A long request (``kv_tokens``) began waiting for calm (``cause``: why the load is not calm; at most
    ``bound_s``), or ended its wait after ``waited_s`` (``cause``: calm, or the bound); ``demand``: queued and
    inflight requests then."""

    request: str
    kv_tokens: int
    cause: WaitCause
    bound_s: float
    demand: int
    waited_s: float = 0.0

    def __str__(self) -> str:
        what = f"long request {self.request} ({self.kv_tokens:,} tokens)"
        if self.cause is WaitCause.CALM:
            return f"{what} waited {self.waited_s:.1f} s: calm ({self.demand} requests), it binds now"
        if self.cause is WaitCause.BOUND:
            return f"{what} waited {self.waited_s:.1f} s, its bound: it binds now ({self.demand} requests)"
        return f"{what} waits for calm, at most {self.bound_s:g} s: {self.cause} ({self.demand} requests)"


Note = BindNote | ReleaseNote | PlanNote | DistrustNote | LongWaitNote


@dataclass(frozen=True)
class Dispatch:
    request: QueuedRequest
    engine: int  # the DP engine, or the member of the group that owns it (router.placement.owner)
    url: str
    epoch: int = 0  # the TP group's epoch (0: DP)
    rule: DpRule | None = None  # how a DP dispatch chose its engine (None: a TP dispatch)


@dataclass
class Decision:
    dispatches: list[Dispatch] = field(default_factory=list)
    binds: list[Group] = field(default_factory=list)  # new records, epoch 0: the caller assigns epochs
    put: dict[int, Group] = field(default_factory=dict)  # changed records by epoch
    drop: list[int] = field(default_factory=list)  # records to delete (the group is gone)
    commands: list[tuple[tuple[int, ...], Command]] = field(default_factory=list)  # releases
    state: RouterState = field(default_factory=RouterState)
    events: list[Note] = field(default_factory=list)  # why groups and the regime changed, in order
    fast: list[FastTarget] = field(default_factory=list)  # where a short request may go before the next round
    sp_threshold: int | None = None  # every bind's Bind.sp_threshold (PolicyConfig.sp_threshold)

    @property
    def notes(self) -> list[str]:
        """The events as log lines."""
        return [str(e) for e in self.events]

    @property
    def releases(self) -> list[ReleaseNote]:
        """One per release command, in the order of :attr:`commands`."""
        return [e for e in self.events if isinstance(e, ReleaseNote)]

    def release(self, note: ReleaseNote) -> None:
        """Send ``note``'s release to the group's members."""
        self.commands.append((note.members, note.command))
        self.events.append(note)

    def bind_command(self, g: Group) -> tuple[tuple[int, ...], Command]:
        bind = Bind(
            epoch=g.epoch,
            members=g.members,
            preempt=g.preempt,
            adopt=g.adopt,
            keep=g.keep,
            resume=g.resumes,
            sp_threshold=self.sp_threshold,
        )
        return g.members, bind


@dataclass(frozen=True)
class Plan:
    """A decision ready to apply, in this order: write :attr:`records` and delete :attr:`drop` (with the
    regime, :attr:`state`), then send :attr:`sends`, then make :attr:`dispatches`. A group's record exists before
    any command about it is sent, so an applier that dies between steps leaves nothing unknown behind."""

    binds: list[Group]  # the new groups, numbered
    records: list[Group]  # changed and new group records
    drop: list[int]
    state: RouterState
    sends: list[tuple[tuple[int, ...], Command]]  # (members, command): releases, then binds
    dispatches: list[Dispatch]
    events: list[Note]

    @property
    def dp_dispatches(self) -> list[Dispatch]:
        """Dispatches to DP engines (their prompts go through the engine's prefix cache)."""
        return [x for x in self.dispatches if not x.epoch]

    def log(self, ts: float) -> list[DecisionEvent]:
        """The events as decision-log entries at ``ts`` (each bind with the epoch :func:`plan` gave it)."""
        epochs = iter(g.epoch for g in self.binds)  # a round's bind notes are in the order of its binds
        return [log_entry(n, ts, next(epochs) if isinstance(n, BindNote) else 0) for n in self.events]

    def record_dispatches(self, prefixes: PrefixIndex, reuse: Reuse) -> None:
        """The DP dispatches' prompts enter the engines' prefix caches (the caller's index records them); every
        dispatch's prompt counts in what repeats (:mod:`router.reuse`)."""
        for x in self.dp_dispatches:
            prefixes.record(x.engine, x.request.chain)
        for x in self.dispatches:
            reuse.observe(x.engine, x.request.chain, x.request.prompt_tokens)


def log_entry(note: Note, ts: float, epoch: int = 0) -> DecisionEvent:
    """``note`` as an entry of the decision log (``epoch``: a bind's, which the note does not know)."""
    text = str(note)
    match note:
        case BindNote():
            return DecisionEvent(
                ts=ts, kind="bind", text=text, epoch=epoch, members=note.members, reason=note.reason
            )
        case ReleaseNote():
            return DecisionEvent(
                ts=ts,
                kind="release",
                text=text,
                epoch=note.epoch,
                members=note.members,
                reason=note.reason,
                cause=note.cause.value,
            )
        case PlanNote():
            return DecisionEvent(ts=ts, kind="regime", text=text, busy=note.busy)
        case DistrustNote():
            return DecisionEvent(ts=ts, kind="distrust", text=text, members=note.engines)
        case LongWaitNote():
            return DecisionEvent(ts=ts, kind="wait", text=text, reason="long", cause=note.cause.value)


def plan(d: Decision, epochs: Iterable[int]) -> Plan:
    """Number ``d``'s new groups with ``epochs`` (fresh, one per bind: the applier's counter) and order the rest."""
    numbers: Sequence[int] = list(epochs)
    if len(numbers) != len(d.binds):
        raise ValueError(f"{len(d.binds)} binds need as many epochs, got {len(numbers)}")
    binds = [msgspec.structs.replace(g, epoch=ep) for g, ep in zip(d.binds, numbers)]
    return Plan(
        binds=binds,
        records=[*d.put.values(), *binds],
        drop=list(d.drop),
        state=d.state,
        sends=[*d.commands, *map(d.bind_command, binds)],
        dispatches=list(d.dispatches),
        events=list(d.events),
    )
