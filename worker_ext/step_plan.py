"""Step plans: while bound, the leader's scheduler forms every batch and broadcasts a plan before each forward
(the ForwardBatch fields minus engine-local ones, the live request ids, output for other members to stream); a
follower leaves its scheduler loop and executes plans on its own request rows and KV slots (its *shadows* of the TP
requests) until the leader broadcasts the release (the loop is ``Binding.follow``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from worker_ext.rank_messages import Forward
from worker_ext.sequence_parallel import StepMode
from worker_ext.sglang_patches.requests import Emitted
from worker_ext.sglang_patches.surface import StepPlanEngine

log = logging.getLogger("flying.step_plan")
# an idle leader still broadcasts this often: followers tell idle from dead, and read their
KEEPALIVE_S = 0.05
# own clients' input between its messages (a request sent to a follower waited for the next one)


class FollowerOutOfKV(RuntimeError):
    """A follower cannot carve the KV slots a plan needs: the group cannot go on (the epoch is aborted)."""


@dataclass
class ShadowReq:
    """A follower's copy of one TP request: its own request row and KV slots (the first ``pinned`` of them, an own
    adopted request's cached prompt, belong to this engine's prefix tree: read in place, never freed here). Under
    a leader with a group prefix tree only the first ``own`` chunks of ``slots`` are freed with the request (None:
    all); the others are freed as the leader frees its slots (:meth:`StepPlans.follow_frees`)."""

    row: int
    slots: list[torch.Tensor] = field(default_factory=list)
    pinned: int = 0
    own: int | None = None

    def owned(self) -> torch.Tensor | None:
        chunks = [c for c in (self.slots if self.own is None else self.slots[: self.own]) if c.numel()]
        return torch.cat(chunks)[self.pinned :] if chunks else None


class Shadows:
    """A follower's request rows and KV slots for the group's TP requests."""

    def __init__(self, engine: StepPlanEngine) -> None:
        self.engine = engine
        self._by_rid: dict[str, ShadowReq] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self._by_rid

    def __len__(self) -> int:
        return len(self._by_rid)

    def add(self, rid: str, row: int, slots: torch.Tensor, pinned: int = 0) -> None:
        """A TP request whose KV already sits in ``slots`` (adopted), in its own ``row``."""
        self._by_rid[rid] = ShadowReq(row, [slots], pinned)

    def slots(self, rid: str) -> torch.Tensor:
        return torch.cat(self._by_rid[rid].slots)

    def start(self, rid: str, prefix: torch.Tensor) -> None:
        """``rid`` starts (again) from a prefix the group caches, held here in ``prefix`` (not its own)."""
        sh = self._by_rid.get(rid)
        if sh is None:
            sh = self._by_rid[rid] = ShadowReq(self.engine.alloc_row(), own=0)
        else:
            self._restart(sh)
        self.engine.write_row(sh.row, prefix)
        sh.slots = [prefix]

    def _restart(self, sh: ShadowReq) -> None:
        """The leader computes the request again from its start (retracted): its old slots of its own go."""
        own = sh.owned()
        if own is not None and own.numel():
            self.engine.free_slots(own)
        sh.slots, sh.pinned, sh.own = [], 0, 0

    def extend(self, rid: str, seq: int, n: int, followed: bool = False) -> tuple[int, torch.Tensor]:
        """Room for ``n`` new tokens of ``rid`` (``seq`` long after them): returns its row and the new slots
        (``followed``: freed as the leader frees its copies, not with the request)."""
        sh = self._by_rid.get(rid)
        if sh is None:
            sh = self._by_rid[rid] = ShadowReq(self.engine.alloc_row(), own=0 if followed else None)
        elif followed and sh.own is None:
            sh.own = len(sh.slots)  # an adopted request's KV stays its own; what plans add follows the leader
        if followed and seq == n and sh.slots:
            self._restart(sh)
        self.engine.make_room(n)
        slots = self.engine.alloc_slots(n)
        if slots is None:
            raise FollowerOutOfKV(f"follower out of KV slots for {n} tokens of {rid}")
        self.engine.write_row(sh.row, slots, start=seq - n)
        sh.slots.append(slots)
        return sh.row, slots

    def repoint(self, rid: str, first: int, slots: torch.Tensor) -> None:
        """Positions ``first ..`` of ``rid`` now read ``slots`` (copies of the group tree's), not its own."""
        sh = self._by_rid[rid]
        if sh.own:
            raise RuntimeError(
                f"{rid}: a request with KV of its own (adopted) was checkpointed into the group"
            )
        kv = torch.cat(sh.slots)
        kv[first : first + slots.numel()] = slots
        self.engine.write_row(sh.row, slots, start=first)
        sh.slots = [kv]

    def free(self, rid: str) -> None:
        sh = self._by_rid.pop(rid)
        own = sh.owned()
        if own is not None and own.numel():
            self.engine.free_slots(own)
        self.engine.free_row(sh.row)

    def free_except(self, live: set[str]) -> None:
        for rid in [r for r in self._by_rid if r not in live]:
            self.free(rid)

    def free_all(self) -> None:
        self.free_except(set())

    def take(self, rids: set[str]) -> dict[str, ShadowReq]:
        """Hand over the rows and slots of ``rids`` (parked: worker_ext.parking keeps them)."""
        return {rid: self._by_rid.pop(rid) for rid in list(self._by_rid) if rid in rids}

    def put(self, shadows: dict[str, ShadowReq]) -> None:
        """Take back rows and slots handed over by :meth:`take` (resumed)."""
        self._by_rid.update(shadows)


class StepPlans:
    """The plan side of a bound group: the leader sends one before each forward (and keepalives when idle); a
    follower executes them on its shadows, over a ForwardBatch of its own kept as the template."""

    def __init__(self, engine: StepPlanEngine, shadows: Shadows) -> None:
        self.engine = engine
        self.shadows = shadows
        self.template: Any = None  # a ForwardBatch of this engine's own, reused by followers
        self._last_sent = 0.0

    def keep_template(self, forward_batch: Any) -> None:
        self.template = forward_batch

    def plan(
        self,
        forward_batch: Any,
        emit: list[Emitted],
        mode: StepMode,
        freed: list[int] | None = None,
        repoints: dict[str, tuple[int, list[int]]] | None = None,
    ) -> Forward:
        live = sorted(self.engine.live_rids() | set(self.engine.batch_rids(forward_batch)))
        msg = Forward(self.engine.batch_fields(forward_batch), live, emit, mode, freed=freed or [])
        msg.repoints = repoints or {}
        got = self.engine.plan_slots(forward_batch)
        if got is not None:
            msg.slots, msg.prefixes = got
        return msg

    def sent(self) -> None:
        """The leader just broadcast a message."""
        self._last_sent = time.monotonic()

    def keepalive_due(self) -> bool:
        return time.monotonic() - self._last_sent > KEEPALIVE_S

    def execute(self, msg: Forward, aliases: dict[int, int] | None = None) -> None:
        """Follower: run the leader's forward on this engine's shadows of its requests (``aliases``: the leader's
        virtual slots -> this member's, under a leader with a group prefix tree)."""
        aliases = {} if aliases is None else aliases
        self.follow(msg.freed, msg.repoints, aliases)
        self.shadows.free_except(set(msg.live))
        followed = msg.slots is not None
        for rid, prefix in msg.prefixes.items():
            self.shadows.start(rid, _mine(rid, prefix, aliases))
        rows, locs = [], []
        for rid, seq, n in self.engine.batch_tokens(msg.fields):
            row, slots = self.shadows.extend(rid, seq, n, followed)
            rows.append(row)
            locs.append(slots)
        if self.template is None:
            raise RuntimeError("no ForwardBatch of this engine's own seen yet (warm-up should have run one)")
        own = torch.cat(locs)
        if msg.slots is not None:
            if len(msg.slots) != own.numel():
                raise RuntimeError(f"the plan carries {len(msg.slots)} slots for {own.numel()} tokens")
            aliases.update(zip(msg.slots, own.tolist()))
        self.engine.forward(self.template, msg.fields, rows, own)

    def follow(
        self, freed: list[int], repoints: dict[str, tuple[int, list[int]]], aliases: dict[int, int]
    ) -> None:
        """Follower: point rows where the leader's checkpoints pointed its rows (at its tree's slots), then free
        what the leader freed."""
        for rid, (first, slots) in repoints.items():
            if rid in self.shadows:
                self.shadows.repoint(rid, first, _mine(rid, slots, aliases))
        self.follow_frees(freed, aliases)

    def follow_frees(self, freed: list[int], aliases: dict[int, int]) -> None:
        """Follower: free this member's copies of the slots the leader freed (those it holds: a leader's slot of
        an adopted request has none here, its shadow frees it)."""
        mine = [aliases.pop(v) for v in freed if v in aliases]
        if mine:
            self.engine.free_slots(torch.tensor(mine, dtype=torch.int64))

    def free_aliases(self, aliases: dict[int, int]) -> None:
        """Follower, the epoch over: every slot still held for the leader's tree goes."""
        self.follow_frees(list(aliases), aliases)


def _mine(rid: str, leader_slots: list[int], aliases: dict[int, int]) -> torch.Tensor:
    """This member's copies of the leader's ``leader_slots``."""
    missing = [v for v in leader_slots if v not in aliases]
    if missing:
        raise RuntimeError(f"{rid} reads {len(missing)} cached slots this member holds no copy of")
    return torch.tensor([aliases[v] for v in leader_slots], dtype=torch.int64)
