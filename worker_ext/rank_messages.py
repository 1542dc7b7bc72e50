"""Messages among the members of one bound group, sent by the leader over the group's control communicator
(pickled, see ``MergedGroup.broadcast_object``): one per step boundary or forward, in the order every member
applies them."""

from __future__ import annotations

from typing import Any

import msgspec

from flying.messages import Bind
from worker_ext.kv_transform import Held
from worker_ext.sequence_parallel import StepMode
from worker_ext.sglang_patches.requests import Emitted, ReqState


class Handshake(msgspec.Struct, frozen=True):
    """The leader has bound ``epoch``; members check they bound the same one."""

    epoch: int


class Forward(msgspec.Struct):
    """Run this forward: the leader's ForwardBatch fields (engine-local ones left out) and the live request ids
    (a member frees its copies of the others). A leader with a group prefix tree (worker_ext.sglang_patches.
    group_cache) adds its new slots (``slots``, in batch order), the slots of each cached prefix a request starts
    from (``prefixes``), the slots it freed since its last message (``freed``) and the row entries its tree's
    checkpoints pointed at the tree's slots (``repoints``: rid -> first position, slots): a member's copies of
    those follow the leader's."""

    fields: dict[str, Any]
    live: list[str]
    emit: list[Emitted] = []
    mode: StepMode = StepMode.TP
    slots: list[int] | None = None
    prefixes: dict[str, list[int]] = {}
    freed: list[int] = []
    repoints: dict[str, tuple[int, list[int]]] = {}


class Noop(msgspec.Struct):
    """Keepalive (an idle leader sends one every KEEPALIVE_S), or a carrier for output other members stream."""

    emit: list[Emitted] = []
    freed: list[int] = []
    repoints: dict[str, tuple[int, list[int]]] = {}


class ReleasePlan(msgspec.Struct):
    """End the epoch. ``next``: a width change into that group. ``scatter``: the TP requests go back to DP on
    their owners with their KV (see worker_ext.adoption.scatter). ``parked``: these stay parked first, their KV
    where it is (worker_ext.parking)."""

    next: Bind | None = None
    scatter: list[Held] | None = None
    emit: list[Emitted] = []
    parked: list[str] = []
    freed: list[int] = []
    repoints: dict[str, tuple[int, list[int]]] = {}


class AdoptManifest(msgspec.Struct):
    """One member's part of an adoption: its DP requests, the virtual KV slots it has free at the group's width,
    and (followers) the state of each request so the leader can run it."""

    rank: int
    available: int
    running: list[tuple[str, int, int]]  # (rid, KV tokens, of them in its tree), in the order of ``states``
    states: list[ReqState] = []  # running, then waiting (followers only)


Plan = Forward | Noop | ReleasePlan
