"""Small process helpers: free ports, starting a command in its own process group, stopping it for sure."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx

from flying.parent_death import dies_with


class NotReady(RuntimeError):
    """A process exited, or its HTTP endpoint did not answer in time."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below the kernel's ephemeral range: a port the kernel hands out (bind to
    port 0) can be taken, in the seconds before its server binds it (an SGLang worker binds after its imports),
    as the source port of any outgoing connection, which a worker then fails to bind ("address already in use").
    Successive calls in one process return distinct ports."""
    global _offset
    base = _ephemeral_low() - PORT_SPAN
    if base < 1024:  # an unusual ephemeral range: leave the choice to the kernel
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    if _offset is None:
        _offset = random.randrange(PORT_SPAN)
    for _ in range(PORT_SPAN):
        port, _offset = base + _offset, (_offset + 1) % PORT_SPAN
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken
                continue
            return port
    raise RuntimeError(f"no free port in {base}..{base + PORT_SPAN - 1}")


PORT_SPAN = 8192  # free_port's ports: the 8192 below the ephemeral range (24576-32767 with Linux's default)
_offset: int | None = None  # the next port free_port tries, from the span's start


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a process group of its own, its output appended to ``log_path``. Started from the main
    thread, it gets SIGTERM if this process dies without stopping it (kill -9 of a demo or a test run): no
    orphaned workers hold the ports and the cores. (Linux ties that signal to the thread that started the child,
    so a child started from another thread, which may end first, does not get it.)"""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    main = threading.current_thread() is threading.main_thread()
    with open(log_path, "ab") as log:
        return subprocess.Popen[bytes](
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            preexec_fn=dies_with(os.getpid()) if main else None,
        )


def stop(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM, timeout_s: float = 15) -> None:
    """Signal the process group, wait, escalate to SIGKILL."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def stop_all(procs: list[subprocess.Popen[bytes] | None], timeout_s: float = 15) -> None:
    """SIGTERM every process group at once, then wait for (and if needed kill) each."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        stop(proc, timeout_s=timeout_s)


# SGLang's /health generates one token and answers a second after it asked (it sleeps 1 s, then looks): a try must
# wait longer than that (with a 1-s timeout the answer raced the client's timer, and a worker could stay "not ready"
# for minutes while its server was up)
HEALTH_TRY_S = 5.0


def wait_healthy(
    proc: subprocess.Popen[bytes] | None, url: str, timeout_s: float, path: str = "/health"
) -> None:
    """Poll ``url + path`` until it answers 200; raise NotReady if ``proc`` exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise NotReady(f"process exited with code {proc.returncode} before {url} was ready")
        try:
            try_s = min(HEALTH_TRY_S, max(deadline - time.monotonic(), 0.1))
            if httpx.get(url + path, timeout=try_s).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise NotReady(f"{url} not ready after {timeout_s:.0f} s")


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def port_taken(host: str, port: int, wait_s: float = 0.0) -> str:
    """Why the HTTP server could not listen on ``host:port`` ('' if it can), after waiting up to ``wait_s`` for
    it to be free (a previous server on it may still be exiting)."""
    deadline = time.monotonic() + wait_s
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as exc:
        return f"cannot resolve {host}: {exc}"
    while True:
        with socket.socket(family) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is free
            try:
                s.bind(address)
                return ""
            except OSError as exc:
                why = exc.strerror or repr(exc)
        if time.monotonic() >= deadline:
            return why
        time.sleep(0.25)
