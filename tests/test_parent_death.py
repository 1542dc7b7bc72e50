"""dies_with: a child started with it is ended when its parent is killed with SIGKILL (what leaves a worker's
SGLang server behind otherwise)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from flying.parent_death import dies_with

PARENT = """
import subprocess, sys, os, time
sys.path.insert(0, {root!r})
from flying.parent_death import dies_with
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn={preexec})
print(child.pid, flush=True)
time.sleep(60)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (not yet reaped by init) is gone for our purpose
        return f.read().split()[2] != "Z"


def child_of_killed_parent(preexec: str) -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT.format(root=root, preexec=preexec)], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    return child


@pytest.mark.skipif(dies_with(os.getpid()) is None, reason="needs Linux's prctl")
def test_a_child_dies_with_its_parent_killed_by_sigkill():
    child = child_of_killed_parent("dies_with(os.getpid())")
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def test_without_it_the_child_outlives_its_parent():
    child = child_of_killed_parent("None")
    try:
        time.sleep(0.3)
        assert alive(child)
    finally:
        os.kill(child, signal.SIGKILL)
