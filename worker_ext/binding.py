"""Bind and release one engine at a step boundary: the per-engine DP<->TP state machine.

States: DP -> pending bind (``PendingBind``) -> bound (an ``Epoch``) -> DP, or straight into the next epoch (a width
change). ``Binding`` is the only object that moves an engine between them; it composes the parts that own the rest
of the switching state, each changed only through its own methods:

- ``PendingBind`` (worker_ext.preemption): the bind not yet entered and the DP work held back for it;
- ``Layout`` (worker_ext.layout): weights, heads, reductions, KV views and the sub-slot allocator at a width;
- ``Ownership`` (worker_ext.ownership): who streams each TP request, the leader's outbox, a follower's own requests;
- ``Shadows`` / ``StepPlans`` (worker_ext.step_plan): a follower's rows for TP requests, the plans themselves;
- ``MemberRelay`` (worker_ext.member_relay): what reaches a follower's endpoint (aborts, new requests), relayed
  to the leader;
- ``Adoption`` (worker_ext.adoption): the KV transformation at bind (adopt) and release (scatter);
- ``Parking`` (worker_ext.parking): requests parked at a release, KV kept, until a bind resumes them.

Everything SGLang is reached through one ``SchedulerSurface`` (worker_ext.sglang_patches.surface).

Bind (every member, at its next clean step boundary): deal with its DP work (adopt it into the group with its KV;
pause it with its KV, hard preemption; or drain it first), point the weights at its shard, view the KV pool at the
group's width and carve TP slots from the engine's one allocator, give the row-parallel layers the pooled group.
The leader (first member) keeps its scheduler loop: it forms each batch, broadcasts a step plan before every
forward and samples; followers leave their loop and execute the plans (:meth:`Binding.follow`) until the leader
broadcasts the release. Each request streams from the engine it arrived on.

Release (leader): once its TP requests have finished; at once by retraction (they are recomputed in DP on the
leader); or at once by scatter (they continue in DP on their owners, KV moved); or at once by parking (those no
member holds alone stay where they are, KV kept, the rest scatter). Every member then restores its DP layout and
resumes its paused DP work, KV intact. A bind with ``resume`` installs the parked epoch's KV allocator again and
continues its requests.

A member that dies or stalls makes the pooled group's next operation fail (at once for a dead process, after the
group timeout for a hung one): the survivors abort the epoch, go back to DP and abort their TP requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flying.messages import Bind, Command, Release
from flying.sources import without_sources
from worker_ext.adoption import Adoption, Work
from worker_ext.comm_pool import peer_lost
from worker_ext.epoch import Epoch, Leave, NotEntered
from worker_ext.intake import Intake, intake
from worker_ext.kv_transform import Held
from worker_ext.member_relay import POLL_S, MemberRelay
from worker_ext.ownership import Ownership
from worker_ext.parking import Parking
from worker_ext.preemption import PendingBind
from worker_ext.rank_messages import Forward, Handshake, Noop, ReleasePlan
from worker_ext.sequence_parallel import StepMode, choose_mode
from worker_ext.sglang_patches import LOCAL_GROUP, RequestLimits
from worker_ext.sglang_patches.surface import SchedulerSurface, Stash
from worker_ext.step_costs import StepCosts
from worker_ext.step_plan import Shadows, StepPlans

if TYPE_CHECKING:
    from worker_ext.comm_pool import CommPool
    from worker_ext.heartbeat import Load
    from worker_ext.layout import Layout

ERROR_KEEP_S = 600.0  # seconds a failed switch's error stays in the heartbeat (one that works clears it)
log = logging.getLogger("flying.binding")
BEAT_S = 0.5  # how often a follower re-publishes its heartbeat (step counts, load) while it follows


class HandshakeMismatch(NotEntered):
    """A member's first message from its leader is not the handshake of the epoch it bound."""


class Binding:
    def __init__(
        self,
        engine: SchedulerSurface,
        index: int,
        pool: CommPool,
        layout: Layout,
        on_change: Callable[[], None] | None = None,
        sp_threshold: int = 0,
        costs: StepCosts | None = None,
    ) -> None:
        """``on_change``: re-publish the heartbeat (a follower's loop is blocked); ``sp_threshold``: the batched
        tokens from which a bound step runs sequence-parallel, unless a bind says otherwise (0: never);
        ``costs``: where its forwards' times are recorded (a CPU engine's, by default)."""
        self.costs = costs or StepCosts("cpu")
        self.engine, self.index, self.pool, self.layout = engine, index, pool, layout
        self.sp_threshold = sp_threshold
        self.steps = {StepMode.TP: 0, StepMode.SP: 0}  # forwards run while bound, by mode
        self.on_change = on_change or (lambda: None)
        self.pending = PendingBind(engine, index, pool)
        self.ownership = Ownership(engine)
        self.shadows = Shadows(engine)
        self.plans = StepPlans(engine, self.shadows)
        self.relay = MemberRelay(engine, index, pool)
        self.adoption = Adoption(engine, index, layout, self.ownership, self.shadows)
        self.parking = Parking(engine, index)
        self.epoch: Epoch | None = None
        self.last_epoch = 0  # the newest epoch this engine has bound (or seen rolled back)
        self._stash: Stash | None = None  # the paused DP work, while bound
        # clients' aborts of DP work set aside (paused or held), applied once it is back in SGLang's queues
        self._aborted_aside: list[str] = []
        self._dp_limits: RequestLimits | None = None  # the engine's own limits, while bound
        self.bind_ms = self.release_ms = 0.0
        self.error, self._error_at = "", 0.0  # why the last switch failed, and when (time.monotonic)
        self.param_bytes = layout.param_bytes()

    # --- state reported in heartbeats ---------------------------------------------------------------------

    def status(self) -> Load:
        e = self.epoch
        return {
            "mode": "tp" if e else "dp",
            "epoch": e.epoch if e else 0,
            "pending": self._pending_epoch(),
            "paused": self.engine.stash_size(self._stash) if self._stash is not None else 0,
            "group": e.members if e else (),
            "width": e.width if e else 1,
            "bind_ms": round(self.bind_ms, 3),
            "release_ms": round(self.release_ms, 3),
            "switch_error": self.error if time.monotonic() - self._error_at < ERROR_KEEP_S else "",
            "comm_groups": len(self.pool.groups),
            "comm_rebuilds": self.pool.rebuilds,
            "pool_ready": self.pool.ready.is_set(),
            "num_engines": self.pool.num_engines,
            "pool_first": self.pool.first,
            "param_bytes": self.param_bytes,
            # its own, not the group's
            **({"max_total_tokens": self._dp_limits.max_total_tokens} if e and self._dp_limits else {}),
            "kv_transform": True,
            "park": True,
            "parked": self.parking.epochs(),
            "steps_tp": self.steps[StepMode.TP],
            "steps_sp": self.steps[StepMode.SP],
            "device": self.costs.device,
            "sp_threshold": self.sp_threshold,
            "step_costs": self.costs.samples(),
            **({"comm_ms": {k: round(v, 3) for k, v in e.group.spent_ms.items()}} if e else {}),
            **self.adoption.stats,
        }

    # --- step boundary ------------------------------------------------------------------------------------

    def _pending_epoch(self) -> int:
        """The bind read and not applied yet: a pending one, or, bound, a width change (0: none)."""
        return self.pending.epoch or (self.epoch.changing_to if self.epoch else 0)

    def note_abort(self, rid: str) -> None:
        """A client's abort, after SGLang's own handling: one of the DP requests set aside (paused under the group,
        or held back for a pending bind) is out of SGLang's sight; the abort is applied again once they are back
        in its queues (:meth:`on_step`), so they end there instead of running for nobody."""
        aside = self.engine.stashed_rids(self._stash) if self._stash is not None else set()
        aside |= {r.rid for r in self.pending.peek_held()}
        if any(r.startswith(rid) for r in aside):
            self._aborted_aside.append(rid)

    def on_step(self, commands: list[Command]) -> None:
        """The scheduler's step boundary: take the router's commands, enter a ready bind, and as a bound leader
        take what members relayed (aborts, new requests) and release (or keep the group alive)."""
        if self._aborted_aside and self._stash is None and not self.pending.held:
            aborted, self._aborted_aside = self._aborted_aside, []
            for rid in aborted:  # the work set aside is back in SGLang's queues: its own abort ends it now
                self.engine.abort(rid)
            log.info("engine %d: %d aborts of DP work that was set aside applied", self.index, len(aborted))
        for cmd in commands:
            self._take(cmd)
        if self.epoch is None:
            ready = self.pending.take_ready()
            if ready is not None:
                self._enter(ready)
            return
        e = self.epoch
        if not e.leader:
            return
        if e.failed is not None:
            self.abort(e.failed)
            return
        try:
            self.relay.apply(e, self.ownership)
            self._lead(e)
        except RuntimeError as exc:
            self.abort(exc)

    def _take(self, cmd: Command) -> None:
        e = self.epoch
        if isinstance(cmd, Release) and cmd.epoch in self.parking and not cmd.park:
            # a plain release of a parked epoch: its group cannot resume, its requests end (a follower reads the
            # park itself only after its leader has carried it out: that one changes nothing)
            self.parking.discard(cmd.epoch, "released by the router")
            if self.epoch is None and not self.parking:
                self.engine.resume_idle_checks()
            self.on_change()
            return
        match intake(cmd, self.index, self.last_epoch, e.epoch if e else 0, self._pending_epoch()):
            case Intake.BIND if isinstance(cmd, Bind):
                self.pending.accept(cmd)
            case Intake.WIDTH_CHANGE if isinstance(cmd, Bind) and e is not None:
                e.ask_width_change(cmd)
            case Intake.RELEASE if isinstance(cmd, Release) and e is not None:
                if e.changing_to:  # the epoch is ended before its width change applied: the change is off
                    self.last_epoch = max(self.last_epoch, e.cancel_width_change())
                e.ask_release(cmd.retract, cmd.scatter, cmd.park)
            case Intake.CANCEL if e is not None and e.changing_to == cmd.epoch:
                # a width change rolled back (its members were still serving this epoch's requests)
                self.last_epoch = max(self.last_epoch, e.cancel_width_change())
                log.info(
                    "engine %d: width change to epoch %d rolled back before it was applied",
                    self.index,
                    cmd.epoch,
                )
                self.on_change()
            case Intake.CANCEL:  # the router rolled the bind back before this engine applied it
                self.last_epoch = max(self.last_epoch, self.pending.cancel())
                self.on_change()

    def _lead(self, e: Epoch) -> None:
        """Leader, bound, at a step boundary."""
        live = bool(self.engine.live_rids())
        clean = self.engine.at_clean_step_boundary()
        if e.park and not clean:  # a long request in its prefill would hold the park up: it starts over later
            self.parking.requeue_prefilling(self._dp_limits_now().max_total_tokens, self.ownership)
        action = e.next_action(live, self.ownership.has_copies) if clean else Leave.STAY
        if (
            action is Leave.SCATTER
        ):  # at once, no recompute: every TP request back to DP on its owner, KV moved
            held = self.adoption.scatter_manifest()
            e.group.broadcast_object(
                ReleasePlan(e.next_bind, held, self.ownership.take_outbox(), **self._news())
            )
            self._scatter_and_leave(held, e.next_bind)
        elif action is Leave.PARK:  # at once: those no member holds alone stay, KV kept; the rest scatter
            rids = self.parking.to_park(self._dp_limits_now().max_total_tokens)
            if rids:
                self.parking.park(e, rids, self.layout.sub_allocator(), self.ownership, self.shadows)
            held = self.adoption.scatter_manifest()
            e.group.broadcast_object(
                ReleasePlan(None, held, self.ownership.take_outbox(), sorted(rids), **self._news())
            )
            self._scatter_and_leave(held, None)
        elif action is Leave.RETRACT:
            # SGLang's retraction frees their TP KV; after the release they are recomputed in DP, here
            moved = self.engine.retract_running() + self.engine.hold_waiting()
            e.group.broadcast_object(ReleasePlan(None, None, self.ownership.take_outbox(), **self._news()))
            self._leave(None)
            self.engine.queue_back(moved)
            log.info("engine %d: %d TP requests continue in DP", self.index, len(moved))
        elif action is Leave.DRAINED:
            e.group.broadcast_object(
                ReleasePlan(e.next_bind, None, self.ownership.take_outbox(), **self._news())
            )
            self._leave(e.next_bind)
        elif self.ownership.has_outbox or self.plans.keepalive_due():
            e.group.broadcast_object(Noop(self.ownership.take_outbox(), **self._news()))
            self.plans.sent()

    def _news(self) -> dict[str, Any]:
        """Leader, under a group prefix tree: the virtual slots it freed since its last message, and the row
        entries its tree's checkpoints pointed elsewhere (what followers' copies follow)."""
        return {"freed": self.layout.sub_allocator().take_freed(), "repoints": self.engine.take_repoints()}

    # --- a follower's loop --------------------------------------------------------------------------------

    def follow(self) -> None:
        """A follower's loop while bound: apply the leader's messages in order until the epoch ends (publishing
        its heartbeat every ``BEAT_S``: its scheduler loop, which beats otherwise, is not running)."""
        e, beat = self.epoch, time.monotonic()
        while e is not None and self.epoch is e:
            if time.monotonic() - beat > BEAT_S:
                self.on_change()
                beat = time.monotonic()
            try:
                msg = e.group.broadcast_object()
                if not isinstance(msg, Forward | Noop | ReleasePlan):
                    raise RuntimeError(f"epoch {e.epoch}: unexpected message from the leader: {msg!r}")
                self.ownership.deliver(msg.emit)
                self.relay.forward(e, self.ownership)  # its own clients' input (its loop cannot read it)
                if not isinstance(msg, Forward):
                    self.plans.follow(msg.freed, msg.repoints, self.layout.sub_allocator().aliases)
                if isinstance(msg, ReleasePlan) and msg.parked:
                    sub = self.layout.sub_allocator()
                    self.parking.park(e, set(msg.parked), sub, self.ownership, self.shadows)
                if isinstance(msg, ReleasePlan) and msg.scatter is not None:
                    self._scatter_and_leave(msg.scatter, msg.next)
                    return
                if isinstance(msg, ReleasePlan):
                    self._leave(msg.next)
                    return
                if isinstance(msg, Forward):
                    self.layout.step_mode(msg.mode)
                    self.plans.execute(msg, self.layout.sub_allocator().aliases)
            except RuntimeError as exc:
                self.abort(exc)

    # --- the forward hook ---------------------------------------------------------------------------------

    def around_forward(
        self, original: Callable[..., Any], runner: Any, forward_batch: Any, *args: Any, **kwargs: Any
    ) -> Any:
        """Every ``ModelRunner.forward``: unbound, as is (the batch is kept as the template followers fill in);
        bound, the leader broadcasts the plan first, and the all-reduces go over the group."""
        e = self.epoch
        tokens = self.engine.step_tokens(forward_batch)
        if e is None:
            self.plans.keep_template(forward_batch)
            return self.costs.timed("dp", 1, tokens, lambda: original(runner, forward_batch, *args, **kwargs))
        try:
            if e.leader and not e.failed:
                mode = choose_mode(tokens, e.width, e.sp_threshold)
                plan = self.plans.plan(forward_batch, self.ownership.take_outbox(), mode, **self._news())
                e.group.broadcast_object(plan)
                self.plans.sent()
                self.layout.step_mode(mode)
            if not e.failed:
                self.steps[self.layout.mode] += 1
                with self.engine.tp_group(e.group):
                    return self.costs.timed(
                        self.layout.mode.value,
                        e.width,
                        tokens,
                        lambda: original(runner, forward_batch, *args, **kwargs),
                    )
        except RuntimeError as exc:
            if not e.leader:
                raise  # a follower's follow() aborts the epoch
            e.fail(exc)
            self.error, self._error_at = f"epoch {e.epoch} aborted: {_why(exc)}", time.monotonic()
            log.error("engine %d: %s", self.index, self.error, exc_info=None if peer_lost(exc) else exc)
        # The group is gone mid-step. Finish this step alone (the scheduler needs its output), with every request
        # of the batch ending in an abort; the next step boundary ends the epoch (see on_step).
        self.engine.abort_batch(f"tensor-parallel group {e.members} lost a member; request aborted")
        self.layout.step_mode(StepMode.TP)  # no collective: an SP step would exchange with the lost member
        with self.engine.tp_group(LOCAL_GROUP):
            return original(runner, forward_batch, *args, **kwargs)

    # --- bind ---------------------------------------------------------------------------------------------

    def _enter(self, cmd: Bind) -> None:
        """Bind; a follower then serves step plans until its group is released."""
        if self._bind(cmd):
            if self.epoch is not None and not self.epoch.leader:
                self.follow()
        elif self.epoch is None and self._stash is not None:  # a refused width change: back to DP
            self._resume_dp()
        else:  # a refused sequential or adopting bind: let the held DP work in
            self.pending.let_held_in()

    def _bind(self, cmd: Bind) -> bool:
        t0 = time.perf_counter()
        try:
            group = self.pool.get(tuple(cmd.members))
        except (KeyError, RuntimeError) as exc:
            self.error, self._error_at = (
                f"bind {cmd.epoch} refused: {without_sources(str(exc))}",
                time.monotonic(),
            )
            log.error(self.error)
            return False
        width, rank = len(cmd.members), cmd.members.index(self.index)
        restart = []
        if cmd.preempt == "soft" and rank == 0:  # the group's requests started in DP mode: re-prefill them
            restart = self.engine.retract_running() + self.engine.hold_waiting()
        work = self.adoption.adoptable_work(self.pending.peek_held()) if cmd.adopt else None
        if self._stash is None:  # from DP (a width change keeps the paused DP work and limits as they are)
            # adopting: the DP work stays where it is until the handshake (then it moves or is paused)
            self._stash = (
                self.engine.empty_stash()
                if cmd.adopt
                else self.engine.stash_dp_work(self.pending.take_held())
            )
            self.engine.suspend_idle_checks()
            self._dp_limits = self.engine.request_limits()
        self.engine.queue_front(restart)
        self.engine.set_request_limits(self._dp_limits_now(), width)
        parked = self.parking.holds(cmd.resume, tuple(cmd.members), rank) if cmd.resume else False
        resumed = self.parking.sub_for(cmd.resume, tuple(cmd.members), rank) if parked else None
        sub = self.layout.bind(width, rank, group, resumed)
        # the DP prefix tree: kept, not used by TP requests; a leader's group tree serves them instead
        cache = None
        if rank == 0:
            cache = self.parking.cache_for(cmd.resume) if parked else self.engine.new_group_cache()
        if cache is not None and sub.free_log is None:
            sub.free_log = []
        self.engine.bypass_prefix_cache(sub.base, width, cache)
        threshold = self.sp_threshold if cmd.sp_threshold is None else cmd.sp_threshold
        self.epoch = e = Epoch(cmd.epoch, tuple(cmd.members), rank, group, sp_threshold=threshold)
        self.relay.start_epoch()
        self.last_epoch = max(self.last_epoch, cmd.epoch)
        try:
            self._handshake(e)
            if e.leader:  # output of members' requests goes to them (adopted or new while bound)
                self.engine.apply_output_filter(self.ownership.divert, self.ownership.end)
                self.engine.idle_poll(POLL_S)  # idle, it still reads its members' posts and keeps them alive
            if cmd.adopt:
                self._adopt(e, work)
            if cmd.resume:
                self._resume(e, cmd.resume, parked)
            self._match_headroom(e)
        except NotEntered as exc:
            self._undo_bind(exc)
            return False
        except RuntimeError as exc:
            self.abort(exc)
            return False
        self.plans.sent()
        self.bind_ms = (time.perf_counter() - t0) * 1000
        self.error = ""
        self.param_bytes = self.layout.param_bytes()
        self.on_change()
        log.info(
            "engine %d bound: epoch %d, group %s, rank %d (%.1f ms)",
            self.index,
            cmd.epoch,
            cmd.members,
            rank,
            self.bind_ms,
        )
        return True

    def _dp_limits_now(self) -> RequestLimits:
        if self._dp_limits is None:
            raise RuntimeError("bound without the engine's DP limits")
        return self._dp_limits

    def _undo_bind(self, exc: NotEntered) -> None:
        """The group failed before anything moved into it: back to DP with the DP work as it was (paused work
        resumed, adoptable work never left), nothing aborted; the group's communicator is reset."""
        e = self.epoch
        self.error, self._error_at = (
            f"epoch {e.epoch if e else '?'} aborted before it began: {_why(exc)}",
            time.monotonic(),
        )
        log.error("engine %d: %s", self.index, self.error)
        if e is not None:
            self.pool.reset(e.group, e.epoch)
            self._unbind("bind undone")

    def _resume(self, e: Epoch, epoch: int, mine: bool) -> None:
        """Collective: the requests parked at ``epoch`` continue in ``e`` if every member holds its part of them
        (``mine``: this one does); else they end (a member restarted since: its slices are gone)."""
        if all(e.group.all_gather_object(mine)):
            self.parking.resume(epoch, e, self.ownership, self.shadows)
        elif mine:
            self.parking.discard(epoch, f"a member of epoch {e.epoch} lost its part of them")

    def _match_headroom(self, e: Epoch) -> None:
        """Collective: every member's KV headroom (free and evictable, in virtual slots) to all. The leader keeps
        back what it has beyond the tightest member (a follower's paused DP work or cached prompts can leave it
        less room), so it retracts or holds back work before a follower runs out of slots mid-step."""
        mine = self.adoption.headroom(e.width)
        room = e.group.all_gather_object(mine)
        if e.leader:
            self.layout.keep_back(mine - min(room))

    @staticmethod
    def _handshake(e: Epoch) -> None:
        try:
            if e.leader:
                e.group.broadcast_object(Handshake(e.epoch))
                return
            got = e.group.broadcast_object()
        except RuntimeError as exc:
            raise NotEntered(f"bind handshake of epoch {e.epoch}: {exc}") from exc
        if not (isinstance(got, Handshake) and got.epoch == e.epoch):
            raise HandshakeMismatch(f"bind handshake of epoch {e.epoch} got {got!r}")

    def _adopt(self, e: Epoch, work: Work | None) -> None:
        """The DP work moves into the group with its KV, or (it cannot move, or a member lacks KV) is paused."""
        if work is None:
            self._stash = self.engine.stash_dp_work(self.pending.take_held())
        held = self.pending.peek_held()
        # raising, the held requests stay held (_enter lets them in)
        moved = self.adoption.adopt(e, work, held)
        self.pending.take_held()
        cache = self.engine.group_cache()
        if cache is not None:  # DP requests whose KV moved in: never inserted into the group's tree
            cache.adopted |= self.engine.live_rids()
        if not moved and work is not None:
            self._stash = self.engine.stash_dp_work(held)

    # --- release ------------------------------------------------------------------------------------------

    def _scatter_and_leave(self, held: list[Held], next_bind: Bind | None) -> None:
        """Every member: TP requests back to DP on their owners (KV moved), then release; a width change binds the
        next group by adoption."""
        e = self.epoch
        if e is None:
            raise RuntimeError("scatter while not bound")
        back = self.adoption.scatter(e, held)
        self._unbind("released by scatter")
        self.engine.merge_decoding(back)
        self.on_change()
        if next_bind is not None and self.index in next_bind.members:
            self.pending.accept(next_bind)  # entered at this engine's next clean step boundary (adopting)

    def _leave(self, next_bind: Bind | None) -> None:
        """Release the current epoch; with ``next_bind`` naming this engine, go straight into that group (a width
        change: the DP work stays paused, the weights go from one shard layout to the other directly)."""
        if next_bind is not None and self.index in next_bind.members:
            self._unbind("width change", resume=False)
            self._enter(next_bind)
        else:
            self._unbind("released")

    def _unbind(self, why: str, resume: bool = True) -> None:
        t0 = time.perf_counter()
        e = self.epoch
        if e is None:
            raise RuntimeError("release while not bound")
        self.shadows.free_all()
        self.engine.remove_output_filter()
        self.ownership.forget_copies()
        self.engine.queue_back(self.ownership.take_unstarted())  # relayed too late for the leader: run here
        if e.epoch not in self.parking:  # (a parked epoch keeps the group's prefixes with its allocator)
            self._drop_group_prefixes()
        self.layout.unbind()
        self.engine.restore_prefix_cache()
        self.epoch = None
        if why.startswith("released"):
            self.error = ""  # a switch that worked: the last failure is history
        if not resume:
            return  # a width change: the next bind follows at once, no DP state in between to publish
        self._resume_dp()
        self.release_ms = (time.perf_counter() - t0) * 1000
        self.param_bytes = self.layout.param_bytes()
        self.on_change()
        log.info("engine %d back in DP (%s, epoch %d, %.1f ms)", self.index, why, e.epoch, self.release_ms)

    def _drop_group_prefixes(self) -> None:
        """The epoch is over: the leader's group tree frees its slots, a follower its copies of them."""
        cache = self.engine.group_cache()
        if cache is not None:
            cache.drop()
        self.plans.free_aliases(self.layout.sub_allocator().aliases)

    def _resume_dp(self) -> None:
        self.engine.idle_poll(None)
        self.layout.release_weights()
        if self._stash is not None:
            self.engine.restore_dp_work(self._stash)
        if not self.parking:  # (parked KV is held by no request: the idle checks would call it a leak)
            self.engine.resume_idle_checks()
        self.engine.set_request_limits(self._dp_limits_now(), 1)
        self._stash = None

    def abort(self, exc: BaseException) -> None:
        """A member died or stalled: end the epoch here, abort this engine's TP requests, back to DP."""
        e = self.epoch
        self.error, self._error_at = f"epoch {e.epoch if e else '?'} aborted: {_why(exc)}", time.monotonic()
        log.error("engine %d: %s", self.index, self.error, exc_info=None if peer_lost(exc) else exc)
        if e is not None:
            self.pool.reset(e.group, e.epoch)
            self.engine.drop_tp_requests()
            self.engine.end_group_lost(list(self.ownership.take_owned().values()))
            self._unbind("aborted")


def _why(exc: BaseException) -> str:
    """A failure as the heartbeat's ``switch_error`` says it: its type and message, without a native library's
    source locations, at most 200 characters of it."""
    return f"{type(exc).__name__}: {without_sources(str(exc))[:200]}"
