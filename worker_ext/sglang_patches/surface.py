"""The one seam between the switching components and an SGLang scheduler.

:class:`SchedulerSurface` says what the components (``worker_ext.binding`` and the objects it composes) use of
one engine's scheduler, in roles (:class:`Queues`, :class:`DPWork`, :class:`PrefixTree`, :class:`RequestKV`,
:class:`RequestState`, :class:`Output`, :class:`Forward`), each component given only the roles it uses.
:class:`SGLangScheduler` implements it over a live scheduler through this package's small functions; the unit
tests implement it over plain lists (``tests/fakes.py``). SGLang's own objects (its requests,
batches, allocators) pass through as ``Req`` / ``Any``: the components never look inside them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from worker_ext.sglang_patches import (
    RequestLimits,
    abort_batch,
    abort_chunked,
    at_clean_step_boundary,
    batch_fields,
    batch_tokens,
    chunked_request,
    decoder_layers,
    drop_tp_requests,
    empty_stash,
    group_lost,
    has_running_dp_work,
    hold_waiting,
    idle_poll,
    kv_pool,
    live_rids,
    memory_pool,
    model_runner,
    prefix_cache,
    request_limits,
    require,
    restore_dp_work,
    resume_idle_checks,
    retract_running,
    set_request_limits,
    stash_dp_work,
    suspend_idle_checks,
    tp_group_override,
    unfinished_running_rids,
    unhold_waiting,
)
from worker_ext.sglang_patches import requests as rq
from worker_ext.sglang_patches.group_cache import GroupCache
from worker_ext.sglang_patches.requests import Emitted, Received, ReqState

Req = Any  # an SGLang ``Req``, passed through
GroupTree = GroupCache
Stash = tuple[Any, list[Any], Any]  # paused DP work: running batch, waiting requests, last batch


class Queues(Protocol):
    """The scheduler's request queues and batches (what a bind holds back, re-queues or merges)."""

    def running(self) -> list[Req]: ...
    def waiting(self) -> list[Req]: ...
    def live_rids(self) -> set[str]: ...
    def unfinished_running_rids(self) -> set[str]: ...
    def has_running_dp_work(self) -> bool: ...
    def at_clean_step_boundary(self) -> bool: ...
    def hold_waiting(self) -> list[Req]: ...
    def queue_front(self, reqs: list[Req]) -> None: ...
    def queue_back(self, reqs: list[Req]) -> None: ...
    def retract_running(self) -> list[Req]: ...
    def drop_from_batches(self, rids: set[str]) -> list[Req]: ...
    def merge_decoding(self, reqs: list[Req]) -> None: ...


class DPWork(Protocol):
    """DP work set aside across an epoch, and the scheduler's limits and idle checks meanwhile."""

    def stash_dp_work(self, held: list[Req] | None = None) -> Stash: ...
    def empty_stash(self) -> Stash: ...
    def stash_size(self, stash: Stash) -> int: ...
    def stashed_rids(self, stash: Stash) -> set[str]: ...
    def restore_dp_work(self, stash: Stash) -> None: ...
    def suspend_idle_checks(self) -> None: ...
    def resume_idle_checks(self) -> None: ...
    def idle_poll(self, seconds: float | None) -> None: ...
    def request_limits(self) -> RequestLimits: ...
    def set_request_limits(self, dp: RequestLimits, width: int) -> None: ...


class PrefixTree(Protocol):
    """The engine's radix tree while bound (worker_ext.sglang_patches.prefix_cache)."""

    def bypass_prefix_cache(self, base: Any, width: int, group: GroupTree | None = None) -> None: ...
    def restore_prefix_cache(self) -> None: ...
    def new_group_cache(self) -> GroupTree | None: ...
    def group_cache(self) -> GroupTree | None: ...
    def evictable_physical(self) -> int: ...
    def evict_physical(self, num_tokens: int) -> None: ...
    def make_room(self, num_tokens: int) -> None: ...
    def let_go(self, req: Req) -> None: ...
    def shared_len(self, req: Req) -> int: ...


class RequestKV(Protocol):
    """One request's KV (its row and slots), and KV rows and slots of the pool."""

    def adoptable(self, req: Req) -> bool: ...
    def kv_length(self, req: Req) -> int: ...
    def kv_need(self, req: Req) -> int: ...
    def kv_slots(self, req: Req) -> torch.Tensor: ...
    def kv_row(self, req: Req) -> int: ...
    def detach_kv(self, req: Req) -> tuple[int, int]: ...
    def attach_kv(self, req: Req, row: int, length: int) -> None: ...
    def release_kv(self, req: Req) -> None: ...
    def retract(self, reqs: list[Req]) -> None: ...
    def reset_for_recompute(self, req: Req) -> None: ...
    def alloc_row(self) -> int: ...
    def free_row(self, row: int) -> None: ...
    def write_row(self, row: int, slots: torch.Tensor, start: int = 0) -> None: ...
    def alloc_slots(self, n: int) -> torch.Tensor | None: ...
    def free_slots(self, slots: torch.Tensor) -> None: ...


class RequestState(Protocol):
    """A request's state as it travels between members, and its output so far."""

    def state_of(self, req: Req) -> ReqState: ...
    def req_from_state(self, st: ReqState) -> Req: ...
    def progress(self, req: Req) -> tuple[int, int]: ...
    def emitted_since(self, req: Req, sent: tuple[int, int], ending: bool = False) -> Emitted: ...
    def apply_emitted(self, req: Req, em: Emitted) -> None: ...
    def is_finished(self, req: Req) -> bool: ...


class Output(Protocol):
    """What reaches the engine's clients: streamed output, ends and aborts, and what its endpoint received."""

    def stream(self, reqs: list[Req]) -> None: ...
    def apply_output_filter(self, divert: Callable[[Req], bool], end: Callable[[Req], bool]) -> None: ...
    def remove_output_filter(self) -> None: ...
    def end_group_lost(self, reqs: list[Req]) -> None: ...
    def drop_tp_requests(self) -> list[str]: ...
    def abort_batch(self, message: str) -> None: ...
    def chunked_request(self) -> Req | None: ...
    def group_lost_reason(self, message: str) -> Any: ...
    def abort_chunked(self, message: str) -> None: ...
    def receive(self) -> Received: ...
    def abort(self, rid: str) -> None: ...
    def end_aborted(self, reqs: list[Req]) -> None: ...


class Forward(Protocol):
    """The model's forward as a bound group drives it."""

    def tp_group(self, group: Any) -> AbstractContextManager[None]: ...
    def batch_fields(self, forward_batch: Any) -> dict[str, Any]: ...
    def batch_tokens(self, fields: dict[str, Any]) -> list[tuple[str, int, int]]: ...
    def batch_rids(self, forward_batch: Any) -> list[str]: ...
    def step_tokens(self, forward_batch: Any) -> int: ...
    def plan_slots(self, forward_batch: Any) -> tuple[list[int], dict[str, list[int]]] | None: ...
    def take_repoints(self) -> dict[str, tuple[int, list[int]]]: ...
    def forward(
        self, template: Any, fields: dict[str, Any], rows: list[int], slots: torch.Tensor
    ) -> None: ...


class SchedulerSurface(Queues, DPWork, PrefixTree, RequestKV, RequestState, Output, Forward, Protocol):
    """Every role: what the binding, which composes the components, holds of one engine's scheduler."""


# the roles each component is given (only those it uses)
class PreemptionEngine(Queues, Protocol): ...


class StepPlanEngine(Queues, RequestKV, PrefixTree, Forward, Protocol): ...


class OwnershipEngine(RequestState, Output, PrefixTree, Protocol): ...


class RelayEngine(Queues, RequestState, Output, Protocol): ...


class AdoptionEngine(Queues, DPWork, PrefixTree, RequestKV, RequestState, Output, Protocol): ...


class ParkingEngine(Queues, PrefixTree, RequestKV, Output, Protocol): ...


class SGLangScheduler:
    """:class:`SchedulerSurface` over a live SGLang scheduler (this package's functions, bound to it)."""

    def __init__(self, scheduler: Any) -> None:
        self.s = scheduler

    # --- what the resident layout is built from (worker_ext.layout) ------------------------------------------
    def decoder_layers(self) -> list[Any]:
        return decoder_layers(self.s)

    def kv_pool(self) -> Any:
        return kv_pool(self.s)

    def decoder_stack(self) -> Any:
        """The model's decoder stack (``LlamaModel``: embeddings, layers, final norm)."""
        stack = model_runner(self.s).model.model
        require(
            callable(getattr(type(stack), "forward", None)), "the model has no decoder stack (model.model)"
        )
        return stack

    def kv_allocator(self) -> Any:
        return self.s.token_to_kv_pool_allocator

    def parameters(self) -> Iterator[torch.Tensor]:
        return (p.data for p in model_runner(self.s).model.parameters())

    # --- the request queues ---------------------------------------------------------------------------------
    def running(self) -> list[Req]:
        return rq.running_reqs(self.s)

    def waiting(self) -> list[Req]:
        return list(self.s.waiting_queue)

    def live_rids(self) -> set[str]:
        return live_rids(self.s)

    def unfinished_running_rids(self) -> set[str]:
        return unfinished_running_rids(self.s)

    def has_running_dp_work(self) -> bool:
        return has_running_dp_work(self.s)

    def at_clean_step_boundary(self) -> bool:
        return at_clean_step_boundary(self.s)

    def hold_waiting(self) -> list[Req]:
        return hold_waiting(self.s)

    def queue_front(self, reqs: list[Req]) -> None:
        unhold_waiting(self.s, reqs)

    def queue_back(self, reqs: list[Req]) -> None:
        self.s.waiting_queue.extend(reqs)

    def retract_running(self) -> list[Req]:
        return retract_running(self.s)

    def drop_from_batches(self, rids: set[str]) -> list[Req]:
        return rq.drop_from_batches(self.s, rids)

    def merge_decoding(self, reqs: list[Req]) -> None:
        rq.merge_decoding(self.s, reqs)

    # --- DP work and limits across an epoch -----------------------------------------------------------------
    def stash_dp_work(self, held: list[Req] | None = None) -> Stash:
        return stash_dp_work(self.s, held)

    def empty_stash(self) -> Stash:
        return empty_stash()

    def stash_size(self, stash: Stash) -> int:
        running, waiting, _ = stash
        return len(running.reqs) + len(waiting)

    def stashed_rids(self, stash: Stash) -> set[str]:
        running, waiting, _ = stash
        return {r.rid for r in running.reqs} | {r.rid for r in waiting}

    def restore_dp_work(self, stash: Stash) -> None:
        restore_dp_work(self.s, stash)

    def suspend_idle_checks(self) -> None:
        suspend_idle_checks(self.s)

    def resume_idle_checks(self) -> None:
        resume_idle_checks(self.s)

    def idle_poll(self, seconds: float | None) -> None:
        idle_poll(self.s, seconds)

    def request_limits(self) -> RequestLimits:
        return request_limits(self.s)

    def set_request_limits(self, dp: RequestLimits, width: int) -> None:
        set_request_limits(self.s, dp, width)

    # --- the prefix tree ------------------------------------------------------------------------------------
    def bypass_prefix_cache(self, base: Any, width: int, group: GroupTree | None = None) -> None:
        prefix_cache.bypass(self.s, base, width, group)

    def new_group_cache(self) -> GroupTree | None:
        """A prefix tree for the group this engine leads (None: its radix cache is off)."""
        return GroupCache(self.s) if prefix_cache.enabled(self.s) else None

    def group_cache(self) -> GroupTree | None:
        return prefix_cache.group_cache(self.s)

    def restore_prefix_cache(self) -> None:
        prefix_cache.restore(self.s)

    def evictable_physical(self) -> int:
        return prefix_cache.evictable_physical(self.s)

    def evict_physical(self, num_tokens: int) -> None:
        prefix_cache.evict_physical(self.s, num_tokens)

    def make_room(self, num_tokens: int) -> None:
        prefix_cache.make_room(self.s, num_tokens)

    def let_go(self, req: Req) -> None:
        prefix_cache.let_go(self.s, req)

    def shared_len(self, req: Req) -> int:
        return prefix_cache.shared_len(req)

    # --- one request's KV and state -------------------------------------------------------------------------
    def adoptable(self, req: Req) -> bool:
        return rq.adoptable(req)

    def kv_length(self, req: Req) -> int:
        return rq.kv_length(req)

    def kv_need(self, req: Req) -> int:
        return rq.kv_need(req)

    def kv_slots(self, req: Req) -> torch.Tensor:
        return rq.kv_slots(self.s, req)

    def kv_row(self, req: Req) -> int:
        return int(req.kv.req_pool_idx)

    def detach_kv(self, req: Req) -> tuple[int, int]:
        return rq.detach_kv(req)

    def attach_kv(self, req: Req, row: int, length: int) -> None:
        rq.attach_kv(req, row, length)

    def release_kv(self, req: Req) -> None:
        rq.release_kv(self.s, req)

    def retract(self, reqs: list[Req]) -> None:
        rq.retract(self.s, reqs)

    def reset_for_recompute(self, req: Req) -> None:
        rq.reset_for_recompute(req)

    def state_of(self, req: Req) -> ReqState:
        return rq.state_of(req)

    def req_from_state(self, st: ReqState) -> Req:
        return rq.req_from_state(self.s, st)

    def progress(self, req: Req) -> tuple[int, int]:
        return len(req.output_ids), rq.logprob_count(req)

    def emitted_since(self, req: Req, sent: tuple[int, int], ending: bool = False) -> Emitted:
        return rq.emitted_since(req, *sent, ending=ending)

    def apply_emitted(self, req: Req, em: Emitted) -> None:
        rq.apply_emitted(req, em)

    def is_finished(self, req: Req) -> bool:
        return bool(req.finished())

    # --- KV rows and slots ----------------------------------------------------------------------------------
    def alloc_row(self) -> int:
        return memory_pool.alloc_row(self.s)

    def free_row(self, row: int) -> None:
        memory_pool.free_row(self.s, row)

    def write_row(self, row: int, slots: torch.Tensor, start: int = 0) -> None:
        memory_pool.write_row(self.s, row, slots, start=start)

    def alloc_slots(self, n: int) -> torch.Tensor | None:
        got: torch.Tensor | None = self.s.token_to_kv_pool_allocator.alloc(n)
        return got

    def free_slots(self, slots: torch.Tensor) -> None:
        self.s.token_to_kv_pool_allocator.free(slots)

    # --- output and ends ------------------------------------------------------------------------------------
    def stream(self, reqs: list[Req]) -> None:
        rq.stream(self.s, reqs)

    def apply_output_filter(self, divert: Callable[[Req], bool], end: Callable[[Req], bool]) -> None:
        rq.apply_output_filter(self.s, divert, end)

    def remove_output_filter(self) -> None:
        rq.remove_output_filter(self.s)

    def end_group_lost(self, reqs: list[Req]) -> None:
        for req in reqs:
            req.finished_reason = group_lost()
            prefix_cache.let_go(self.s, req)
        rq.stream(self.s, reqs)

    def drop_tp_requests(self) -> list[str]:
        return drop_tp_requests(self.s)

    def abort_batch(self, message: str) -> None:
        abort_batch(self.s, message)

    def chunked_request(self) -> Req | None:
        return chunked_request(self.s)

    def group_lost_reason(self, message: str) -> Any:
        return group_lost(message)

    def abort_chunked(self, message: str) -> None:
        abort_chunked(self.s, message)

    def receive(self) -> Received:
        """A follower, between the leader's messages: its clients' aborts and new requests."""
        return rq.receive_while_following(self.s)

    def abort(self, rid: str) -> None:
        rq.abort(self.s, rid)

    def end_aborted(self, reqs: list[Req]) -> None:
        rq.end_aborted(self.s, reqs)

    # --- the forward ----------------------------------------------------------------------------------------
    def tp_group(self, group: Any) -> AbstractContextManager[None]:
        return tp_group_override(group)

    def batch_fields(self, forward_batch: Any) -> dict[str, Any]:
        return batch_fields(forward_batch)

    def batch_tokens(self, fields: dict[str, Any]) -> list[tuple[str, int, int]]:
        return batch_tokens(fields)

    def batch_rids(self, forward_batch: Any) -> list[str]:
        return list(forward_batch.rids)

    def step_tokens(self, forward_batch: Any) -> int:
        """The forward's batched tokens: a prefill's (extend, mixed included), a decode's sequences."""
        if forward_batch.forward_mode.is_extend() and forward_batch.extend_num_tokens is not None:
            return int(forward_batch.extend_num_tokens)
        return int(forward_batch.batch_size)

    def plan_slots(self, forward_batch: Any) -> tuple[list[int], dict[str, list[int]]] | None:
        g = prefix_cache.group_cache(self.s)
        return g.plan_slots(self.s, forward_batch) if g is not None else None

    def take_repoints(self) -> dict[str, tuple[int, list[int]]]:
        g = prefix_cache.group_cache(self.s)
        return g.take_repoints() if g is not None else {}

    def forward(self, template: Any, fields: dict[str, Any], rows: list[int], slots: torch.Tensor) -> None:
        """A follower's forward of the leader's batch over its own rows and slots (through the forward hook)."""
        from worker_ext.sglang_patches import follower_batch

        fb = follower_batch(template, fields, rows, slots)
        with torch.inference_mode():
            model_runner(self.s).forward(fb)
