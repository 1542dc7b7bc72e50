"""A cancel that must not be lost. On Python 3.11, a task cancelled while redis-py times out a socket read can see
the cancel come back as a ``redis`` TimeoutError or ConnectionError (``asyncio.timeout`` takes the cancel for its
own); a loop that rides out Redis errors would then go on forever, its task stuck "cancelling", and whoever awaits
it (a gateway's or router's shutdown) would hang. Loops call :func:`reraise_if_cancelled` in their error handler."""

from __future__ import annotations

import asyncio


def reraise_if_cancelled() -> None:
    """Raise CancelledError if the current task has been asked to cancel."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def stop_task(task: asyncio.Task[object] | None, timeout_s: float = 2.0) -> bool:
    """Cancel ``task`` and wait for it at most ``timeout_s``; True if it ended. A shutdown must not hang on a loop
    whose cancel was lost (see the module docstring): such a loop also checks its owner's stopping flag."""
    if task is None or task.done():
        return True
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    return bool(done)
