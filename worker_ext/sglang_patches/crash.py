"""The scheduler's crash as SGLang raises it: an exception in its event loop goes up through
``Scheduler.run_event_loop`` to ``run_scheduler_process``, which logs it and kills the server. The hooks here call
back before that, with the batches the loop was running when it raised (``flying.crashes`` says why)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from worker_ext.sglang_patches import SCHEDULER, require

log = logging.getLogger(__name__)
NOTE = "_flying_crash"  # the scheduler's attribute: (the exception, the batch whose call raised it)
OnCrash = Callable[[Any, BaseException, list[Any]], None]
BeforeBatch = Callable[[Any, Any], None]


def apply_crash_hook(on_crash: OnCrash, before_batch: BeforeBatch | None = None) -> None:
    """Call ``on_crash(scheduler, exc, batches)`` when the scheduler's event loop raises ``exc``, before SGLang's
    handler takes the server down; ``batches``: those it was running (:func:`crashed_batches`).
    ``before_batch(scheduler, batch)``: called before each batch runs (the tests' crash hook)."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for name in ("run_event_loop", "run_batch", "process_batch_result"):
        require(callable(getattr(Scheduler, name, None)), f"Scheduler.{name} missing")
    HookRegistry.register(f"{SCHEDULER}.run_batch", noting(before_batch), HookType.AROUND)
    HookRegistry.register(f"{SCHEDULER}.process_batch_result", noting(None), HookType.AROUND)
    HookRegistry.register(f"{SCHEDULER}.run_event_loop", crashing(on_crash), HookType.AROUND)


def noting(before: BeforeBatch | None) -> Callable[..., Any]:
    """An around-hook for a call that takes the batch first (``run_batch``, ``process_batch_result``): an
    exception leaving it notes that batch on the scheduler, for :func:`crashed_batches`."""

    def around(original, scheduler, batch, *args, **kwargs):
        try:
            if before is not None:
                before(scheduler, batch)
            return original(scheduler, batch, *args, **kwargs)
        except BaseException as exc:
            if getattr(scheduler, NOTE, (None,))[0] is not exc:
                setattr(scheduler, NOTE, (exc, batch))
            raise

    return around


def crashing(on_crash: OnCrash) -> Callable[..., Any]:
    """An around-hook for ``run_event_loop``: an exception leaving it goes to ``on_crash`` first, then on to
    SGLang's handler unchanged (a failing ``on_crash`` is logged)."""

    def around(original, scheduler, *args, **kwargs):
        try:
            return original(scheduler, *args, **kwargs)
        except Exception as exc:
            try:
                on_crash(scheduler, exc, crashed_batches(scheduler, exc))
            except Exception:
                log.exception("the scheduler's crash could not be reported")
            raise

    return around


def crashed_batches(scheduler: Any, exc: BaseException) -> list[Any]:
    """The batches the scheduler was running when it raised ``exc``: the one whose run, or whose output's
    processing, raised it, and, under overlap scheduling, those launched whose output is not processed yet (a
    device error surfaces later than the forward that made it); none when it raised elsewhere in its loop."""
    note = getattr(scheduler, NOTE, None)
    if note is None or not _caused(exc, note[0]):
        return []
    batches = [note[1]]
    for batch, _ in getattr(scheduler, "result_queue", None) or ():
        if all(batch is not b for b in batches):
            batches.append(batch)
    return [b for b in batches if b is not None]


def _caused(exc: BaseException | None, noted: BaseException) -> bool:
    """``noted`` is ``exc`` or in the chain it was raised from."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if exc is noted:
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def batch_rids(batches: list[Any]) -> list[str]:
    """The rids of the batches' requests, in order, once each."""
    return list(dict.fromkeys(r.rid for b in batches for r in b.reqs))


def held_rids(scheduler: Any, batches: list[Any]) -> list[str]:
    """Every rid the scheduler holds: the batches', the running batch's, the last batch's, the chunked prefill's and
    the waiting queue's (DP work a bound group set aside is out of its sight, and out of the report)."""
    running, last = getattr(scheduler, "running_batch", None), getattr(scheduler, "last_batch", None)
    reqs = [r for b in (*batches, running, last) if b is not None for r in b.reqs]
    if (chunked := getattr(scheduler, "chunked_req", None)) is not None:
        reqs.append(chunked)
    reqs.extend(getattr(scheduler, "waiting_queue", None) or ())
    return list(dict.fromkeys(r.rid for r in reqs))


def stop_strings_in(batch: Any, marker: str) -> bool:
    """Whether a request of ``batch`` has ``marker`` among its stop strings (the test hook of
    ``FLYING_TEST_CRASH_STOP``)."""
    return any(marker in (r.sampling_params.stop_strs or ()) for r in batch.reqs)
