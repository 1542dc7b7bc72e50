"""Small fakes of what the worker's switching components talk to: the scheduler surface
(worker_ext.sglang_patches.surface.SchedulerSurface) over plain lists, a pooled group whose collectives are
scripted, the communicator pool and its store, and the engine's layout. No SGLang, no torch.distributed."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from worker_ext.sglang_patches import RequestLimits
from worker_ext.sglang_patches.requests import Emitted, Received, ReqState


@dataclass
class FakeReq:
    rid: str
    output_ids: list[int] = field(default_factory=list)
    kv_len: int = 0
    shared: int = 0  # tokens of its KV that sit in the prefix tree
    movable: bool = True
    finished_reason: str | None = None
    to_finish: str | None = None  # an end set outside the output stream (SGLang's abort)
    row: int = -1
    need: int = 0  # KV tokens it may come to hold (prompt and max_new_tokens)

    def finished(self) -> bool:
        return self.finished_reason is not None


@dataclass
class FakeEngine:
    """A scheduler's queues as lists; every other call is recorded in ``calls``."""

    running_reqs: list[FakeReq] = field(default_factory=list)
    waiting_reqs: list[FakeReq] = field(default_factory=list)
    clean: bool = True  # at a clean step boundary
    chunked: FakeReq | None = None  # the request in chunked prefill
    kv_free: int = 1 << 20  # slots alloc_slots can still give
    aborts_in: list[list[str]] = field(default_factory=list)  # the aborts receive() returns, call by call
    new_in: list[list[FakeReq]] = field(
        default_factory=list
    )  # the new requests receive() returns, call by call
    limits: RequestLimits = RequestLimits(1000, 990, 4096)
    width: int = 1  # the width of the request limits set
    idle_checks: bool = True
    idle_poll_s: float | None = None
    bypassed: bool = False
    group_tree: Any = None  # the group prefix tree installed by a bind (see new_group_tree)
    new_group_tree: Callable[[], Any] | None = (
        None  # makes a leader's group prefix tree (None: radix cache off)
    )
    divert: Callable[[Any], bool] | None = None
    streamed: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # requests ended as "group lost"
    forwards: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (rows, slots) of followers
    rows_in_use: set[int] = field(default_factory=set)
    slots_freed: int = 0
    calls: list[str] = field(default_factory=list)
    tp_groups: list[Any] = field(default_factory=list)
    _next_row: int = 0
    _next_slot: int = 0

    # --- the request queues ---------------------------------------------------------------------------------
    def running(self) -> list[FakeReq]:
        return [r for r in self.running_reqs if not r.finished()]

    def waiting(self) -> list[FakeReq]:
        return list(self.waiting_reqs)

    def live_rids(self) -> set[str]:
        return {r.rid for r in self.running_reqs + self.waiting_reqs}

    def unfinished_running_rids(self) -> set[str]:
        return {r.rid for r in self.running()}

    def has_running_dp_work(self) -> bool:
        return bool(self.running())

    def at_clean_step_boundary(self) -> bool:
        return self.clean

    def hold_waiting(self) -> list[FakeReq]:
        held, self.waiting_reqs = self.waiting_reqs, []
        return held

    def queue_front(self, reqs: list[FakeReq]) -> None:
        self.waiting_reqs[:0] = reqs

    def queue_back(self, reqs: list[FakeReq]) -> None:
        self.waiting_reqs.extend(reqs)

    def retract_running(self) -> list[FakeReq]:
        reqs = self.running()
        for r in reqs:
            r.kv_len = 0
        self.running_reqs = []
        return reqs

    def drop_from_batches(self, rids: set[str]) -> list[FakeReq]:
        gone = [r for r in self.running_reqs + self.waiting_reqs if r.rid in rids]
        self.running_reqs = [r for r in self.running_reqs if r.rid not in rids]
        self.waiting_reqs = [r for r in self.waiting_reqs if r.rid not in rids]
        return gone

    def merge_decoding(self, reqs: list[FakeReq]) -> None:
        self.running_reqs += reqs

    # --- DP work and limits ---------------------------------------------------------------------------------
    def stash_dp_work(self, held: list[FakeReq] | None = None) -> tuple[Any, list[Any], Any]:
        stash = (self.running_reqs, list(held or []) + self.waiting_reqs, None)
        self.running_reqs, self.waiting_reqs = [], []
        return stash

    def empty_stash(self) -> tuple[Any, list[Any], Any]:
        return [], [], None

    def stash_size(self, stash: tuple[Any, list[Any], Any]) -> int:
        running, waiting, _ = stash
        return len(running) + len(waiting)

    def stashed_rids(self, stash: tuple[Any, list[Any], Any]) -> set[str]:
        running, waiting, _ = stash
        return {r.rid for r in running + waiting}

    def restore_dp_work(self, stash: tuple[Any, list[Any], Any]) -> None:
        running, waiting, _ = stash
        self.running_reqs += running
        self.waiting_reqs[:0] = waiting

    def suspend_idle_checks(self) -> None:
        self.idle_checks = False

    def resume_idle_checks(self) -> None:
        self.idle_checks = True

    def idle_poll(self, seconds: float | None) -> None:
        self.idle_poll_s = seconds

    def request_limits(self) -> RequestLimits:
        return self.limits

    def set_request_limits(self, dp: RequestLimits, width: int) -> None:
        self.width = width

    # --- the prefix tree ------------------------------------------------------------------------------------
    def bypass_prefix_cache(self, base: Any, width: int, group: Any = None) -> None:
        self.bypassed = True
        self.group_tree = group

    def restore_prefix_cache(self) -> None:
        self.bypassed = False
        self.group_tree = None

    def new_group_cache(self) -> Any:
        return self.new_group_tree() if self.new_group_tree is not None else None

    def group_cache(self) -> Any:
        return self.group_tree

    def evictable_physical(self) -> int:
        return 0

    def evict_physical(self, num_tokens: int) -> None:
        self.calls.append(f"evict {num_tokens}")

    def make_room(self, num_tokens: int) -> None:
        self.calls.append(f"make_room {num_tokens}")

    def let_go(self, req: FakeReq) -> None:
        self.calls.append(f"let_go {req.rid}")

    def shared_len(self, req: FakeReq) -> int:
        return req.shared

    # --- one request ----------------------------------------------------------------------------------------
    def adoptable(self, req: FakeReq) -> bool:
        return req.movable and not req.finished()

    def kv_length(self, req: FakeReq) -> int:
        return req.kv_len

    def kv_need(self, req: FakeReq) -> int:
        return req.need or req.kv_len

    def kv_slots(self, req: FakeReq) -> torch.Tensor:
        return torch.arange(req.kv_len)

    def kv_row(self, req: FakeReq) -> int:
        return req.row

    def detach_kv(self, req: FakeReq) -> tuple[int, int]:
        row, n = req.row, req.kv_len
        req.row, req.kv_len = -1, 0
        return row, n

    def attach_kv(self, req: FakeReq, row: int, length: int) -> None:
        req.row, req.kv_len = row, length

    def release_kv(self, req: FakeReq) -> None:
        req.kv_len = 0

    def retract(self, reqs: list[FakeReq]) -> None:
        for r in reqs:
            r.kv_len = 0

    def reset_for_recompute(self, req: FakeReq) -> None:
        req.kv_len = 0

    def state_of(self, req: FakeReq) -> ReqState:
        return ReqState(rid=req.rid, origin_input_text=None, origin_input_ids=[1, 2], output_ids=list(req.output_ids),
                        sampling_params=None, return_logprob=False, top_logprobs_num=0, token_ids_logprob=None,
                        logprob_start_len=-1, stream=True, eos_token_ids=None, vocab_size=None, priority=None)  # fmt: skip

    def req_from_state(self, st: ReqState) -> FakeReq:
        return FakeReq(st.rid, list(st.output_ids))

    def progress(self, req: FakeReq) -> tuple[int, int]:
        return len(req.output_ids), 0

    def emitted_since(self, req: FakeReq, sent: tuple[int, int], ending: bool = False) -> Emitted:
        em = Emitted(rid=req.rid, output_ids=req.output_ids[sent[0] :])
        if req.finished():
            em.finished_reason = req.finished_reason
        elif ending:
            em.finished_reason = req.to_finish
        return em

    def apply_emitted(self, req: FakeReq, em: Emitted) -> None:
        req.output_ids += em.output_ids
        if em.finished_reason is not None:
            req.finished_reason = em.finished_reason

    def is_finished(self, req: FakeReq) -> bool:
        return req.finished()

    # --- rows and slots -------------------------------------------------------------------------------------
    def alloc_row(self) -> int:
        self._next_row += 1
        self.rows_in_use.add(self._next_row)
        return self._next_row

    def free_row(self, row: int) -> None:
        self.rows_in_use.remove(row)

    def write_row(self, row: int, slots: torch.Tensor, start: int = 0) -> None:
        self.calls.append(f"write_row {row} {slots.numel()}@{start}")

    def alloc_slots(self, n: int) -> torch.Tensor | None:
        if n > self.kv_free:
            return None
        self.kv_free -= n
        self._next_slot += n
        return torch.arange(self._next_slot - n, self._next_slot)

    def free_slots(self, slots: torch.Tensor) -> None:
        self.kv_free += slots.numel()
        self.slots_freed += slots.numel()

    # --- output and ends ------------------------------------------------------------------------------------
    def stream(self, reqs: list[FakeReq]) -> None:
        self.streamed += [r.rid for r in reqs]

    def apply_output_filter(self, divert: Callable[[Any], bool], end: Callable[[Any], bool]) -> None:
        self.divert, self.end = divert, end

    def remove_output_filter(self) -> None:
        self.divert = self.end = None

    def end_group_lost(self, reqs: list[FakeReq]) -> None:
        for r in reqs:
            r.finished_reason = "group lost"
        self.lost += [r.rid for r in reqs]

    def drop_tp_requests(self) -> list[str]:
        reqs = [r for r in self.running_reqs + self.waiting_reqs if not r.finished()]
        self.end_group_lost(reqs)
        self.running_reqs, self.waiting_reqs = [], []
        return [r.rid for r in reqs]

    def chunked_request(self) -> FakeReq | None:
        return self.chunked

    def group_lost_reason(self, message: str) -> str:
        return "group lost"

    def abort_chunked(self, message: str) -> None:
        if self.chunked is not None:
            self.chunked.finished_reason = "group lost"
            self.lost.append(self.chunked.rid)
            self.chunked = None

    def abort_batch(self, message: str) -> None:
        self.calls.append(f"abort_batch {message}")

    def receive(self) -> Received:
        aborted = self.aborts_in.pop(0) if self.aborts_in else []
        return Received(aborted, self.new_in.pop(0) if self.new_in else [])

    def abort(self, rid: str) -> None:
        self.calls.append(f"abort {rid}")

    def end_aborted(self, reqs: list[FakeReq]) -> None:
        for r in reqs:
            r.finished_reason = "abort"
        self.stream(reqs)

    # --- the forward ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def tp_group(self, group: Any) -> Iterator[None]:
        self.tp_groups.append(group)
        yield

    def batch_fields(self, forward_batch: Any) -> dict[str, Any]:
        return dict(forward_batch)

    def batch_tokens(self, fields: dict[str, Any]) -> list[tuple[str, int, int]]:
        return list(fields["tokens"])

    def batch_rids(self, forward_batch: Any) -> list[str]:
        return [rid for rid, _, _ in forward_batch["tokens"]]

    def step_tokens(self, forward_batch: Any) -> int:
        return sum(n for _, _, n in forward_batch["tokens"])

    def take_repoints(self) -> dict[str, tuple[int, list[int]]]:
        return {}

    def plan_slots(self, forward_batch: Any) -> tuple[list[int], dict[str, list[int]]] | None:
        if self.group_tree is None:
            return None
        return list(forward_batch.get("slots", [])), dict(forward_batch.get("prefixes", {}))

    def forward(self, template: Any, fields: dict[str, Any], rows: list[int], slots: torch.Tensor) -> None:
        self.forwards.append((rows, slots.tolist()))


class FakeGroup:
    """One member's view of a pooled group. The leader's broadcasts are recorded in ``sent``; a follower's
    receives come from ``inbox`` in order; ``all_gather_object`` answers this member's object with ``others``.
    ``broken``: every collective raises as a lost member makes gloo raise."""

    def __init__(self, members: tuple[int, ...], rank: int, inbox: list[Any] | None = None) -> None:
        self.members, self.rank = members, rank
        self.inbox = list(inbox or [])
        self.sent: list[Any] = []
        self.others: list[Any] = []
        self.room: list[int] | None = None
        self.broken = False
        self.data = self
        self.spent_ms: dict[str, float] = {}

    def _check(self) -> None:
        if self.broken:
            raise RuntimeError("Connection closed by peer")

    def close(self) -> None:
        self.broken = True

    def broadcast_object(self, obj: object = None) -> object:
        self._check()
        if self.rank == 0:
            self.sent.append(obj)
            return obj
        if not self.inbox:
            raise RuntimeError("timed out waiting for the leader")
        return self.inbox.pop(0)

    def all_gather_object(self, obj: object) -> list[Any]:
        self._check()
        if isinstance(obj, int):  # the members' KV headroom after a bind: ``room`` answers for the others
            others: list[Any] = self.room if self.room is not None else [obj] * (len(self.members) - 1)
        else:
            others = self.others
        return [obj, *others] if self.rank == 0 else [*others[:1], obj, *others[1:]]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._check()
        return tensor

    def alltoall_base(self, out: torch.Tensor, inp: torch.Tensor, *_: Any) -> FakeGroup:
        """A KV exchange of one member with itself (only empty exchanges are run through fakes)."""
        self._check()
        out.copy_(inp)
        return self

    def wait(self) -> None:
        pass


class FakeStore:
    """torch.distributed's Store, in memory."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.counters: dict[str, int] = {}

    def add(self, key: str, n: int) -> int:
        self.counters[key] = self.counters.get(key, 0) + n
        return self.counters[key]

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)


class FakePool:
    def __init__(
        self, groups: dict[tuple[int, ...], FakeGroup], num_engines: int = 2, store: Any = None
    ) -> None:
        self.groups = groups
        self.num_engines = num_engines
        self.first = 0
        self.rebuilds = 0
        self.resets: list[tuple[tuple[int, ...], int]] = []
        self.store = store
        self.ready = threading.Event()
        self.ready.set()

    def get(self, members: tuple[int, ...]) -> FakeGroup:
        if members not in self.groups:
            raise KeyError(f"no pooled group for {members}")
        return self.groups[members]

    def reset(self, group: FakeGroup, epoch: int) -> None:
        group.close()
        self.resets.append((group.members, epoch))


class FakeSub:
    def __init__(self, width: int) -> None:
        self.width = width
        self.base = self
        self.available = 1000
        self.freed: list[int] = []  # virtual slots given back through it
        self.free_log: list[int] | None = None
        self.aliases: dict[int, int] = {}

    def take_freed(self) -> list[int]:
        return []

    def available_size(self) -> int:
        return self.available

    def free(self, slots: torch.Tensor) -> None:
        self.freed += slots.tolist()

    def alloc(self, n: int) -> torch.Tensor:
        return torch.arange(n)

    def take_over(self, slots: torch.Tensor, keep: int) -> torch.Tensor:
        return slots

    def physical_in_use(self) -> int:
        return 0


class FakeLayout:
    def __init__(self) -> None:
        from worker_ext.sequence_parallel import StepMode

        self.mode = StepMode.TP
        self.modes: list[StepMode] = []  # every step_mode call
        self.width, self.rank = 1, 0
        self.weights_width = 1  # the weights stay on a shard until released
        self.sub: FakeSub | None = None
        self.available = 1000

    def bind(self, width: int, rank: int, group: Any, sub: FakeSub | None = None) -> FakeSub:
        self.width = self.weights_width = width
        self.rank = rank
        self.sub = sub if sub is not None else FakeSub(width)
        self.kept_back = 0
        return self.sub

    def keep_back(self, n: int) -> None:
        self.kept_back = n

    def unbind(self) -> None:
        from worker_ext.sequence_parallel import StepMode

        self.width, self.sub, self.mode = 1, None, StepMode.TP

    def step_mode(self, mode: Any) -> None:
        self.modes.append(mode)
        self.mode = mode

    def release_weights(self) -> None:
        self.weights_width = 1

    def param_bytes(self) -> int:
        return 1234

    def sub_allocator(self) -> FakeSub:
        if self.sub is None:
            raise RuntimeError("not bound")
        return self.sub

    def sub_available(self) -> int:
        return self.available

    def base_available(self) -> int:
        return self.available

    def kv_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [torch.zeros(16, 2)], [torch.zeros(16, 2)]
