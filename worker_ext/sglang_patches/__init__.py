"""Every touch point with SGLang internals (pinned: sglang 0.5.23), behind small ``apply_*`` functions.

An SGLang upgrade should be one diff to this package. Each function asserts the preconditions it relies on, so a
changed internal fails loudly at start-up instead of misbehaving at serve time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
SUPPORTED_SGLANG = "0.5.23"


def check_version() -> None:
    import sglang

    assert sglang.__version__ == SUPPORTED_SGLANG, (
        f"worker_ext.sglang_patches targets sglang {SUPPORTED_SGLANG}, found {sglang.__version__}"
    )


def apply_scheduler_hooks(on_init: Callable[[Any], None], on_step: Callable[[Any], None]) -> None:
    """Call ``on_init(scheduler)`` after ``Scheduler.__init__`` and ``on_step(scheduler)`` at every loop
    iteration (after ``ingest_requests``: a step boundary, reached when busy and, with --sleep-on-idle, idle)."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    assert callable(getattr(Scheduler, "ingest_requests", None)), "Scheduler.ingest_requests missing"

    def after_init(result, scheduler, *args, **kwargs):
        on_init(scheduler)
        return result

    def after_ingest(result, scheduler, *args, **kwargs):
        on_step(scheduler)
        return result

    HookRegistry.register(f"{SCHEDULER}.__init__", after_init, HookType.AFTER)
    HookRegistry.register(f"{SCHEDULER}.ingest_requests", after_ingest, HookType.AFTER)


def scheduler_tp_rank(scheduler: Any) -> int:
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().tp_rank)


def scheduler_load(scheduler: Any) -> dict[str, int]:
    """Running and waiting requests and KV capacity, read from the scheduler's own structures."""
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
    }
