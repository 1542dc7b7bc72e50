"""Adopt busy members' DP requests into a group at bind, hand TP requests back to DP at release: the member-level
half of the KV transformation (worker_ext.kv_transform moves the slices; worker_ext.ownership says who streams).

Adopt (every member, at the bind's clean step boundary, after the handshake): members all-gather manifests of
their DP requests; if every member can carve the slices it receives (else the members fall back to a hard bind),
each keeps its own slice in place, sends the others over the pooled group and carves slots for what it receives.
The leader's own requests stay in its running batch (rows rewritten to the kept slices); other members' requests
join it as copies, decoding their next token at the next step (running ones) or prefilled at the group's width
(waiting ones). A follower's own requests leave its scheduler for its ``Ownership``; it keeps a shadow row of each
TP request for the step plans.

Scatter (every member, at a release the leader starts at a clean step boundary): the leader lists the TP
requests with their owners; members all-gather their free physical KV; each request whose owner can hold it goes
back to DP there with its KV (every member sends it its slice), the others are retracted on their owner (SGLang's
recompute, counted in ``transform_retracted``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from worker_ext import kv_transform
from worker_ext.epoch import Epoch, NotEntered
from worker_ext.kv_transform import ExchangeStats, Held
from worker_ext.ownership import Ownership
from worker_ext.rank_messages import AdoptManifest
from worker_ext.sglang_patches.surface import AdoptionEngine, Req
from worker_ext.step_plan import Shadows

if TYPE_CHECKING:
    from worker_ext.heartbeat import Load
    from worker_ext.layout import Layout

log = logging.getLogger("flying.adoption")
Work = tuple[list[Req], list[Req]]  # a member's running and waiting DP requests


class Adoption:
    """The KV transformation of one engine: adopt at bind, scatter at release, and the figures of the last one
    (reported in heartbeats)."""

    def __init__(
        self, engine: AdoptionEngine, index: int, layout: Layout, ownership: Ownership, shadows: Shadows
    ) -> None:
        self.engine, self.index, self.layout = engine, index, layout
        self.ownership, self.shadows = ownership, shadows
        self.stats: Load = {
            "transform_ms": 0.0,
            "transform_tokens": 0,
            "transform_peak_bytes": 0,
            "transform_retracted": 0,
        }

    def _note(self, stats: ExchangeStats, retracted: int) -> None:
        self.stats.update(
            {
                "transform_ms": round(stats.ms, 3),
                "transform_tokens": stats.tokens,
                "transform_peak_bytes": stats.peak_bytes,
                "transform_retracted": retracted,
            }
        )
        log.info(
            "engine %d: KV transformation moved %d token slices in %.1f ms (peak %.2f MB extra)",
            self.index,
            stats.tokens,
            stats.ms,
            stats.peak_bytes / 2**20,
        )

    def headroom(self, width: int) -> int:
        """The virtual slots of ``width`` this member can still carve: free, and evictable from its prefix tree
        (what a member tells the others at an adoption, and after every bind)."""
        return int(self.layout.sub_available()) + self.engine.evictable_physical() * width

    # --- adopt ----------------------------------------------------------------------------------------------

    def adoptable_work(self, held: list[Req]) -> Work | None:
        """This member's running and waiting DP requests (``held`` back ones first), or None if one of them
        cannot move (then it is paused)."""
        running, waiting = self.engine.running(), list(held) + self.engine.waiting()
        if all(self.engine.adoptable(r) for r in running + waiting):
            return running, waiting
        return None

    def adopt(self, e: Epoch, work: Work | None, held: list[Req]) -> bool:
        """Collective over the group. ``work`` None: this member's DP work was paused already (it could not move).
        False if some member cannot hold what it would receive: nothing moved, and the caller pauses this member's
        DP work (``held`` included) as a hard bind does."""
        rank, d = e.rank, e.width
        running, waiting = work or ([], [])
        mine = AdoptManifest(
            rank=rank,
            available=self.headroom(d),
            running=[(r.rid, self.engine.kv_length(r), self.engine.shared_len(r)) for r in running],
            states=[self.engine.state_of(r) for r in running + waiting] if rank else [],
        )
        try:
            manifests: list[AdoptManifest] = e.group.all_gather_object(mine)
        except RuntimeError as exc:
            raise NotEntered(f"adoption manifests of epoch {e.epoch}: {exc}") from exc
        held_kv = [Held(rid, m.rank, n, shared) for m in manifests for rid, n, shared in m.running]
        if short := kv_transform.adopt_fits(held_kv, [m.available for m in manifests], d):
            log.warning(
                "engine %d: adoption into epoch %d: ranks %s lack KV; binding hard",
                self.index,
                e.epoch,
                short,
            )
            return False
        own = {r.rid: self.engine.kv_slots(r) for r in running}
        incoming = sum(h.length for h in held_kv if h.rank != rank)
        siblings = (d - 1) * sum(h.length - h.shared for h in held_kv if h.rank == rank)
        self.engine.make_room(incoming - siblings)  # the tree's unlocked DP content goes first, as in DP
        sub = self.layout.sub_allocator()
        ex, slots = kv_transform.plan_adopt(held_kv, rank, d, own, sub.take_over, sub.alloc)
        k, v = self.layout.kv_buffers()
        self._note(kv_transform.run_exchange(e.group.data, rank, ex, k, v), 0)
        if rank == 0:
            self.engine.queue_front(held)  # a sequential bind's held-back requests: the group's now
            self._leader_adopts(manifests, running, slots)
        else:
            self._follower_adopts(held_kv, running, waiting, slots)
        log.info("engine %d adopted %d running requests into epoch %d", self.index, len(held_kv), e.epoch)
        return True

    def _leader_adopts(self, manifests: list[AdoptManifest], running: list[Req], slots: dict) -> None:
        engine = self.engine
        for r in running:  # stay in the running batch, now on this rank's kept head slice
            engine.write_row(engine.kv_row(r), slots[r.rid])
        copies, waiting = [], []
        for m in manifests[1:]:
            for i, st in enumerate(m.states):
                req = engine.req_from_state(st)
                self.ownership.add_copy(req, m.rank)
                if i < len(m.running):
                    row = engine.alloc_row()
                    engine.write_row(row, slots[req.rid])
                    engine.attach_kv(req, row, m.running[i][1])
                    copies.append(req)
                else:
                    waiting.append(req)
        engine.queue_back(waiting)
        engine.merge_decoding(copies)
        engine.apply_output_filter(self.ownership.divert, self.ownership.end)

    def _follower_adopts(self, held: list[Held], running: list[Req], waiting: list[Req], slots: dict) -> None:
        engine = self.engine
        for r in running:
            # its cached prompt: read in place (the request keeps its tree lock)
            pinned = engine.shared_len(r)
            row, _ = engine.detach_kv(r)
            engine.write_row(row, slots[r.rid])
            self.shadows.add(r.rid, row, slots[r.rid], pinned=pinned)
        own = {r.rid for r in running}
        for h in held:
            if h.rid not in own and h.length:
                row = engine.alloc_row()
                engine.write_row(row, slots[h.rid])
                self.shadows.add(h.rid, row, slots[h.rid])
        self.ownership.hold(running + waiting)
        engine.stash_dp_work()  # empties the running batch and waiting queue (the requests moved)

    # --- scatter --------------------------------------------------------------------------------------------

    def scatter_manifest(self) -> list[Held]:
        """Leader: every TP request with its owner's rank and its KV length (0: not started)."""
        reqs = self.engine.running() + self.engine.waiting()
        return [Held(r.rid, self.ownership.owner_of(r.rid), self.engine.kv_length(r)) for r in reqs]

    def scatter(self, e: Epoch, held: list[Held]) -> list[Req]:
        """Collective over the group: each TP request back to its owner. Returns the requests this member owns that
        resume decoding with their KV (to merge into its running batch once it is back in DP)."""
        rank, d = e.rank, e.width
        free = e.group.all_gather_object(int(self.layout.base_available()) + self.engine.evictable_physical())
        placed = kv_transform.scatter_placement([h for h in held if h.length], free)
        self.engine.evict_physical(sum(h.length for h in held if h.rank == rank and h.rid in placed))
        mine = self._my_slices(e, held)
        ex, taken = kv_transform.plan_scatter(
            held, placed, rank, d, mine, self.layout.sub_allocator().base.alloc
        )
        retracted = sum(1 for h in held if h.length and h.rid not in placed)
        k, v = self.layout.kv_buffers()
        self._note(kv_transform.run_exchange(e.group.data, rank, ex, k, v), retracted)
        if retracted:
            log.warning(
                "engine %d: scatter of epoch %d retracts %d requests (owner KV full)",
                self.index,
                e.epoch,
                retracted,
            )
        if rank == 0:
            self._leader_scatters(held, placed, taken)
            return []
        return self._follower_scatters(held, placed, taken)

    def _my_slices(self, e: Epoch, held: list[Held]) -> dict[str, torch.Tensor]:
        if e.leader:
            by_rid = {r.rid: r for r in self.engine.running()}
            return {h.rid: self.engine.kv_slots(by_rid[h.rid]) for h in held if h.length}
        return {h.rid: self.shadows.slots(h.rid) for h in held if h.length}

    def _leader_scatters(self, held: list[Held], placed: set[str], taken: dict) -> None:
        engine = self.engine
        copies = self.ownership.copies()
        engine.remove_output_filter()
        for req in engine.drop_from_batches(copies):
            engine.release_kv(req)  # its slices went to the owner (or it is recomputed there)
        own_running = {r.rid: r for r in engine.running()}
        for h in held:
            req = own_running.get(h.rid)
            if req is None or h.rid not in placed:
                continue
            # the TP slices (the tree keeps its cached prompt); its whole row is now its own copy
            engine.free_slots(engine.kv_slots(req)[engine.shared_len(req) :])
            engine.let_go(req)
            engine.write_row(engine.kv_row(req), taken[req.rid])
        undone = [own_running[h.rid] for h in held if h.rid in own_running and h.rid not in placed]
        if undone:
            engine.retract(undone)
            engine.drop_from_batches({r.rid for r in undone})
            engine.queue_back(undone)
        self.ownership.forget_copies()

    def _follower_scatters(self, held: list[Held], placed: set[str], taken: dict) -> list[Req]:
        engine = self.engine
        self.shadows.free_all()
        back, lengths = [], {h.rid: h.length for h in held}
        owned = self.ownership.take_owned()
        for rid in (
            taken.keys() - owned.keys()
        ):  # its client aborted here while the leader still ran it: nothing
            self.layout.sub_allocator().base.free(taken[rid])  # takes the KV it was sent back
        for rid, req in owned.items():
            engine.let_go(req)  # it comes back with a copy of its KV of its own, or is recomputed
            if rid in placed:
                row = engine.alloc_row()
                engine.write_row(row, taken[rid])
                engine.attach_kv(req, row, lengths[rid])
                back.append(req)
            else:
                if lengths.get(rid):
                    engine.reset_for_recompute(req)
                engine.queue_back([req])
        return back
