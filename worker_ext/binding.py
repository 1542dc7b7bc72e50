"""Bind and release one engine at a step boundary: the per-engine DP<->TP state machine.

Bind (every member, at its next clean step boundary): deal with its DP work (adopt it into the group with its KV,
worker_ext.adoption; pause it with its KV, hard preemption; or drain it first, worker_ext.preemption), point the
weights at its Megatron shard (worker_ext.weights: views of the one resident layout, nothing copied), view the KV
pool at the group's width and carve TP slots from the engine's one allocator (worker_ext.kv_layout), give the
row-parallel layers the pooled group (worker_ext.comm_pool). The leader (first member) keeps its scheduler loop: it
forms each batch, broadcasts a step plan before every forward and samples; followers leave their loop and execute
the plans (worker_ext.step_plan) until the leader broadcasts the release. Each request streams from the engine it
arrived on.

Release (leader): once its TP requests have finished; at once by retraction (they are recomputed in DP on the
leader); or at once by scatter (they continue in DP on their owners, KV moved). Every member then restores its DP
layout and resumes its paused DP work, KV intact.

A member that dies or stalls makes the pooled group's next operation fail (at once for a dead process, after the
group timeout for a hung one): the survivors abort the epoch, go back to DP and abort their TP requests.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flying.messages import Bind, Command, Release
from worker_ext import aborts, adoption, preemption, sglang_patches, step_plan
from worker_ext.comm_pool import CommPool, MergedGroup
from worker_ext.intake import Intake, intake
from worker_ext.kv_transform import ExchangeStats
from worker_ext.rank_messages import Handshake, Noop, ReleasePlan
from worker_ext.sglang_patches import memory_pool, model, prefix_cache
from worker_ext.sglang_patches import requests as rq
from worker_ext.weights import WeightsManager, storage_bytes

if TYPE_CHECKING:
    from worker_ext.heartbeat import Load

log = logging.getLogger("flying.binding")
KEEPALIVE_S = 0.5  # an idle leader still broadcasts this often, so followers can tell idle from dead


@dataclass
class Epoch:
    epoch: int
    members: tuple[int, ...]
    rank: int
    group: MergedGroup
    release_asked: bool = False
    retract: bool = False  # release at once: the TP requests are recomputed in DP on the leader
    scatter: bool = False  # release at once: the TP requests go back to DP on their owners with their KV
    next_bind: Bind | None = None  # a width change: go straight to this group once drained
    failed: BaseException | None = (
        None  # the group broke mid-step (leader): end the epoch at the next boundary
    )

    @property
    def width(self) -> int:
        return len(self.members)

    @property
    def leader(self) -> bool:
        return self.rank == 0


class Binding:
    def __init__(self, scheduler: Any, engine: int, pool: CommPool, on_change: Any = None) -> None:
        self.s, self.engine, self.pool = scheduler, engine, pool
        self.on_change = on_change or (
            lambda: None
        )  # re-publish the heartbeat (a follower's loop is blocked)
        self.layers = sglang_patches.decoder_layers(scheduler)
        self.dims = model.dims(self.layers)
        # the resident layout, once: the weights are reordered and the projections restore stock order from now on
        self.weights = WeightsManager([model.layer_weights(layer) for layer in self.layers], self.dims)
        for layer in self.layers:
            model.apply_resident_layout(layer, self.weights.activation_order(1))
        self.row_parallel_dp = {id(layer): model.row_parallel_state(layer) for layer in self.layers}
        self.kv = memory_pool.KVViews(sglang_patches.kv_pool(scheduler))
        self.allocator = scheduler.token_to_kv_pool_allocator
        self.epoch: Epoch | None = None
        self.pending: Bind | None = None
        self.stash: Any = None
        self.shadows: dict[str, step_plan.ShadowReq] = {}
        self.template: Any = None  # a ForwardBatch of this engine's own, reused by followers
        self.last_plan = 0.0
        self.bind_ms = self.release_ms = 0.0
        self.last_epoch = 0  # the newest epoch this engine has bound
        self.held: list = []  # DP requests held back while a sequential bind waits for the running ones
        self.soft_dp_rids: set[str] | None = None  # soft bind: the DP work that must drain first
        self.drained_for = 0  # sequential bind: the epoch this engine has counted itself drained for
        self.param_bytes = self._param_bytes()
        self.error = ""
        self.owners: dict[str, int] = {}  # leader: rank of the member that streams each copied request
        self.sent: dict[str, tuple[int, int]] = {}  # leader: output ids, log-probs already emitted per copy
        self.outbox: list[rq.Emitted] = []  # leader: output for other members, sent with the next message
        self.owned: dict[str, Any] = {}  # follower: its own requests the leader runs
        self.aborts_seen, self.aborts_polled = (
            0,
            0.0,
        )  # leader: members' client aborts applied (worker_ext.aborts)
        self.transform: Load = {"transform_ms": 0.0, "transform_tokens": 0, "transform_peak_bytes": 0,
                                "transform_retracted": 0}  # fmt: skip

    # --- state reported in heartbeats ---------------------------------------------------------------------

    def status(self) -> Load:
        e = self.epoch
        return {
            "mode": "tp" if e else "dp",
            "epoch": e.epoch if e else 0,
            "pending": self.pending.epoch if self.pending else 0,
            "group": e.members if e else (),
            "width": e.width if e else 1,
            "bind_ms": round(self.bind_ms, 3),
            "release_ms": round(self.release_ms, 3),
            "switch_error": self.error,
            "comm_groups": len(self.pool.groups),
            "comm_rebuilds": self.pool.rebuilds,
            "num_engines": self.pool.num_engines,
            "param_bytes": self.param_bytes,
            **(
                {"max_total_tokens": self.dp_limits.max_total_tokens} if e else {}
            ),  # its own, not the group's
            "kv_transform": True,
            **self.transform,
        }

    def note_transform(self, stats: ExchangeStats, retracted: int) -> None:
        self.transform.update(
            {
                "transform_ms": round(stats.ms, 3),
                "transform_tokens": stats.tokens,
                "transform_peak_bytes": stats.peak_bytes,
                "transform_retracted": retracted,
            }
        )
        log.info(
            "engine %d: KV transformation moved %d token slices in %.1f ms (peak %.2f MB extra)",
            self.engine, stats.tokens, stats.ms, stats.peak_bytes / 2**20,
        )  # fmt: skip

    def divert(self, req: Any) -> bool:
        return adoption.divert(self, req)

    def deliver(self, emitted: list[rq.Emitted]) -> None:
        adoption.deliver(self, emitted)

    def take_outbox(self) -> list[rq.Emitted]:
        out, self.outbox = self.outbox, []
        return out

    # --- step boundary ------------------------------------------------------------------------------------

    def on_step(self, commands: list[Command]) -> None:
        for cmd in commands:
            e, pending = self.epoch, self.pending
            match intake(
                cmd, self.engine, self.last_epoch, e.epoch if e else 0, pending.epoch if pending else 0
            ):
                case Intake.BIND:
                    assert isinstance(cmd, Bind)  # intake answers BIND to binds only
                    self.pending = cmd
                case Intake.WIDTH_CHANGE:
                    assert isinstance(cmd, Bind) and e is not None  # a bind while bound
                    e.next_bind, e.release_asked = cmd, True
                case Intake.RELEASE:
                    assert isinstance(cmd, Release) and e is not None  # a release of the bound epoch
                    e.release_asked, e.retract, e.scatter = True, cmd.retract, cmd.scatter
                case Intake.CANCEL:  # the router rolled the bind back before this engine applied it
                    preemption.cancel_pending(self)
        if self.epoch is None and self.pending is not None:
            if self.pending.preempt == "soft":
                if preemption.soft_ready(self, self.pending):
                    cmd, self.pending = self.pending, None
                    self._enter(cmd)
                    return
            elif self.pending.preempt == "sequential" and not preemption.all_drained(self, self.pending):
                # admit no new DP work; bind once every member has drained
                self.held += sglang_patches.hold_waiting(self.s)
            elif sglang_patches.at_clean_step_boundary(self.s):
                cmd, self.pending = self.pending, None
                self._enter(cmd)
                return
        e = self.epoch
        if e is None or not e.leader:
            return
        if e.failed is not None:
            self.abort(e.failed)
            return
        try:
            aborts.apply(self, e)
            live = sglang_patches.live_rids(self.s)
            clean = sglang_patches.at_clean_step_boundary(self.s)
            transform = (
                e.scatter or (e.retract and self.owners) or (e.next_bind is not None and e.next_bind.adopt)
            )
            if e.release_asked and live and transform and clean:
                # at once, no recompute: every TP request goes back to DP on its owner with its KV
                held = adoption.scatter_manifest(self)
                e.group.broadcast_object(ReleasePlan(e.next_bind, held, self.take_outbox()))
                self.scatter_and_leave(held, e.next_bind)
            elif e.release_asked and live and e.retract and clean:
                # SGLang's retraction frees their TP KV; after the release they are recomputed in DP, here
                moved = sglang_patches.retract_running(self.s) + sglang_patches.hold_waiting(self.s)
                e.group.broadcast_object(ReleasePlan(None, None, self.take_outbox()))
                self.leave(None)
                self.s.waiting_queue.extend(moved)
                log.info("engine %d: %d TP requests continue in DP", self.engine, len(moved))
            elif e.release_asked and not live and sglang_patches.at_clean_step_boundary(self.s):
                # (a prefill batch not yet merged into the running batch holds TP requests live_rids misses)
                e.group.broadcast_object(ReleasePlan(e.next_bind, None, self.take_outbox()))
                self.leave(e.next_bind)
            elif self.outbox or time.monotonic() - self.last_plan > KEEPALIVE_S:
                e.group.broadcast_object(Noop(self.take_outbox()))
                self.last_plan = time.monotonic()
        except RuntimeError as exc:
            self.abort(exc)

    def _enter(self, cmd: Bind) -> None:
        """Bind; a follower then serves step plans until its group is released."""
        if self._bind(cmd):
            if not self.epoch.leader:  # type: ignore[union-attr]
                step_plan.follow(self)
        elif self.epoch is None and self.stash is not None:  # a refused width change: back to DP
            self._resume_dp()
        elif self.held:  # a refused sequential bind: let the held DP work in
            sglang_patches.unhold_waiting(self.s, self.held)
            self.held = []

    def scatter_and_leave(self, held: list, next_bind: Bind | None) -> None:
        """Every member: TP requests back to DP on their owners (KV moved), then release; a width change binds the
        next group by adoption."""
        e = self.epoch
        assert e is not None
        back = adoption.scatter(self, e, held)
        self._unbind("released by scatter")
        rq.merge_decoding(self.s, back)
        self.on_change()
        if next_bind is not None and self.engine in next_bind.members:
            self.pending = next_bind  # entered at this engine's next clean step boundary (adopting)

    def leave(self, next_bind: Bind | None) -> None:
        """Release the current epoch; with ``next_bind`` naming this engine, go straight into that group (a width
        change: the DP work stays paused, the weights go from one shard layout to the other directly)."""
        if next_bind is not None and self.engine in next_bind.members:
            self._unbind("width change", resume=False)
            self._enter(next_bind)
        else:
            self._unbind("released")

    def _param_bytes(self) -> int:
        """Bytes over the unique storages behind the model's parameters (must not grow across switches)."""
        return storage_bytes(p.data for p in sglang_patches.model_runner(self.s).model.parameters())

    # --- bind / release -----------------------------------------------------------------------------------

    def _bind(self, cmd: Bind) -> bool:
        t0 = time.perf_counter()
        try:
            group = self.pool.get(tuple(cmd.members))
        except (KeyError, RuntimeError) as exc:
            self.error = f"bind {cmd.epoch} refused: {exc}"
            log.error(self.error)
            return False
        width, rank = len(cmd.members), cmd.members.index(self.engine)
        restart: list = []
        if cmd.preempt == "soft" and rank == 0:  # the group's requests started in DP mode: re-prefill them
            restart = sglang_patches.retract_running(self.s) + sglang_patches.hold_waiting(self.s)
        self.soft_dp_rids = None
        work = adoption.adoptable_work(self) if cmd.adopt else None
        if self.stash is None:  # from DP (a width change keeps the paused DP work and limits as they are)
            # adopting: the DP work stays where it is until the handshake (then it moves or is paused)
            self.stash = (
                sglang_patches.empty_stash() if cmd.adopt else sglang_patches.stash_dp_work(self.s, self.held)
            )
            self.held = [] if not cmd.adopt else self.held
            sglang_patches.suspend_idle_checks(self.s)
            self.dp_limits = sglang_patches.request_limits(self.s)
        self.s.waiting_queue[:0] = restart
        sglang_patches.set_request_limits(self.s, self.dp_limits, width)
        self.weights.activate(width, rank)
        self._set_layout(width, group)
        self.sub = memory_pool.install_sub_allocator(self.allocator, width)
        prefix_cache.bypass(self.s, self.sub.base, width)  # the DP prefix tree: kept, not used by TP requests
        self.epoch = Epoch(cmd.epoch, tuple(cmd.members), rank, group)
        self.aborts_seen = 0
        self.last_epoch = max(self.last_epoch, cmd.epoch)
        try:
            if rank == 0:
                group.broadcast_object(Handshake(cmd.epoch))
            else:
                got = group.broadcast_object()
                assert isinstance(got, Handshake) and got.epoch == cmd.epoch, f"bind handshake got {got}"
            if cmd.adopt:
                adoption.adopt(self, self.epoch, work)
        except (RuntimeError, AssertionError) as exc:
            self.abort(exc)
            return False
        self.last_plan = time.monotonic()
        self.bind_ms = (time.perf_counter() - t0) * 1000
        self.error = ""
        self.param_bytes = self._param_bytes()
        self.on_change()
        log.info(
            "engine %d bound: epoch %d, group %s, rank %d (%.1f ms)",
            self.engine,
            cmd.epoch,
            cmd.members,
            rank,
            self.bind_ms,
        )
        return True

    def _set_layout(self, width: int, group: MergedGroup | None) -> None:
        """Head counts, row-parallel reduction and KV views for ``width`` (1 with no group: the DP layout).
        The weights are switched separately (WeightsManager)."""
        for layer in self.layers:
            model.set_width(
                layer,
                self.dims.num_heads,
                self.dims.num_kv_heads,
                width,
                group,
                self.row_parallel_dp[id(layer)],
                self.weights.activation_order(width),
            )
        self.kv.set_width(width)

    def _unbind(self, why: str, resume: bool = True) -> None:
        t0 = time.perf_counter()
        e = self.epoch
        assert e is not None
        for rid in list(self.shadows):
            step_plan.free_shadow(self, rid)
        rq.remove_output_filter(self.s)
        self.owners.clear()
        self.sent.clear()
        self.outbox = []
        memory_pool.remove_sub_allocator(self.allocator)
        prefix_cache.restore(self.s)
        self._set_layout(1, None)
        self.epoch = None
        if not resume:
            return  # a width change: the next bind follows at once, no DP state in between to publish
        self._resume_dp()
        self.release_ms = (time.perf_counter() - t0) * 1000
        self.param_bytes = self._param_bytes()
        self.on_change()
        log.info("engine %d back in DP (%s, epoch %d, %.1f ms)", self.engine, why, e.epoch, self.release_ms)

    def _resume_dp(self) -> None:
        self.weights.release()
        sglang_patches.restore_dp_work(self.s, self.stash)
        sglang_patches.resume_idle_checks(self.s)
        sglang_patches.set_request_limits(self.s, self.dp_limits, 1)
        self.stash = None

    def abort(self, exc: BaseException) -> None:
        """A member died or stalled: end the epoch here, abort this engine's TP requests, back to DP."""
        e = self.epoch
        self.error = f"epoch {e.epoch if e else '?'} aborted: {type(exc).__name__}: {str(exc)[:200]}"
        log.error("engine %d: %s", self.engine, self.error, exc_info=exc)
        if e is not None:
            sglang_patches.drop_tp_requests(self.s)
            for req in self.owned.values():  # a follower's own requests the leader ran: end them here
                req.finished_reason = sglang_patches.group_lost()
                prefix_cache.let_go(self.s, req)
            rq.stream(self.s, list(self.owned.values()))
            self.owned = {}
            self._unbind("aborted")

    def around_forward(self, original, runner, forward_batch, *args, **kwargs):
        return step_plan.around_forward(self, original, runner, forward_batch, *args, **kwargs)
