"""Run a private ``redis-server`` on a free port, for the demo and the tests: no persistence by default; with
``aof=True`` an append-only file fsynced every second (a restart loses at most the last second)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from flying.procs import free_port, spawn, stop


class RedisServer:
    def __init__(self, port: int | None = None, data_dir: Path | None = None, aof: bool = False) -> None:
        self.port = port or free_port()
        self.aof = aof
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix="flying-redis-"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10) -> RedisServer:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError(
                "redis-server not found; run scripts/setup.sh (it installs Debian's redis-server)"
            )
        cmd = [
            exe,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes" if self.aof else "no",
            "--appendfsync",
            "everysec",
            "--dir",
            str(self.data_dir),
        ]
        self.proc = spawn(cmd, self.data_dir / "redis.log")
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited: {(self.data_dir / 'redis.log').read_text()}"
                    ) from None
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout_s} s")

    def stop(self) -> None:
        stop(self.proc)
