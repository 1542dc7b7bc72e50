"""Parked requests: a group's long-context requests set aside with their KV where it is, so that the members can
serve a burst in DP (``Release.park``), and continued later by the same members in the same order
(``Bind.resume``). The router's side: :mod:`router.parking`.

At a release with ``park`` the leader picks, at a clean step boundary (never inside a chunked prefill), the TP
requests no member holds alone (their prompt and ``max_new_tokens`` exceed one engine's own KV tokens); every member
then takes its part of them out of the group before the others scatter: the leader its scheduler's requests and
whom it streams them for, a follower its rows and slots for them (its shadows) and its own clients' requests. Each
member keeps the sub-slot allocator of the epoch's width, whose physical slots hold its head slices of their KV:
back in DP those slots stay allocated (the engine reports fewer free KV tokens) and nothing else is touched.

A resume installs that allocator again at the same width and rank, so every request row still names the right
virtual slots: the leader merges its parked requests into its running batch (they decode their next token at the
next step) and a follower takes its shadows and its clients' requests back. A release of a parked epoch (its
group cannot resume: a member is gone) ends them with an abort and frees their rows and slots.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from flying.messages import GROUP_PARKED
from worker_ext.kv_layout import SubSlotAllocator
from worker_ext.sglang_patches.requests import Emitted
from worker_ext.sglang_patches.surface import GroupTree, ParkingEngine, Req
from worker_ext.step_plan import ShadowReq

if TYPE_CHECKING:
    from worker_ext.epoch import Epoch
    from worker_ext.ownership import Ownership
    from worker_ext.step_plan import Shadows

log = logging.getLogger("flying.parking")
ABORT_PREFILL = GROUP_PARKED.message


class ResumeMismatch(RuntimeError):
    """A resume names a parked epoch this engine does not hold as the bind's members and rank."""


@dataclass
class ParkedEpoch:
    """One member's part of a parked epoch."""

    epoch: int
    members: tuple[int, ...]
    rank: int
    sub: SubSlotAllocator  # virtual slots of the epoch's width: the parked requests' head slices live in them
    cache: GroupTree | None = None  # leader: the group's prefix tree (its requests' prompts are in it)
    reqs: list[Req] = field(default_factory=list)  # leader: its scheduler's requests (rows, virtual slots)
    copies: dict[str, tuple[int, tuple[int, int]]] = field(default_factory=dict)  # leader: rid -> owner, sent
    shadows: dict[str, ShadowReq] = field(default_factory=dict)  # follower: its rows and slots for them
    owned: dict[str, Req] = field(default_factory=dict)  # follower: its own clients' requests among them

    @property
    def requests(self) -> int:
        return len(self.reqs) if self.rank == 0 else len(self.shadows)


class Parking:
    """The engine's parked epochs (epoch -> its part)."""

    def __init__(self, engine: ParkingEngine, index: int) -> None:
        self.engine, self.index = engine, index
        self._parked: dict[int, ParkedEpoch] = {}

    def __contains__(self, epoch: int) -> bool:
        return epoch in self._parked

    def __bool__(self) -> bool:
        return bool(self._parked)

    def epochs(self) -> tuple[int, ...]:
        return tuple(sorted(self._parked))

    def holds(self, epoch: int, members: tuple[int, ...], rank: int) -> bool:
        p = self._parked.get(epoch)
        return p is not None and p.members == members and p.rank == rank

    # --- the leader's choice --------------------------------------------------------------------------------

    def to_park(self, max_total_tokens: int) -> set[str]:
        """Leader: the TP requests no member holds alone (prompt plus ``max_new_tokens`` above one engine's
        ``max_total_tokens``), running or waiting."""
        reqs = self.engine.running() + self.engine.waiting()
        return {r.rid for r in reqs if self.engine.kv_need(r) > max_total_tokens}

    def requeue_prefilling(self, max_total_tokens: int, ownership: Ownership) -> str | None:
        """Leader, a park asked: a request no member holds alone that is in its chunked prefill (the step
        boundaries between its chunks are not clean, so the park would wait for its whole prefill) ends now with
        the group-lost abort, no token of it streamed: the gateway queues it again, and it starts over later. A
        member's own request gets the abort through the outbox. Returns its id (None: none)."""
        req = self.engine.chunked_request()
        if req is None or self.engine.kv_need(req) <= max_total_tokens:
            return None
        self.engine.abort_chunked(ABORT_PREFILL)
        if ownership.owner_of(req.rid):
            ownership.take_copies({req.rid})
            end = self.engine.group_lost_reason(ABORT_PREFILL)
            ownership.send(Emitted(rid=req.rid, output_ids=[], finished_reason=end, finished_len=0))
        log.info(
            "engine %d: %s ends in its prefill, to be queued again (its group parks)", self.index, req.rid
        )
        return str(req.rid)

    # --- park -----------------------------------------------------------------------------------------------

    def park(
        self, e: Epoch, rids: set[str], sub: SubSlotAllocator, ownership: Ownership, shadows: Shadows
    ) -> None:
        """Every member, at the release, before the other TP requests scatter: take ``rids`` out of the group
        with their KV (``sub``: the epoch's sub-slot allocator, kept)."""
        p = ParkedEpoch(e.epoch, e.members, e.rank, sub)
        if e.leader:
            p.reqs = self.engine.drop_from_batches(rids)
            p.copies = ownership.take_copies(rids)
            p.cache = self.engine.group_cache()
        else:
            p.shadows = shadows.take(rids)
            p.owned = ownership.take_owned_of(rids)
        self._parked[e.epoch] = p
        log.info(
            "engine %d: epoch %d parks %d requests (their KV stays: %d physical slots)",
            self.index,
            e.epoch,
            p.requests,
            sub.physical_in_use(),
        )

    # --- resume ---------------------------------------------------------------------------------------------

    def sub_for(self, epoch: int, members: tuple[int, ...], rank: int) -> SubSlotAllocator:
        """The sub-slot allocator a resume installs (the parked epoch's, at the same width and rank)."""
        if not self.holds(epoch, members, rank):
            raise ResumeMismatch(
                f"engine {self.index} holds no parked epoch {epoch} as rank {rank} of {members}"
            )
        return self._parked[epoch].sub

    def cache_for(self, epoch: int) -> GroupTree | None:
        """The group prefix tree a resuming leader installs again (None: the epoch had none)."""
        return self._parked[epoch].cache

    def resume(self, epoch: int, e: Epoch, ownership: Ownership, shadows: Shadows) -> int:
        """Every member, once bound again with that epoch's allocator installed: the parked requests continue
        in epoch ``e``. Returns how many."""
        p = self._parked.pop(epoch)
        if e.leader:
            decoding = [r for r in p.reqs if self.engine.kv_length(r)]
            self.engine.merge_decoding(decoding)
            self.engine.queue_front([r for r in p.reqs if not self.engine.kv_length(r)])
            ownership.put_copies(p.copies)
        else:
            shadows.put(p.shadows)
            ownership.add_owned(list(p.owned.values()))
        log.info(
            "engine %d: epoch %d resumes %d requests parked at epoch %d",
            self.index,
            e.epoch,
            p.requests,
            epoch,
        )
        return p.requests

    # --- discard --------------------------------------------------------------------------------------------

    def discard(self, epoch: int, why: str) -> int:
        """The parked epoch cannot resume: end its requests here (aborted to their clients) and free their rows
        and slots. Returns how many requests it held."""
        p = self._parked.pop(epoch, None)
        if p is None:
            return 0
        engine, ended = self.engine, []
        for req in p.reqs:
            if p.cache is not None:
                p.cache.let_go(req)
            if engine.kv_length(req):
                # (the tree keeps its cached prompt)
                p.sub.free(engine.kv_slots(req)[engine.shared_len(req) :])
                engine.let_go(req)
                engine.free_row(engine.kv_row(req))
                engine.detach_kv(req)
            if req.rid not in p.copies:
                ended.append(req)  # the leader streams it (a copy's owner ends its own)
        for sh in p.shadows.values():
            own = sh.owned()
            if own is not None and own.numel():
                p.sub.free(own)
            engine.free_row(sh.row)
        if p.cache is not None:
            p.cache.drop(p.sub.free)
        if p.sub.aliases:  # a follower's copies of the slots its leader's tree held
            p.sub.free(torch.tensor(list(p.sub.aliases.values()), dtype=torch.int64))
            p.sub.aliases.clear()
        for req in p.owned.values():
            engine.let_go(req)
            ended.append(req)
        engine.end_group_lost(ended)
        log.warning(
            "engine %d: parked epoch %d ended (%s): %d requests aborted", self.index, epoch, why, len(ended)
        )
        return p.requests
