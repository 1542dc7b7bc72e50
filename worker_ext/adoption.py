"""Adopt busy members' DP requests into a group at bind, hand TP requests back to DP at release: the member-level
half of the KV transformation (worker_ext.kv_transform moves the slices).

Ownership. A request streams from the engine whose endpoint it arrived on, its *owner*. The leader's scheduler
runs every TP request; for a request another member owns it runs a copy (``ReqState``) and diverts its output: the
leader's output path does not send it to its own detokenizer but puts the new tokens (and log-probs, finish
reason) in an outbox that the next message to the members carries (``Emitted``); the owner appends them to its
own request and streams them from there. Sampling happens on the leader only, so every member's client sees the
tokens the leader sampled, seeded sampling included.

Adopt (every member, at the bind's clean step boundary, after the handshake): members all-gather manifests of
their DP requests; if every member can carve the slices it receives (else the members fall back to a hard bind),
each keeps its own slice in place, sends the others over the pooled group and carves slots for what it receives.
The leader's own requests stay in its running batch (rows rewritten to the kept slices); other members' requests
join it as copies, decoding their next token at the next step (running ones) or prefilled at the group's width
(waiting ones). A follower's own requests leave its scheduler for ``Binding.owned``; it keeps a shadow row of each
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

from worker_ext import kv_transform, sglang_patches, step_plan
from worker_ext.kv_transform import Held
from worker_ext.rank_messages import AdoptManifest
from worker_ext.sglang_patches import memory_pool, prefix_cache
from worker_ext.sglang_patches import requests as rq

if TYPE_CHECKING:
    from worker_ext.binding import Binding, Epoch

log = logging.getLogger("flying.adoption")


def adoptable_work(b: Binding) -> tuple[list, list] | None:
    """This member's running and waiting DP requests, or None if one of them cannot move (then it is paused)."""
    running, waiting = rq.running_reqs(b.s), list(b.held) + list(b.s.waiting_queue)
    if all(rq.adoptable(r) for r in running + waiting):
        return running, waiting
    return None


def adopt(b: Binding, e: Epoch, work: tuple[list, list] | None) -> bool:
    """Collective over the group. A member whose work cannot move (``work`` None) pauses it, as a hard bind does;
    if some member cannot hold what it would receive, nothing moves and every member pauses its DP work (False)."""
    s, rank, d = b.s, e.rank, e.width
    if work is None:
        b.stash = sglang_patches.stash_dp_work(s, b.held)
        b.held = []
    running, waiting = work or ([], [])
    mine = AdoptManifest(
        rank=rank,
        available=int(b.sub.available_size()) + prefix_cache.evictable_physical(s) * d,
        running=[(r.rid, rq.kv_length(r), prefix_cache.shared_len(r)) for r in running],
        states=[rq.state_of(r) for r in running + waiting] if rank else [],
    )
    manifests: list[AdoptManifest] = e.group.all_gather_object(mine)
    held = [Held(rid, m.rank, n, shared) for m in manifests for rid, n, shared in m.running]
    if short := kv_transform.adopt_fits(held, [m.available for m in manifests], d):
        log.warning(
            "engine %d: adoption into epoch %d: ranks %s lack KV; binding hard", b.engine, e.epoch, short
        )
        if work is not None:
            b.stash = sglang_patches.stash_dp_work(s, b.held)
            b.held = []
        return False
    own = {r.rid: rq.kv_slots(s, r) for r in running}
    incoming = sum(h.length for h in held if h.rank != rank)
    siblings = (d - 1) * sum(h.length - h.shared for h in held if h.rank == rank)
    prefix_cache.make_room(s, incoming - siblings)  # the tree's unlocked DP content goes first, as in DP
    ex, slots = kv_transform.plan_adopt(held, rank, d, own, b.sub.take_over, b.sub.alloc)
    b.note_transform(kv_transform.run_exchange(e.group.data, rank, ex, b.kv.k, b.kv.v), 0)
    if rank == 0:
        s.waiting_queue[:0] = b.held  # a sequential bind's held-back requests: the group's now
        b.held = []
        _leader_adopts(b, manifests, running, slots)
    else:
        _follower_adopts(b, held, running, waiting, slots)
    log.info("engine %d adopted %d running requests into epoch %d", b.engine, len(held), e.epoch)
    return True


def _leader_adopts(b: Binding, manifests: list[AdoptManifest], running: list, slots: dict) -> None:
    s = b.s
    for r in running:  # stay in the running batch, now on this rank's kept head slice
        memory_pool.write_row(s, r.kv.req_pool_idx, slots[r.rid])
    copies = []
    for m in manifests[1:]:
        for i, st in enumerate(m.states):
            req = rq.req_from_state(s, st)
            b.owners[req.rid] = m.rank
            b.sent[req.rid] = (len(req.output_ids), rq.logprob_count(req))
            if i < len(m.running):
                row = memory_pool.alloc_row(s)
                memory_pool.write_row(s, row, slots[req.rid])
                rq.attach_kv(req, row, m.running[i][1])
                copies.append(req)
            else:
                s.waiting_queue.append(req)
    rq.merge_decoding(s, copies)
    rq.apply_output_filter(s, b.divert)


def _follower_adopts(b: Binding, held: list[Held], running: list, waiting: list, slots: dict) -> None:
    s = b.s
    for r in running:
        pinned = prefix_cache.shared_len(
            r
        )  # its cached prompt: read in place (the request keeps its tree lock)
        row, _ = rq.detach_kv(r)
        memory_pool.write_row(s, row, slots[r.rid])
        b.shadows[r.rid] = step_plan.ShadowReq(row, [slots[r.rid]], pinned=pinned)
    own = {r.rid for r in running}
    for h in held:
        if h.rid not in own and h.length:
            row = memory_pool.alloc_row(s)
            memory_pool.write_row(s, row, slots[h.rid])
            b.shadows[h.rid] = step_plan.ShadowReq(row, [slots[h.rid]])
    b.owned = {r.rid: r for r in running + waiting}
    b.held = []
    sglang_patches.stash_dp_work(s)  # empties the running batch and waiting queue (the requests moved)


# --- output of copied requests -------------------------------------------------------------------------------


def divert(b: Binding, req) -> bool:
    """Leader's output filter: a copied request's new output goes to the outbox, not to this detokenizer."""
    if req.rid not in b.owners:
        return False
    sent, sent_logprobs = b.sent[req.rid]
    em = rq.emitted_since(req, sent, sent_logprobs)
    if em.output_ids or em.finished_reason is not None:
        b.outbox.append(em)
    b.sent[req.rid] = (len(req.output_ids), rq.logprob_count(req))
    if req.finished():
        del b.owners[req.rid], b.sent[req.rid]
    return True


def deliver(b: Binding, emitted: list[rq.Emitted]) -> None:
    """Follower: append the leader's output to its own requests and stream it to their clients."""
    reqs = []
    for em in emitted:
        req = b.owned.get(em.rid)
        if req is None:
            continue  # not this member's
        rq.apply_emitted(req, em)
        reqs.append(req)
        if req.finished():
            del b.owned[em.rid]
            prefix_cache.let_go(b.s, req)
    rq.stream(b.s, reqs)


# --- scatter -------------------------------------------------------------------------------------------------


def scatter_manifest(b: Binding) -> list[Held]:
    """Leader: every TP request with its owner's rank and its KV length (0: not started)."""
    s = b.s
    reqs = rq.running_reqs(s) + list(s.waiting_queue)
    return [Held(r.rid, b.owners.get(r.rid, 0), rq.kv_length(r)) for r in reqs]


def scatter(b: Binding, e: Epoch, held: list[Held]) -> list:
    """Collective over the group: each TP request back to its owner. Returns the requests this member owns that
    resume decoding with their KV (to merge into its running batch once it is back in DP)."""
    rank, d = e.rank, e.width
    free = e.group.all_gather_object(int(b.sub.base.available_size()) + prefix_cache.evictable_physical(b.s))
    placed = kv_transform.scatter_placement([h for h in held if h.length], free)
    prefix_cache.evict_physical(b.s, sum(h.length for h in held if h.rank == rank and h.rid in placed))
    mine = _my_slices(b, held)
    ex, taken = kv_transform.plan_scatter(held, placed, rank, d, mine, b.sub.base.alloc)
    retracted = sum(1 for h in held if h.length and h.rid not in placed)
    b.note_transform(kv_transform.run_exchange(e.group.data, rank, ex, b.kv.k, b.kv.v), retracted)
    if retracted:
        log.warning(
            "engine %d: scatter of epoch %d retracts %d requests (owner KV full)",
            b.engine,
            e.epoch,
            retracted,
        )
    return (
        _leader_scatters(b, held, placed, taken) if rank == 0 else _follower_scatters(b, held, placed, taken)
    )


def _my_slices(b: Binding, held: list[Held]) -> dict[str, torch.Tensor]:
    if b.epoch is not None and b.epoch.leader:
        by_rid = {r.rid: r for r in rq.running_reqs(b.s)}
        return {h.rid: rq.kv_slots(b.s, by_rid[h.rid]) for h in held if h.length}
    return {h.rid: torch.cat(b.shadows[h.rid].slots) for h in held if h.length}


def _leader_scatters(b: Binding, held: list[Held], placed: set[str], taken: dict) -> list:
    s = b.s
    copies = set(b.owners)
    rq.remove_output_filter(s)
    gone = rq.drop_from_batches(s, copies)
    for req in gone:
        rq.release_kv(s, req)  # its slices went to the owner (or it is recomputed there)
    own_running = {r.rid: r for r in rq.running_reqs(s)}
    back = [own_running[h.rid] for h in held if h.rid in own_running and h.rid in placed]
    for req in back:
        virtual = rq.kv_slots(s, req)[prefix_cache.shared_len(req) :]  # the tree keeps its cached prompt
        b.allocator.free(virtual)  # the sub-slot allocator's free: the TP slices
        prefix_cache.let_go(s, req)  # its whole row is now its own copy
        memory_pool.write_row(s, req.kv.req_pool_idx, taken[req.rid])
    undone = [own_running[h.rid] for h in held if h.rid in own_running and h.rid not in placed]
    if undone:
        rq.retract(s, undone)
        rq.drop_from_batches(s, {r.rid for r in undone})
        s.waiting_queue.extend(undone)
    b.owners.clear()
    b.sent.clear()
    return []


def _follower_scatters(b: Binding, held: list[Held], placed: set[str], taken: dict) -> list:
    s = b.s
    for rid in list(b.shadows):
        step_plan.free_shadow(b, rid)
    back, lengths = [], {h.rid: h.length for h in held}
    for rid, req in b.owned.items():
        prefix_cache.let_go(s, req)  # it comes back with a copy of its KV of its own, or is recomputed
        if rid in placed:
            row = memory_pool.alloc_row(s)
            memory_pool.write_row(s, row, taken[rid])
            rq.attach_kv(req, row, lengths[rid])
            back.append(req)
        else:
            if lengths.get(rid):
                rq.reset_for_recompute(req)
            s.waiting_queue.append(req)
    b.owned = {}
    return back
