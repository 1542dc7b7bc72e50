"""``kill -USR1 <pid>`` on the router or a gateway logs every asyncio task with the line it waits on: the way to
see where a live process is stuck (py-spy shows only the event loop's thread)."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading

log = logging.getLogger("flying.tasks")


def task_stacks() -> str:
    lines = []
    for task in asyncio.all_tasks():
        frames: list[str] = []
        coro: object = task.get_coro()
        while coro is not None:  # follow the await chain to the innermost coroutine
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
            if frame is not None:
                frames.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
            if not hasattr(coro, "cr_frame") and not hasattr(coro, "ag_frame"):
                if coro is not None:
                    frames.append(repr(coro)[:160])
                break
        lines.append(f"task {task.get_name()}:\n    " + "\n    ".join(frames or ["(no frames)"]))
    return f"{len(lines)} tasks\n" + "\n".join(lines)


def install(loop: asyncio.AbstractEventLoop) -> None:
    """On the main thread only (an app served from a test's thread has no signals)."""
    if threading.current_thread() is threading.main_thread():
        loop.add_signal_handler(signal.SIGUSR1, lambda: log.warning("asyncio tasks: %s", task_stacks()))
