"""Bind and release one engine at a step boundary: the per-engine DP<->TP state machine.

Bind (every member, at its next clean step boundary): set its DP work aside with its KV (hard preemption; see
the sequential and soft variants in on_step), point
the weights at its Megatron shard (worker_ext.weights), view the KV pool at the group's width and carve TP slots
from the engine's one allocator (worker_ext.kv_layout), give the row-parallel layers the pooled group
(worker_ext.comm_pool). The leader (first member) keeps its scheduler loop: TP requests are sent to it, it forms
each batch, broadcasts a *step plan* before every forward, samples and streams. Followers leave their loop and
execute step plans (the model trunk, whose all-reduces need them) until the leader broadcasts the release.

Release (leader, once its TP requests have finished): broadcast it, then every member restores its DP layout and
resumes its DP work where it stopped, KV intact.

A member that dies or stalls makes the pooled group's next operation fail (at once for a dead process, after the
group timeout for a hung one): the survivors abort the epoch, go back to DP and abort their TP requests.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from flying.messages import Bind, Command, Release
from worker_ext import adoption, kv_layout, sglang_patches
from worker_ext.comm_pool import CommPool, MergedGroup
from worker_ext.kv_transform import ExchangeStats
from worker_ext.rank_messages import Forward, Handshake, Noop, ReleasePlan
from worker_ext.sglang_patches import requests as rq
from worker_ext.weights import Dims, LayerWeights, WeightsManager, storage_bytes

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


@dataclass
class ShadowReq:
    """A follower's copy of one TP request: its own request row and KV slots."""

    row: int
    slots: list[torch.Tensor] = field(default_factory=list)


class _Base:
    """The engine allocator's own methods, as the base of a sub-slot allocator. Physical slots go back at once,
    not into a pending free group: that group is flushed through the (sub-slot) ``free`` it sees."""

    def __init__(self, allocator: Any) -> None:
        cls = type(allocator)
        self._allocator, self._free = allocator, cls.free
        self.alloc = cls.alloc.__get__(allocator)
        self.available_size = cls.available_size.__get__(allocator)

    def free(self, index: torch.Tensor) -> None:
        a = self._allocator
        group, a.free_group = a.free_group, None
        try:
            self._free(a, index)
        finally:
            a.free_group = group


class Binding:
    def __init__(self, scheduler: Any, engine: int, pool: CommPool, on_change: Any = None) -> None:
        self.s, self.engine, self.pool = scheduler, engine, pool
        self.on_change = on_change or (
            lambda: None
        )  # re-publish the heartbeat (a follower's loop is blocked)
        self.layers = sglang_patches.decoder_layers(scheduler)
        a0 = self.layers[0].self_attn
        self.dims = Dims(
            a0.num_heads, a0.num_kv_heads, a0.head_dim, self.layers[0].mlp.down_proj.weight.shape[1]
        )
        self.weights = WeightsManager(
            [
                LayerWeights(
                    layer.self_attn.qkv_proj.weight,
                    layer.self_attn.o_proj.weight,
                    layer.mlp.gate_up_proj.weight,
                    layer.mlp.down_proj.weight,
                )
                for layer in self.layers
            ],
            self.dims,
        )
        self.row_parallel_dp = {
            id(layer): [(m.tp_group, m.reduce_results) for m in (layer.self_attn.o_proj, layer.mlp.down_proj)]
            for layer in self.layers
        }
        self.kv = sglang_patches.kv_pool(scheduler)
        self.kv_full = (list(self.kv.k_buffer), list(self.kv.v_buffer))
        self.kv_dims = {
            n: getattr(self.kv, n) for n in ("head_num", "row_dim", "v_row_dim") if hasattr(self.kv, n)
        }
        self.allocator = scheduler.token_to_kv_pool_allocator
        self.epoch: Epoch | None = None
        self.pending: Bind | None = None
        self.stash: Any = None
        self.shadows: dict[str, ShadowReq] = {}
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
        self.transform = {"transform_ms": 0.0, "transform_tokens": 0, "transform_peak_bytes": 0,
                          "transform_retracted": 0}  # fmt: skip

    # --- state reported in heartbeats ---------------------------------------------------------------------

    def status(self) -> dict:
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
            "kv_transform": True,
            **self.transform,
        }

    def note_transform(self, stats: ExchangeStats, retracted: int) -> None:
        self.transform.update(
            transform_ms=round(stats.ms, 3),
            transform_tokens=stats.tokens,
            transform_peak_bytes=stats.peak_bytes,
            transform_retracted=retracted,
        )
        log.info(
            "engine %d: KV transformation moved %d token slices in %.1f ms (peak %.2f MB extra)",
            self.engine, stats.tokens, stats.ms, stats.peak_bytes / 2**20,
        )  # fmt: skip

    def divert(self, req: Any) -> bool:
        """Leader's output filter: a copied request's new output goes to the outbox, not to this detokenizer."""
        if req.rid not in self.owners:
            return False
        sent, sent_logprobs = self.sent[req.rid]
        em = rq.emitted_since(req, sent, sent_logprobs)
        if em.output_ids or em.finished_reason is not None:
            self.outbox.append(em)
        self.sent[req.rid] = (len(req.output_ids), rq.logprob_count(req))
        if req.finished():
            del self.owners[req.rid], self.sent[req.rid]
        return True

    def _take_outbox(self) -> list:
        out, self.outbox = self.outbox, []
        return out

    def deliver(self, emitted: list) -> None:
        """Follower: append the leader's output to its own requests and stream it to their clients."""
        reqs = []
        for em in emitted:
            req = self.owned.get(em.rid)
            if req is None:
                continue  # not this member's
            rq.apply_emitted(req, em)
            reqs.append(req)
            if req.finished():
                del self.owned[em.rid]
        rq.stream(self.s, reqs)

    # --- step boundary ------------------------------------------------------------------------------------

    def on_step(self, commands: list[Command]) -> None:
        for cmd in commands:
            if cmd.epoch <= self.last_epoch and isinstance(cmd, Bind):
                continue  # already served (a follower reads its stream only between epochs)
            if isinstance(cmd, Bind) and self.engine in cmd.members:
                if self.epoch is not None and cmd.epoch != self.epoch.epoch:
                    self.epoch.next_bind, self.epoch.release_asked = cmd, True  # a width change
                else:
                    self.pending = cmd
            elif isinstance(cmd, Release) and self.epoch and cmd.epoch == self.epoch.epoch:
                self.epoch.release_asked, self.epoch.retract = True, cmd.retract
                self.epoch.scatter = cmd.scatter
            elif isinstance(cmd, Release) and self.pending and cmd.epoch == self.pending.epoch:
                self._cancel_pending()  # the router rolled the bind back before this engine applied it
        if self.epoch is None and self.pending is not None:
            if self.pending.preempt == "soft":
                if self._soft_ready(self.pending):
                    cmd, self.pending = self.pending, None
                    self._enter(cmd)
                    return
            elif self.pending.preempt == "sequential" and not self._all_drained(self.pending):
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
            self._abort(e.failed)
            return
        try:
            live = sglang_patches.live_rids(self.s)
            clean = sglang_patches.at_clean_step_boundary(self.s)
            transform = (
                e.scatter or (e.retract and self.owners) or (e.next_bind is not None and e.next_bind.adopt)
            )
            if e.release_asked and live and transform and clean:
                # at once, no recompute: every TP request goes back to DP on its owner with its KV
                held = adoption.scatter_manifest(self)
                e.group.broadcast_object(ReleasePlan(e.next_bind, held, self._take_outbox()))
                self._scatter_and_leave(held, e.next_bind)
            elif e.release_asked and live and e.retract and clean:
                # SGLang's retraction frees their TP KV; after the release they are recomputed in DP, here
                moved = sglang_patches.retract_running(self.s) + sglang_patches.hold_waiting(self.s)
                e.group.broadcast_object(ReleasePlan(None, None, self._take_outbox()))
                self._leave(None)
                self.s.waiting_queue.extend(moved)
                log.info("engine %d: %d TP requests continue in DP", self.engine, len(moved))
            elif e.release_asked and not live and sglang_patches.at_clean_step_boundary(self.s):
                # (a prefill batch not yet merged into the running batch holds TP requests live_rids misses)
                e.group.broadcast_object(ReleasePlan(e.next_bind, None, self._take_outbox()))
                self._leave(e.next_bind)
            elif self.outbox or time.monotonic() - self.last_plan > KEEPALIVE_S:
                e.group.broadcast_object(Noop(self._take_outbox()))
                self.last_plan = time.monotonic()
        except RuntimeError as exc:
            self._abort(exc)

    def _cancel_pending(self) -> None:
        log.info("engine %d: bind %d rolled back before it was applied", self.engine, self.pending.epoch)
        self.last_epoch = max(self.last_epoch, self.pending.epoch)
        self.pending, self.soft_dp_rids = None, None
        if self.held:
            sglang_patches.unhold_waiting(self.s, self.held)
            self.held = []
        self.on_change()

    def _all_drained(self, cmd: Bind) -> bool:
        """Sequential preemption: True once every member has finished its running DP work. Each member counts
        itself on the pool's store when drained and enters the bind only when all have, so a member that drains
        first waits in its own loop (an idle loop polls at least every second) instead of in the bind handshake,
        whose group timeout a slow member's drain could exceed."""
        if sglang_patches.has_running_dp_work(self.s) or not sglang_patches.at_clean_step_boundary(self.s):
            return False
        return self._barrier(cmd, "seq", need=len(cmd.members))

    def _soft_ready(self, cmd: Bind) -> bool:
        """Soft preemption. The DP work present when the command arrived drains (nothing new is admitted for it);
        requests arriving after it are the group's and the leader starts them at once, in DP mode. Members
        signal "drained" on the pool's store; the leader binds once it and every member are drained (re-prefilling
        its started TP requests at the new width), then lets the members in with a "go". Nobody blocks: each
        checks the store at its step boundaries."""
        leader = cmd.members[0] == self.engine
        if self.soft_dp_rids is None:
            self.soft_dp_rids = sglang_patches.unfinished_running_rids(self.s)
            self.held += sglang_patches.hold_waiting(self.s)
        if not leader:
            self.held += sglang_patches.hold_waiting(self.s)  # a member takes no new work while it drains
        if self.soft_dp_rids & sglang_patches.unfinished_running_rids(self.s):
            return False
        if not sglang_patches.at_clean_step_boundary(self.s):
            return False
        if not leader:
            return self._barrier(cmd, "soft", go="wait")
        return self._barrier(cmd, "soft", count=False, need=len(cmd.members) - 1, go="set")

    def _barrier(self, cmd: Bind, kind: str, count: bool = True, need: int = 0, go: str = "") -> bool:
        """A drain barrier on the pool's store, checked at step boundaries (never blocking): count this engine
        drained for ``cmd`` (once, if ``count``); ready once ``need`` members have, then set the "go" key
        (``go="set"``), or ready once that key is set (``go="wait"``). False while the store is unreachable
        (engine 0 restarting: the router rolls the bind back); True without a pool (_bind refuses the bind)."""
        store, key = self.pool.store, f"flying/{kind}/{cmd.epoch}"
        if store is None or not self.pool.ready.is_set():
            return True
        try:
            if count and self.drained_for != cmd.epoch:
                store.add(f"{key}/drained", 1)
                self.drained_for = cmd.epoch
            if go == "wait":
                return store.check([f"{key}/go"])
            if store.add(f"{key}/drained", 0) < need:
                return False
            if go == "set":
                store.set(f"{key}/go", "1")
            return True
        except Exception as exc:  # noqa: BLE001
            log.warning("engine %d: %s bind %d: %s", self.engine, kind, cmd.epoch, exc)
            return False

    def _enter(self, cmd: Bind) -> None:
        """Bind; a follower then serves step plans until its group is released."""
        if self._bind(cmd):
            if not self.epoch.leader:  # type: ignore[union-attr]
                self._follow()
        elif self.epoch is None and self.stash is not None:  # a refused width change: back to DP
            self._resume_dp()
        elif self.held:  # a refused sequential bind: let the held DP work in
            sglang_patches.unhold_waiting(self.s, self.held)
            self.held = []

    def _scatter_and_leave(self, held: list, next_bind: Bind | None) -> None:
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

    def _leave(self, next_bind: Bind | None) -> None:
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
        sub = kv_layout.SubSlotAllocator(_Base(self.allocator), width)
        self.allocator.alloc, self.allocator.free, self.allocator.available_size = (
            sub.alloc,
            sub.free,
            sub.available_size,
        )
        self.sub = sub
        self.epoch = Epoch(cmd.epoch, tuple(cmd.members), rank, group)
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
            self._abort(exc)
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
            a = layer.self_attn
            a.num_heads, a.num_kv_heads = self.dims.num_heads // width, self.dims.num_kv_heads // width
            a.q_size, a.kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
            a.attn.tp_q_head_num, a.attn.tp_k_head_num, a.attn.tp_v_head_num = (
                a.num_heads,
                a.num_kv_heads,
                a.num_kv_heads,
            )
            dp = self.row_parallel_dp[id(layer)]
            for row_parallel, (tp_group, reduce) in zip((a.o_proj, layer.mlp.down_proj), dp):
                # At width 1 SGLang builds the layer's stage boundaries without an all-reduce; the row-parallel
                # layers do their own while bound.
                row_parallel.tp_group, row_parallel.reduce_results = (
                    (group, True) if group else (tp_group, reduce)
                )
        for name, full in self.kv_dims.items():  # per-token row sizes the store kernels use (CUDA path)
            setattr(self.kv, name, full // width)
        self.kv.k_buffer[:] = [kv_layout.view(b, width) for b in self.kv_full[0]]
        self.kv.v_buffer[:] = [kv_layout.view(b, width) for b in self.kv_full[1]]

    def _unbind(self, why: str, resume: bool = True) -> None:
        t0 = time.perf_counter()
        e = self.epoch
        assert e is not None
        for rid in list(self.shadows):
            self.free_shadow(rid)
        rq.remove_output_filter(self.s)
        self.owners.clear()
        self.sent.clear()
        self.outbox = []
        for name in ("alloc", "free", "available_size"):
            self.allocator.__dict__.pop(name, None)
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
        sglang_patches.restore_request_limits(self.s, self.dp_limits)
        self.stash = None

    def _abort(self, exc: BaseException) -> None:
        """A member died or stalled: end the epoch here, abort this engine's TP requests, back to DP."""
        e = self.epoch
        self.error = f"epoch {e.epoch if e else '?'} aborted: {type(exc).__name__}: {str(exc)[:200]}"
        log.error("engine %d: %s", self.engine, self.error, exc_info=exc)
        if e is not None:
            sglang_patches.drop_tp_requests(self.s)
            for req in self.owned.values():  # a follower's own requests the leader ran: end them here
                req.finished_reason = sglang_patches._group_lost("tensor-parallel group lost a member")
            rq.stream(self.s, list(self.owned.values()))
            self.owned = {}
            self._unbind("aborted")

    # --- leader: one step plan per forward ----------------------------------------------------------------

    def around_forward(self, original, runner, forward_batch, *args, **kwargs):
        e = self.epoch
        if e is None:
            self.template = forward_batch
            return original(runner, forward_batch, *args, **kwargs)
        try:
            if e.leader and not e.failed:
                e.group.broadcast_object(self._plan(forward_batch))
                self.last_plan = time.monotonic()
            if not e.failed:
                with sglang_patches.tp_group_override(e.group):
                    return original(runner, forward_batch, *args, **kwargs)
        except RuntimeError as exc:
            if not e.leader:
                raise  # a follower's _follow aborts the epoch
            e.failed = exc
            self.error = f"epoch {e.epoch} aborted: {type(exc).__name__}: {str(exc)[:200]}"
            log.error("engine %d: %s", self.engine, self.error, exc_info=exc)
        # The group is gone mid-step. Finish this step alone (the scheduler needs its output), with every request
        # of the batch ending in an abort; the next step boundary ends the epoch (see on_step).
        sglang_patches.abort_batch(
            self.s, f"tensor-parallel group {e.members} lost a member; request aborted"
        )
        with sglang_patches.tp_group_override(sglang_patches.LOCAL_GROUP):
            return original(runner, forward_batch, *args, **kwargs)

    def _plan(self, fb: Any) -> Forward:
        live = sorted(sglang_patches.live_rids(self.s) | set(fb.rids))
        return Forward(sglang_patches.batch_fields(fb), live, self._take_outbox())

    # --- follower: execute step plans until release ---------------------------------------------------------

    def _follow(self) -> None:
        e = self.epoch
        assert e is not None
        while self.epoch is e:
            try:
                plan = e.group.broadcast_object()
                self.deliver(plan.emit)
                if isinstance(plan, ReleasePlan) and plan.scatter is not None:
                    self._scatter_and_leave(plan.scatter, plan.next)
                    return
                if isinstance(plan, ReleasePlan):
                    self._leave(plan.next)
                    return
                if isinstance(plan, Forward):
                    self._execute(plan)
            except RuntimeError as exc:
                self._abort(exc)

    def free_shadow(self, rid: str) -> None:
        sh = self.shadows.pop(rid)
        if sh.slots:
            self.allocator.free(torch.cat(sh.slots))
        self.s.req_to_token_pool.free_rows([sh.row])

    def _execute(self, plan: Forward) -> None:
        live = set(plan.live)
        for rid in [r for r in self.shadows if r not in live]:
            self.free_shadow(rid)
        rows, locs = [], []
        for rid, seq, n in sglang_patches.batch_tokens(plan.fields):
            sh = self.shadows.get(rid)
            if sh is None:
                got = self.s.req_to_token_pool.alloc_rows(1)
                assert got, "follower out of request rows"
                sh = self.shadows[rid] = ShadowReq(got[0])
            slots = self.allocator.alloc(n)
            assert slots is not None, "follower out of KV slots"
            self.s.req_to_token_pool.req_to_token[sh.row, seq - n : seq] = slots.to(torch.int32)
            sh.slots.append(slots)
            rows.append(sh.row)
            locs.append(slots)
        fb = sglang_patches.follower_batch(self.template, plan.fields, rows, torch.cat(locs))
        # Through around_forward: the pooled all-reduce, and no plan (a follower does not send one).
        with torch.inference_mode():
            sglang_patches.model_runner(self.s).forward(fb)
