"""``flying-gateway --workers 2`` over real Redis, a router and a fake engine: the workers share the port, a scrape
of /metrics on either counts both, a worker killed with kill -9 is restarted while the other serves, and a signal
to the supervisor stops every worker (SIGTERM by draining them, SIGKILL through the kernel's parent-death signal)."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.deployment import Deployment

pytestmark = pytest.mark.e2e

CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def worker_pids(supervisor_pid: int) -> set[int]:
    children = Path(f"/proc/{supervisor_pid}/task/{supervisor_pid}/children").read_text().split()
    return {int(p) for p in children}


def gateway_ids(url: str, want: int, timeout_s: float = 60) -> set[str]:
    """The gateway ids /health reports over fresh connections, once ``want`` of them have answered."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(seen) < want and time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/health", timeout=2)  # a connection of its own: the kernel picks the worker
            if r.status_code == 200:
                seen.add(r.json()["gateway_id"])
        except httpx.HTTPError:
            time.sleep(0.1)
    return seen


def chat_200s(url: str, n: int) -> int:
    return sum(
        httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200 for _ in range(n)
    )


def answered(url: str) -> float:
    """flying_gateway_requests_total for chat answered 200, as one scrape (one worker) reports it."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("flying_gateway_requests_total{") and 'route="/v1/chat/completions"' in line
        and 'status="200"' in line
    )  # fmt: skip


def gone(pids: set[int], timeout_s: float, reaped: bool = False) -> bool:
    """Whether every one of ``pids`` has exited within ``timeout_s``: a zombie counts, unless ``reaped``. (A
    killed process's main thread is a zombie while its other threads may still hold its sockets: only once it is
    reaped are they surely closed.)"""

    def alive(p: int) -> bool:
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except FileNotFoundError:
            return False
        return reaped or "zombie" not in status

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_two_workers_share_the_port_count_together_and_outlive_a_killed_worker(
    redis_server, keys, tiny_model, tmp_path
):
    with Deployment(redis_server.url, keys, tiny_model, tmp_path) as d:
        d.start_engine(ttft_ms=2, itl_ms=1)
        d.start_router()
        [url] = d.start_gateways(1, "--workers", "2", "--drain-grace-s", "5")
        supervisor = d.gateways[0][0]
        first = gateway_ids(url, 2)
        assert len(first) == 2, f"both workers answer on the one port: {first}"
        workers = worker_pids(supervisor.pid)
        assert len(workers) == 2

        assert chat_200s(url, 30) == 30
        # a request is counted just after its answer leaves: a scrape that reaches the other worker at once may
        # come first
        deadline = time.monotonic() + 5
        while answered(url) != 30.0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {answered(url) for _ in range(8)} == {30.0}, "every scrape, whichever worker, counts both"

        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        # connections the kernel had queued on the victim's socket die with it (SO_REUSEPORT); those after it is
        # reaped (by the supervisor, within its 0.2-s poll) go to the survivor
        assert gone({victim}, 5, reaped=True)
        assert chat_200s(url, 10) == 10
        after = gateway_ids(url, 2)  # the survivor and the restarted worker, with a new id
        assert len(after) == 2 and len(after - first) == 1, (first, after)
        assert victim not in worker_pids(supervisor.pid) and len(worker_pids(supervisor.pid)) == 2
        log = (tmp_path / "gateway0.log").read_text()
        assert f"(pid {victim}) was killed by SIGKILL" in log and "restarting it" in log
        assert answered(url) >= 30  # the dead worker's counts stay in the sum

        workers = worker_pids(supervisor.pid)
        os.killpg(supervisor.pid, signal.SIGTERM)
        assert supervisor.wait(30) == 0
        assert gone(workers, 5)
        with socket.socket() as s:  # the port is free again
            s.bind(("127.0.0.1", int(url.rsplit(":", 1)[1])))


def test_workers_stop_when_their_supervisor_is_killed(redis_server, keys, tiny_model, tmp_path):
    with Deployment(redis_server.url, keys, tiny_model, tmp_path) as d:
        d.start_engine(ttft_ms=2, itl_ms=1)
        d.start_router()
        [url] = d.start_gateways(1, "--workers", "2", "--drain-grace-s", "1")
        supervisor = d.gateways[0][0]
        assert len(gateway_ids(url, 2)) == 2
        workers = worker_pids(supervisor.pid)
        os.killpg(supervisor.pid, signal.SIGKILL)  # the workers are in sessions of their own: not hit by this
        supervisor.wait(5)
        assert gone(workers, 20), "the kernel's parent-death signal drained and stopped them"
