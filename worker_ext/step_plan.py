"""Step plans: while bound, the leader's scheduler forms every batch and broadcasts a plan before each forward
(the ForwardBatch fields minus engine-local ones, the live request ids, output for other members to stream); a
follower leaves its scheduler loop and executes plans on its own request rows and KV slots (shadows) until the
leader broadcasts the release.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from worker_ext import aborts, sglang_patches
from worker_ext.rank_messages import Forward, Noop, ReleasePlan
from worker_ext.sglang_patches import memory_pool, prefix_cache

if TYPE_CHECKING:
    from worker_ext.binding import Binding

log = logging.getLogger("flying.step_plan")


@dataclass
class ShadowReq:
    """A follower's copy of one TP request: its own request row and KV slots (the first ``pinned`` of them, an own
    adopted request's cached prompt, belong to this engine's prefix tree: read in place, never freed here)."""

    row: int
    slots: list[torch.Tensor] = field(default_factory=list)
    pinned: int = 0


def around_forward(b: Binding, original, runner, forward_batch, *args, **kwargs):
    """Every ``ModelRunner.forward``: unbound, as is (the batch is kept as the template followers fill in); bound,
    the leader broadcasts the plan first, and the all-reduces go over the group."""
    e = b.epoch
    if e is None:
        b.template = forward_batch
        return original(runner, forward_batch, *args, **kwargs)
    try:
        if e.leader and not e.failed:
            e.group.broadcast_object(plan(b, forward_batch))
            b.last_plan = time.monotonic()
        if not e.failed:
            with sglang_patches.tp_group_override(e.group):
                return original(runner, forward_batch, *args, **kwargs)
    except RuntimeError as exc:
        if not e.leader:
            raise  # a follower's follow() aborts the epoch
        e.failed = exc
        b.error = f"epoch {e.epoch} aborted: {type(exc).__name__}: {str(exc)[:200]}"
        log.error("engine %d: %s", b.engine, b.error, exc_info=exc)
    # The group is gone mid-step. Finish this step alone (the scheduler needs its output), with every request
    # of the batch ending in an abort; the next step boundary ends the epoch (see Binding.on_step).
    sglang_patches.abort_batch(b.s, f"tensor-parallel group {e.members} lost a member; request aborted")
    with sglang_patches.tp_group_override(sglang_patches.LOCAL_GROUP):
        return original(runner, forward_batch, *args, **kwargs)


def plan(b: Binding, fb: Any) -> Forward:
    live = sorted(sglang_patches.live_rids(b.s) | set(fb.rids))
    return Forward(sglang_patches.batch_fields(fb), live, b.take_outbox())


def follow(b: Binding) -> None:
    """A follower's loop while bound: apply the leader's messages in order until the epoch ends."""
    e = b.epoch
    assert e is not None
    while b.epoch is e:
        try:
            msg = e.group.broadcast_object()
            assert isinstance(msg, Forward | Noop | ReleasePlan)  # the leader sends plans while bound
            b.deliver(msg.emit)
            aborts.forward(b, e)  # the follower's own clients' aborts, which its idle loop cannot read
            if isinstance(msg, ReleasePlan) and msg.scatter is not None:
                b.scatter_and_leave(msg.scatter, msg.next)
                return
            if isinstance(msg, ReleasePlan):
                b.leave(msg.next)
                return
            if isinstance(msg, Forward):
                execute(b, msg)
        except RuntimeError as exc:
            b.abort(exc)


def free_shadow(b: Binding, rid: str) -> None:
    sh = b.shadows.pop(rid)
    own = torch.cat(sh.slots)[sh.pinned :] if sh.slots else None
    if own is not None and own.numel():
        b.allocator.free(own)
    memory_pool.free_row(b.s, sh.row)


def execute(b: Binding, msg: Forward) -> None:
    live = set(msg.live)
    for rid in [r for r in b.shadows if r not in live]:
        free_shadow(b, rid)
    rows, locs = [], []
    for rid, seq, n in sglang_patches.batch_tokens(msg.fields):
        sh = b.shadows.get(rid)
        if sh is None:
            sh = b.shadows[rid] = ShadowReq(memory_pool.alloc_row(b.s))
        prefix_cache.make_room(b.s, n)
        slots = b.allocator.alloc(n)
        assert slots is not None, "follower out of KV slots"
        memory_pool.write_row(b.s, sh.row, slots, start=seq - n)
        sh.slots.append(slots)
        rows.append(sh.row)
        locs.append(slots)
    fb = sglang_patches.follower_batch(b.template, msg.fields, rows, torch.cat(locs))
    # Through around_forward: the pooled all-reduce, and no plan (a follower does not send one).
    with torch.inference_mode():
        sglang_patches.model_runner(b.s).forward(fb)
