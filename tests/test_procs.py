"""Process helpers: free ports outside the kernel's ephemeral range; spawned processes that die with their
parent."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from flying import procs
from flying.parent_death import dies_with
from tests.stack import ServerThread


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low = procs._ephemeral_low()
    ports = [procs.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(low - procs.PORT_SPAN <= p < low for p in ports)
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_skipped():
    taken = procs.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", taken))
        s.listen()
        procs._offset = taken - (procs._ephemeral_low() - procs.PORT_SPAN)  # try the taken port next
        got = procs.free_port()
        assert got != taken and procs._ephemeral_low() - procs.PORT_SPAN <= got < procs._ephemeral_low()


SPAWNER = """
import sys, threading, time
from pathlib import Path
sys.path.insert(0, {root!r})
from flying.procs import spawn
cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
main = spawn(cmd, Path({log!r}))
box = []
t = threading.Thread(target=lambda: box.append(spawn(cmd, Path({log!r}))))
t.start(); t.join()
print(main.pid, box[0].pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie (not yet reaped by init) is gone for our purpose
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(dies_with(os.getpid()) is None, reason="needs Linux's prctl")
def test_spawned_from_the_main_thread_it_dies_with_its_parent_killed_by_sigkill(tmp_path):
    """kill -9 of a demo or a test run ends the processes it started from its main thread; one started from a
    thread that has ended is left alone (Linux would have signalled it when that thread ended)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = SPAWNER.format(root=root, log=str(tmp_path / "child.log"))
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    main_child, thread_child = map(int, parent.stdout.readline().split())
    try:
        assert _alive(thread_child)  # its thread ended: not signalled
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while _alive(main_child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(main_child)
        assert _alive(thread_child)
    finally:
        for pid in (main_child, thread_child):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_health_endpoint_that_answers_after_a_second_is_seen_ready():
    """SGLang's /health answers a second after it is asked (it generates a token, sleeps 1 s, then looks); a
    readiness poll that gave each try one second raced that answer and could miss it for minutes."""

    async def slow_health(request):
        await asyncio.sleep(1)
        return Response(status_code=200)

    app = Starlette(routes=[Route("/health", slow_health), Route("/up", lambda r: Response(status_code=200))])
    with ServerThread(app, health_path="/up") as server:
        t0 = time.monotonic()
        procs.wait_healthy(None, server.url, 10)
        assert time.monotonic() - t0 < 3
