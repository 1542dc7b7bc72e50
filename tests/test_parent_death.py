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
import subprocess, sys, os, signal, time
sys.path.insert(0, {root!r})
from flying.parent_death import dies_with
child = subprocess.Popen([sys.executable, "-c", {child!r}], preexec_fn={preexec})
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


SLEEPER = "import time; time.sleep(60)"
DRAINER = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"


def child_of_killed_parent(preexec: str, child: str = SLEEPER) -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT.format(root=root, preexec=preexec, child=child)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    if child == DRAINER:
        time.sleep(0.5)  # (its SIGTERM handler set before the parent dies)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    return pid


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


@pytest.mark.skipif(dies_with(os.getpid()) is None, reason="needs Linux's prctl")
def test_a_child_that_drains_on_sigterm_is_killed_when_asked_for_sigkill():
    """SGLang's server finishes its requests on SIGTERM: a launcher's death sends it SIGKILL instead."""
    survivor = child_of_killed_parent("dies_with(os.getpid())", DRAINER)
    try:
        time.sleep(0.5)
        assert alive(survivor), "SIGTERM should leave a draining child alive (else this test proves nothing)"
    finally:
        os.kill(survivor, signal.SIGKILL)
    child = child_of_killed_parent("dies_with(os.getpid(), signal.SIGKILL)", DRAINER)
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)
