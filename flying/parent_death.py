"""A child process that dies with its parent: Linux's ``PR_SET_PDEATHSIG``, set between fork and exec, has the
kernel send the child a signal when the parent dies, even by ``kill -9`` (which runs none of the parent's own
cleanup). A gateway supervisor's workers get SIGTERM (they drain and exit); a ``flying-worker``'s SGLang server gets
SIGKILL, since SGLang takes SIGTERM as "finish the requests in flight" and would keep its port, its memory and its
streams for as long as they take (its scheduler and detokenizer die with it: SGLang sets SIGKILL on them too). So
killing the parent never leaves a child holding its port."""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

_prctl: Callable[..., int] | None
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # Linux
except (OSError, AttributeError):
    _prctl = None
PR_SET_PDEATHSIG = 1


def dies_with(parent: int, sig: signal.Signals = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: ``sig`` to the child when ``parent`` dies (at once if it already
    has). None where the platform has no ``prctl``."""

    prctl = _prctl
    if prctl is None:
        return None

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:  # the parent died before the call above
            os._exit(1)

    return preexec
