"""Every touch point with SGLang internals (pinned: :data:`SUPPORTED_SGLANG`), behind small ``apply_*`` functions
and the :class:`~worker_ext.sglang_patches.surface.SchedulerSurface` the switching components use.

An SGLang upgrade should be one diff to this package. Each function checks the preconditions it relies on
(:func:`require`), so a changed internal fails loudly at start-up with :class:`SGLangMismatch` instead of
misbehaving at serve time.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from flying.messages import GROUP_LOST, split_engine_rid

if TYPE_CHECKING:
    from worker_ext.heartbeat import Load

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
SUPPORTED_SGLANG = "0.5.23"  # the one place the supported version is written (scripts/setup.sh reads it here)


class SGLangMismatch(RuntimeError):
    """The installed SGLang is not the version this package patches, or an internal it relies on changed."""


def require(condition: object, what: str) -> None:
    """A precondition on SGLang's internals (kept under ``python -O``, unlike an assert)."""
    if not condition:
        raise SGLangMismatch(f"{what} (flying-serving patches sglang {SUPPORTED_SGLANG})")


def check_version(found: str | None = None) -> None:
    """Refuse to patch any SGLang but :data:`SUPPORTED_SGLANG` (``found``: the version to check, else the
    installed one)."""
    if found is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("sglang")
        except PackageNotFoundError:
            found = "(none)"
    if found != SUPPORTED_SGLANG:
        raise SGLangMismatch(
            f"flying-serving's worker patches sglang {SUPPORTED_SGLANG}, but sglang {found} is installed: "
            f"install sglang=={SUPPORTED_SGLANG} (bash scripts/setup.sh does)"
        )


REQUEST_LOGGER = "sglang.srt.utils.request_logger.stdout"  # where --log-requests lines go (no target given)


def apply_request_log_handler(handler: logging.Handler) -> None:
    """SGLang's request lines (``--log-requests``) through ``handler``: its stdout request logger is made here,
    before SGLang's RequestLogger, which gives a handler of its own only to a logger that has none. A line in
    SGLang's JSON request format becomes ``msg`` "<event> <rid>", ``request_id`` and ``sglang`` (the rest); a rid
    the gateway made (``<id>~<attempt>``, flying.messages.engine_rid) gives ``request_id`` the id and ``attempt``."""
    log = logging.getLogger(REQUEST_LOGGER)
    require(not log.handlers, f"{REQUEST_LOGGER} was set up before the plugin")
    log.addHandler(handler)
    log.addFilter(_lift_rid)
    log.setLevel(logging.INFO)
    log.propagate = False


def _lift_rid(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if message.startswith("{"):
        with contextlib.suppress(ValueError):
            data = json.loads(message)
            rid = data.pop("rid", None)
            record.msg, record.args = f"{data.pop('event', 'request')} {rid}", None
            record.request_id, record.sglang = rid, data
            if (request := request_of(rid)) is not None:
                record.request_id, record.attempt = request  # the gateway's request id, and which dispatch
    return True


def request_of(rid: Any) -> tuple[str, int] | None:
    """The gateway's (request id, attempt) that an SGLang rid (``<id>~<attempt>``), or the list of a request's
    ``n`` choices' rids (``<id>~<attempt>_<i>``), belongs to; None for a rid the gateway did not make."""
    found = set()
    for one in rid if isinstance(rid, list) else [rid]:
        if not isinstance(one, str) or (request := split_engine_rid(one))[1] is None:
            return None
        found.add((request[0], request[1]))
    return found.pop() if len(found) == 1 else None


def apply_scheduler_hooks(on_init: Callable[[Any], None], on_step: Callable[[Any], None]) -> None:
    """Call ``on_init(scheduler)`` after ``Scheduler.__init__`` and ``on_step(scheduler)`` at every loop
    iteration (after ``ingest_requests``: a step boundary, reached when busy and, with --sleep-on-idle, idle)."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    require(callable(getattr(Scheduler, "ingest_requests", None)), "Scheduler.ingest_requests missing")

    def after_init(result, scheduler, *args, **kwargs):
        on_init(scheduler)
        return result

    def after_ingest(result, scheduler, *args, **kwargs):
        on_step(scheduler)
        return result

    HookRegistry.register(f"{SCHEDULER}.__init__", after_init, HookType.AFTER)
    HookRegistry.register(f"{SCHEDULER}.ingest_requests", after_ingest, HookType.AFTER)


def apply_abort_hook(on_abort: Callable[[Any, str], None]) -> None:
    """Call ``on_abort(scheduler, rid)`` after SGLang's own handling of a client's abort of ``rid`` (and of every
    rid that begins with it): SGLang looks in its queues and batches only, not in DP work set aside under a bound
    group (:func:`stash_dp_work`), so the binding keeps such aborts for when that work is back."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    require(callable(getattr(Scheduler, "abort_request", None)), "Scheduler.abort_request missing")

    def after_abort(result, scheduler, recv_req, *args, **kwargs):
        if recv_req.rid and not recv_req.abort_all:
            on_abort(scheduler, recv_req.rid)
        return result

    HookRegistry.register(f"{SCHEDULER}.abort_request", after_abort, HookType.AFTER)


def scheduler_tp_rank(scheduler: Any) -> int:
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().tp_rank)


def scheduler_load(scheduler: Any) -> Load:
    """Running and waiting requests and KV capacity, read from the scheduler's own structures; the prefix cache's
    tally (:data:`worker_ext.sglang_patches.prefix_cache.tally`)."""
    from worker_ext.sglang_patches.prefix_cache import tally

    allocator = scheduler.token_to_kv_pool_allocator
    evictable = scheduler.tree_cache.evictable_size() if scheduler.tree_cache is not None else 0
    running_batch = scheduler.running_batch
    return {
        "running": len(running_batch.reqs) if running_batch is not None else 0,
        "waiting": len(scheduler.waiting_queue),
        "free_kv_tokens": int(allocator.available_size() + evictable),
        "max_total_tokens": int(scheduler.max_total_num_tokens),
        "context_len": int(scheduler.model_config.context_len),
        "max_running_requests": int(scheduler.max_running_requests),
        "prompt_tokens": tally.prompt_tokens,
        "cached_tokens": tally.cached_tokens,
    }


# --- DP<->TP switching: the SGLang internals a bind touches -------------------------------------------------


def apply_forward_hook(around: Callable[..., Any]) -> None:
    """``around(original, model_runner, forward_batch, *args, **kwargs)`` wraps every ``ModelRunner.forward``."""
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    require(callable(getattr(ModelRunner, "forward", None)), "ModelRunner.forward missing")
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.forward", around, HookType.AROUND
    )


def register_idle_wake(scheduler: Any, socket: Any) -> None:
    """Make the idle scheduler's zmq poll also wake on ``socket``."""
    import zmq

    sleeper = getattr(scheduler, "idle_sleeper", None)
    if sleeper is not None and hasattr(sleeper, "poller"):
        sleeper.poller.register(socket, zmq.POLLIN)


def idle_poll(scheduler: Any, seconds: float | None) -> None:
    """The idle scheduler (``--sleep-on-idle``) wakes at least every ``seconds`` (None: SGLang's own second). A
    bound group's leader reads what its followers relayed (their clients' new requests and aborts) at its step
    boundaries: asleep for a second, it left a request sent to a follower waiting that long."""
    import zmq

    sleeper = getattr(scheduler, "idle_sleeper", None)
    if sleeper is None or not isinstance(getattr(sleeper, "poller", None), zmq.Poller):
        return
    if seconds is None:
        sleeper.__dict__.pop("maybe_sleep", None)  # the class's own again
        return
    ms = max(1, int(seconds * 1000))
    sleeper.maybe_sleep = lambda: sleeper.poller.poll(ms)


def model_runner(scheduler: Any) -> Any:
    return scheduler.tp_worker.model_runner


def decoder_layers(scheduler: Any) -> list[Any]:
    model = model_runner(scheduler).model
    layers = list(model.model.layers)
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in (
            "qkv_proj",
            "o_proj",
            "attn",
            "num_heads",
            "num_kv_heads",
            "q_size",
            "kv_size",
            "head_dim",
        ):
            require(hasattr(attn, name), f"attention layer lacks {name}")
        require(
            hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj"), "MLP lacks gate_up_proj/down_proj"
        )
    return layers


def kv_pool(scheduler: Any) -> Any:
    pool = model_runner(scheduler).token_to_kv_pool
    require(isinstance(getattr(pool, "k_buffer", None), list), "KV pool without per-layer k_buffer")
    return pool


class _AllReduceVia:
    """What the forward needs of ``get_parallel().tp_group``: its all-reduce. It deliberately has no
    ``world_size``: the engine's configured tp_size stays 1 (ParallelContext validates the two against each other),
    while the row-parallel layers read rank and width from their own ``tp_group`` (set by the binding)."""

    def __init__(self, group: Any) -> None:
        self.all_reduce = group.all_reduce


@contextmanager
def tp_group_override(group: Any):
    """Route SGLang's all-reduce (``get_parallel().tp_group`` / ``get_tp_group()``) to ``group``."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_group=_AllReduceVia(group)):
        yield


def has_running_dp_work(scheduler: Any) -> bool:
    return any(not r.finished() for r in scheduler.running_batch.reqs) or scheduler.chunked_req is not None


def unfinished_running_rids(scheduler: Any) -> set[str]:
    rids = {r.rid for r in scheduler.running_batch.reqs if not r.finished()}
    if scheduler.chunked_req is not None:
        rids.add(scheduler.chunked_req.rid)
    return rids


def retract_running(scheduler: Any) -> list:
    """Free the running requests' KV and reset them for recompute (SGLang's own retraction); return them."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch, retract_all

    reqs = [r for r in scheduler.running_batch.reqs if not r.finished()]
    retract_all(
        reqs=reqs,
        req_to_token_pool=scheduler.req_to_token_pool,
        token_to_kv_pool_allocator=scheduler.token_to_kv_pool_allocator,
        tree_cache=scheduler.tree_cache,
        hisparse_coordinator=None,
        offload_kv=False,
    )
    scheduler.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
    scheduler.last_batch = None
    return reqs


def hold_waiting(scheduler: Any) -> list:
    """Take the waiting queue out (a sequential bind admits no new DP work while the running work drains)."""
    held = list(scheduler.waiting_queue)
    scheduler.waiting_queue[:] = []
    return held


def unhold_waiting(scheduler: Any, held: list) -> None:
    scheduler.waiting_queue[:0] = held


def stash_dp_work(scheduler: Any, held: list | None = None) -> tuple[Any, list, Any]:
    """Set the scheduler's DP work aside with its KV (hard preemption): running batch, waiting queue (after any
    requests ``held`` back earlier)."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    stash = (scheduler.running_batch, list(held or []) + list(scheduler.waiting_queue), scheduler.last_batch)
    scheduler.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
    scheduler.waiting_queue[:] = []
    scheduler.last_batch = None
    return stash


def empty_stash() -> tuple[Any, list, Any]:
    """The stash of an adopting bind: no DP work set aside."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    return ScheduleBatch(reqs=[], batch_is_full=False), [], None


def restore_dp_work(scheduler: Any, stash: tuple[Any, list, Any]) -> None:
    """Paused DP work back (after requests a scatter left running in DP on this engine, if any)."""
    running, waiting, _ = stash
    if not scheduler.running_batch.reqs:
        scheduler.running_batch = running
    elif running.reqs:
        scheduler.running_batch.merge_batch(running)
    scheduler.waiting_queue[:0] = waiting
    scheduler.last_batch = None


def at_clean_step_boundary(scheduler: Any) -> bool:
    """No chunked prefill in flight and no prefill batch still to be merged into the running batch."""
    last = scheduler.last_batch
    return scheduler.chunked_req is None and (last is None or not last.forward_mode.is_extend())


def live_rids(scheduler: Any) -> set[str]:
    return {r.rid for r in scheduler.running_batch.reqs} | {r.rid for r in scheduler.waiting_queue}


# Fields of a ForwardBatch that point into one engine's own pools or objects: never sent in a step plan.
_LOCAL_FIELDS = frozenset(
    {
        "attn_backend",
        "req_to_token_pool",
        "token_to_kv_pool",
        "req_pool_indices",
        "req_pool_indices_cpu",
        "out_cache_loc",
        "origin_out_cache_loc",
        "out_cache_loc_virtual",
        "kv_loc_plan",
        "kv_loc_cols",
        "hisparse_coordinator",
        "spec_info",
        "sampling_info",
        "mm_inputs",
        "residual_stream",
    }
)


def batch_fields(forward_batch: Any) -> dict[str, Any]:
    """The leader's ForwardBatch as it enters the model, minus engine-local fields: what a follower needs to run
    the identical forward. Values that cannot be pickled are left out (the follower keeps its own)."""
    import dataclasses
    import pickle

    out = {}
    for f in dataclasses.fields(forward_batch):
        if f.name in _LOCAL_FIELDS:
            continue
        value = getattr(forward_batch, f.name)
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - an object with engine-local state; keep the follower's own
            continue
        out[f.name] = value
    return out


def batch_tokens(fields: dict[str, Any]) -> list[tuple[str, int, int]]:
    """Per request of a step plan's batch: (request id, sequence length after the step, tokens the step adds)."""
    seq = fields["seq_lens"].tolist()
    new = [1] * len(seq) if fields["forward_mode"].is_decode() else fields["extend_seq_lens"].tolist()
    return list(zip(fields["rids"], seq, new))


def follower_batch(template: Any, fields: dict[str, Any], rows: list[int], out_cache_loc: Any) -> Any:
    """The leader's batch fields over this engine's own request rows and KV slots (other engine-local fields from
    one of this engine's own batches)."""
    import dataclasses

    import torch

    if template is None:
        raise RuntimeError("no ForwardBatch of this engine's own seen yet (warm-up should have run one)")
    idx = torch.tensor(rows, dtype=torch.int64)
    return dataclasses.replace(
        template, **fields, req_pool_indices=idx, req_pool_indices_cpu=idx, out_cache_loc=out_cache_loc
    )


class _LocalReduce:
    """An all-reduce over a group of one: lets a leader whose group broke finish the step it is in."""

    @staticmethod
    def all_reduce(tensor: Any) -> Any:
        return tensor


LOCAL_GROUP = _LocalReduce()


def group_lost(message: str = GROUP_LOST.message) -> Any:
    """The finish reason of a TP request whose group lost a member (:class:`flying.messages.GroupLost`): an abort
    with its status, so a request whose client has nothing yet (non-streaming: SGLang answers that status;
    streaming: its first event is the abort) can be re-dispatched by the gateway."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return FINISH_ABORT(message, status_code=HTTPStatus(GROUP_LOST.status), err_type=GROUP_LOST.err_type)


def abort_batch(scheduler: Any, message: str) -> None:
    """Make every request of the batch being run finish with an abort when its result is processed."""
    batch = getattr(scheduler, "cur_batch_for_debug", None)
    for req in batch.reqs if batch is not None else []:
        req.to_finish = group_lost(message)


def chunked_request(scheduler: Any) -> Any:
    """The request whose prefill is in chunks between two steps (None: none)."""
    return scheduler.chunked_req


def abort_chunked(scheduler: Any, message: str) -> None:
    """End the request in chunked prefill with the group-lost abort (no token of it was streamed: the gateway
    queues it again), through SGLang's own deferred abort of a chunked prefill: at the top of the next step its
    next chunk is not launched, its KV so far is freed and its client gets the abort."""
    require(
        hasattr(scheduler, "_pending_chunked_abort_req"), "the scheduler's deferred chunked-prefill abort"
    )
    req = scheduler.chunked_req
    if req is not None:
        req.discard_output_reason = group_lost(message)
        scheduler._pending_chunked_abort_req = req


def drop_tp_requests(scheduler: Any) -> list[str]:
    """After an aborted epoch: take the leader's TP requests out of its queues (their KV lives in the TP view,
    freed with it) and report them aborted to their clients."""
    reqs = [r for r in list(scheduler.running_batch.reqs) + list(scheduler.waiting_queue) if not r.finished()]
    from worker_ext.sglang_patches.requests import release_kv, stream

    for req in reqs:
        req.finished_reason = group_lost()
        release_kv(scheduler, req)  # its KV back while the TP sub-slot allocator is still in place
    # (the output filter still keeps other members' copies away from this detokenizer)
    stream(scheduler, reqs)
    scheduler.waiting_queue[:] = []
    scheduler.running_batch.reqs = []
    return [r.rid for r in reqs]


class _EpochChecker:
    """The scheduler's invariant checker with the two idle pool checks switched off (see suspend_idle_checks)."""

    def __init__(self, checker: Any) -> None:
        self._checker = checker

    def __getattr__(self, name: str) -> Any:
        return getattr(self._checker, name)

    def _check_all_pools(self, *args: Any, **kwargs: Any) -> tuple[bool, list]:
        return False, []

    def _check_req_pool(self, *args: Any, **kwargs: Any) -> None:
        return None


def suspend_idle_checks(scheduler: Any) -> None:
    """The idle-time pool invariants (available == total, no rows held) do not hold during a TP epoch: paused DP
    requests keep their KV and rows, and TP capacity is counted in sub-slots. Checked again after release."""
    if not isinstance(scheduler.invariant_checker, _EpochChecker):
        scheduler.invariant_checker = _EpochChecker(scheduler.invariant_checker)


def resume_idle_checks(scheduler: Any) -> None:
    if isinstance(scheduler.invariant_checker, _EpochChecker):
        scheduler.invariant_checker = scheduler.invariant_checker._checker


@dataclass(frozen=True)
class RequestLimits:
    """What the scheduler admits: the longest request and prompt, and the KV tokens it budgets. A bound engine's
    scheduler holds its group's (``width`` times the KV); its heartbeat reports its own DP limits."""

    max_req_len: int
    max_req_input_len: int
    max_total_tokens: int


def request_limits(scheduler: Any) -> RequestLimits:
    return RequestLimits(
        int(scheduler.max_req_len), int(scheduler.max_req_input_len), int(scheduler.max_total_num_tokens)
    )


def set_request_limits(scheduler: Any, dp: RequestLimits, width: int) -> None:
    """The limits of a group of ``width`` computed from the engine's DP limits (so width changes never compound):
    it pools ``width`` times the KV tokens, so the leader admits prompts that long (up to the model's context
    length). Width 1 restores the DP limits."""
    kv_capacity = dp.max_total_tokens * width
    context = int(scheduler.model_config.context_len)
    max_req_len = dp.max_req_len if width == 1 else min(context - 1, kv_capacity - 1)
    scheduler.max_total_num_tokens = kv_capacity  # the admission budget: KV tokens at this width
    if (observer := getattr(scheduler, "pool_stats_observer", None)) is not None:
        # SGLang's pool statistics (--enable-metrics, load reports) divide by their own copy of the capacity,
        # taken at start; with the group's pooled KV free they would read a negative usage, which SGLang asserts
        # against (the scheduler dies). The observer is frozen and shared by reference (the load inquirer and
        # the invariant checker hold it too), so its one field is set in place.
        widening = int(getattr(scheduler, "kv_shard_widening", 1))
        object.__setattr__(observer, "max_total_num_tokens", kv_capacity * widening)
    scheduler.max_req_len = max_req_len
    scheduler.max_req_input_len = max_req_len - (dp.max_req_len - dp.max_req_input_len)
