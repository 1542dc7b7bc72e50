"""The supervisor of several gateway processes (gateway.http.workers), with small stand-in commands for the workers; the
real gateway behind ``--workers`` is tested end to end in tests/e2e/test_gateway_workers.py."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

import pytest

from flying.procs import free_port
from gateway import main as gateway_main
from gateway.http import workers
from gateway.http.workers import PortTaken, Supervisor, reuse_port_socket


def test_a_port_held_without_reuse_port_is_refused_before_any_worker_starts(capsys):
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        with pytest.raises(PortTaken, match=f"127.0.0.1:{port}"):
            reuse_port_socket("127.0.0.1", port)
        started = time.monotonic()
        with pytest.raises(SystemExit, match="cannot bind"):
            gateway_main.main(["--model-path", "unused", "--port", str(port), "--workers", "2"])
        assert time.monotonic() - started < 5


def test_reuse_port_sockets_share_a_port():
    port = free_port()
    a, b = reuse_port_socket("127.0.0.1", port), reuse_port_socket("127.0.0.1", port)
    try:
        a.listen()
        b.listen()
        assert a.getsockname() == b.getsockname() == ("127.0.0.1", port)
    finally:
        a.close()
        b.close()


def test_workers_must_be_at_least_one():
    with pytest.raises(SystemExit):
        gateway_main.parse_args(["--model-path", "m", "--workers", "0"])
    with pytest.raises(ValueError):
        Supervisor(["true"], 1)


def test_workers_that_die_at_start_again_and_again_stop_the_supervisor(monkeypatch, caplog):
    monkeypatch.setattr(workers, "BACKOFF_S", 0.05)
    sup = Supervisor([sys.executable, "-c", "import sys; sys.exit(3)"], 2)
    started = time.monotonic()
    assert sup.run() == 1
    assert time.monotonic() - started < 10
    assert "exited with status 3" in caplog.text and "giving up" in caplog.text


def test_a_worker_that_dies_later_is_restarted_and_a_stop_signal_reaches_every_worker(
    monkeypatch, tmp_path, caplog
):
    monkeypatch.setattr(workers, "STARTUP_S", 0.3)
    monkeypatch.setattr(workers, "BACKOFF_S", 0.05)
    # the first worker to start dies after 0.5 s (a later death, not a failed start); every other one says it is
    # up and records the SIGTERM it gets
    script = f"""
import os, signal, sys, time
d, pid = {str(tmp_path)!r}, os.getpid()
try:
    os.close(os.open(os.path.join(d, "died"), os.O_CREAT | os.O_EXCL))
    time.sleep(0.5)
    sys.exit(7)
except FileExistsError:
    pass
signal.signal(signal.SIGTERM, lambda *_: (open(os.path.join(d, f"term-{{pid}}"), "w").close(), sys.exit(0)))
open(os.path.join(d, f"up-{{pid}}"), "w").close()
while True:
    time.sleep(0.05)
"""

    def stop_once_restarted() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(list(tmp_path.glob("up-*"))) < 2:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # what a user sends the supervisor

    threading.Thread(target=stop_once_restarted, daemon=True).start()
    sup = Supervisor([sys.executable, "-c", script], 2, grace_s=2)
    assert sup.run() == 0
    up = {p.name.split("-")[1] for p in tmp_path.glob("up-*")}
    terminated = {p.name.split("-")[1] for p in tmp_path.glob("term-*")}
    assert (tmp_path / "died").exists() and len(up) == 2
    assert terminated == up  # the original survivor and the restarted worker each got the SIGTERM
    assert "exited with status 7" in caplog.text and "restarting it" in caplog.text
    assert all(w.proc is not None and w.proc.poll() is not None for w in sup.workers)
