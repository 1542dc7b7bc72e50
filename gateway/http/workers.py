"""Several gateway processes on one port (``flying-gateway --workers N``): one Python thread serves about 2,000
requests/s, so a host with cores to spare runs more of them.

The supervisor (this module, the process started as ``flying-gateway``) serves nothing itself. It starts ``N``
workers, each a whole gateway (its own gateway id, Redis connections and event loop) bound to the same host and port
with ``SO_REUSEPORT``, so the kernel spreads new connections among them. It

- checks first that the port can be bound, and gives up (exit 1) when workers die at start-up again and again
  (``STARTUP_S``, ``GIVE_UP_AFTER``): a port taken or a bad setting is reported, not retried forever;
- restarts a worker that dies later, after a back-off, and logs why;
- forwards SIGTERM / SIGINT (each worker drains, as a single gateway does; a second signal stops them at once)
  and SIGHUP (the API keys are reloaded), then waits for the workers and exits;
- runs the workers in sessions of their own, so a terminal's Ctrl-C reaches them once (through it), and has the
  kernel send them SIGTERM if the supervisor itself is killed (``PR_SET_PDEATHSIG``);
- gives the workers one fresh Prometheus multiprocess directory, so ``/metrics`` on any of them counts all of
  them (``gateway.metrics``), and removes it at exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from types import FrameType

from prometheus_client import multiprocess

from flying.parent_death import dies_with
from gateway.metrics import MULTIPROC_ENV

log = logging.getLogger("flying.gateway.workers")

STARTUP_S = 10.0  # a worker that exits sooner than this after its start failed to start
GIVE_UP_AFTER = 3  # failed starts in a row after which the supervisor stops
BACKOFF_S = 1.0  # a restart waits this long, doubled for each failed start in a row, up to BACKOFF_MAX_S
BACKOFF_MAX_S = 30.0
POLL_S = 0.2
STOP_SLACK_S = 15.0  # beyond the drain grace: uvicorn's graceful shutdown and the gateway's own stop


class PortTaken(RuntimeError):
    """The host and port cannot be bound (another process holds it without ``SO_REUSEPORT``)."""


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEADDR`` and ``SO_REUSEPORT``, not yet listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortTaken(f"cannot bind {host}:{port}: {exc.strerror or exc}") from None
    return sock


@dataclass
class Worker:
    """One worker slot: its current process, when it started and how many starts in a row failed."""

    index: int
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    failed_starts: int = 0
    restart_at: float = 0.0  # when a dead worker is started again


@dataclass
class Supervisor:
    """Starts ``count`` workers running ``command`` (the gateway's own command line, which serves one process's
    worth), keeps them running and stops them on a signal. :meth:`run` returns the exit status."""

    command: list[str]
    count: int
    # a worker's drain grace: how long a stop waits for it before SIGKILL (plus STOP_SLACK_S)
    grace_s: float = 30.0
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    workers: list[Worker] = field(init=False)
    stopping: int = field(init=False, default=0)  # stop signals received

    def __post_init__(self) -> None:
        if self.count < 2:
            raise ValueError("a supervisor runs at least 2 workers")
        self.workers = [Worker(i) for i in range(self.count)]

    def run(self) -> int:
        previous = {
            s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        }
        # a fresh directory: no earlier run's counts
        metrics_dir = self.env[MULTIPROC_ENV] = tempfile.mkdtemp(prefix="flying-gateway-metrics-")
        try:
            for w in self.workers:
                self._start(w)
            pids = [w.proc.pid for w in self.workers if w.proc]
            log.info("gateway: %d workers on one port (pids %s)", self.count, pids)
            return self._watch()
        finally:
            self._stop_all()
            for s, handler in previous.items():
                signal.signal(s, handler)
            shutil.rmtree(metrics_dir, ignore_errors=True)

    def _start(self, w: Worker) -> None:
        w.proc = subprocess.Popen(
            self.command,
            env=self.env,
            start_new_session=True,
            preexec_fn=dies_with(os.getpid()),
            stdin=subprocess.DEVNULL,
        )
        w.started = time.monotonic()

    def _watch(self) -> int:
        while True:
            if self.stopping:
                return 0
            now = time.monotonic()
            for w in self.workers:
                if w.proc is None:
                    if now >= w.restart_at:
                        self._start(w)
                    continue
                code = w.proc.poll()
                if code is None:
                    if w.failed_starts and now - w.started >= STARTUP_S:
                        w.failed_starts = 0  # it started this time
                    continue
                if self.stopping:
                    return 0
                self._mark_dead(w.proc.pid)
                lived = now - w.started
                if lived < STARTUP_S:
                    w.failed_starts += 1
                    if w.failed_starts >= GIVE_UP_AFTER:
                        log.error(
                            "gateway worker %d %s %.1f s after its start, %d times in a row: giving up (its log "
                            "lines above say why)",
                            w.index,
                            how_it_ended(code),
                            lived,
                            w.failed_starts,
                        )
                        return 1
                delay = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** max(0, w.failed_starts - 1))
                log.error(
                    "gateway worker %d (pid %d) %s after %.1f s; restarting it in %.1f s",
                    w.index,
                    w.proc.pid,
                    how_it_ended(code),
                    lived,
                    delay,
                )
                w.proc, w.restart_at = None, now + delay
            time.sleep(POLL_S)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGHUP:
            self._signal_all(sig)
            return
        self.stopping += 1
        self._signal_all(sig)  # the first drains each worker, a second stops them at once

    def _signal_all(self, sig: int) -> None:
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(sig)

    def _stop_all(self) -> None:
        """Waits for every worker; one still running gets SIGTERM (it drains), and SIGKILL after its grace."""
        if not self.stopping:
            self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s + STOP_SLACK_S
        for w in self.workers:
            if w.proc is None:
                continue
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("gateway worker %d (pid %d) did not stop: killed", w.index, w.proc.pid)
                w.proc.kill()
                w.proc.wait()
            self._mark_dead(w.proc.pid)

    def _mark_dead(self, pid: int) -> None:
        """Drops a dead worker's live gauges (``flying_gateway_requests_in_flight``) from the shared metrics."""
        if path := self.env.get(MULTIPROC_ENV):
            multiprocess.mark_process_dead(pid, path)


def how_it_ended(code: int) -> str:
    """A dead process's ``returncode`` in words: its exit status, or the signal that killed it."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def worker_command(argv: list[str]) -> list[str]:
    """The command one worker runs: this gateway's arguments, one process's worth, bound with ``SO_REUSEPORT``."""
    return [sys.executable, "-m", "gateway.main", *argv, "--workers", "1", "--reuse-port"]
