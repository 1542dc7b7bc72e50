"""Run a private ``redis-server`` on a free port, for the demo and the tests: no persistence by default; with
``aof=True`` an append-only file fsynced every second (a restart loses at most the last second). ``SentinelSet``
runs a primary, a replica and three Sentinels (``redis-server --sentinel``) on loopback ports, with a failover in
about a second and a half once the primary is gone."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from flying.procs import free_port, spawn, stop


def _redis_server() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server not found; run scripts/setup.sh (it installs Debian's redis-server)")
    return exe


class RedisServer:
    """One redis-server; ``replica_of`` (a port on 127.0.0.1) makes it that server's replica."""

    def __init__(
        self,
        port: int | None = None,
        data_dir: Path | None = None,
        aof: bool = False,
        replica_of: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.aof = aof
        self.replica_of = replica_of
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix="flying-redis-"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10) -> RedisServer:
        cmd = [
            _redis_server(),
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
        if self.replica_of is not None:
            cmd += ["--replicaof", "127.0.0.1", str(self.replica_of)]
        self.proc = spawn(cmd, self.data_dir / "redis.log")
        _wait_ping(self.proc, self.port, self.data_dir / "redis.log", timeout_s)
        return self

    def stop(self) -> None:
        stop(self.proc)

    def kill(self) -> None:
        """SIGKILL: the host lost, nothing flushed."""
        stop(self.proc, signal.SIGKILL)


class SentinelSet:
    """A primary, one replica and three Sentinels (quorum 2) on loopback ports, for the demo and the tests.
    ``down_after_ms`` is how long the primary may not answer before a Sentinel calls it down; the failover
    (agreement, election, promotion) follows within about a second."""

    MASTER = "mymaster"

    def __init__(
        self, data_dir: Path | None = None, down_after_ms: int = 500, failover_timeout_ms: int = 2000
    ):
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix="flying-sentinel-"))
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        self.primary = RedisServer(data_dir=self.data_dir / "primary")
        self.replica = RedisServer(data_dir=self.data_dir / "replica", replica_of=self.primary.port)
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.MASTER}/0"

    @property
    def sentinel_hosts(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)

    def start(self, timeout_s: float = 20) -> SentinelSet:
        self.primary.data_dir.mkdir(parents=True, exist_ok=True)
        self.replica.data_dir.mkdir(parents=True, exist_ok=True)
        self.primary.start()
        self.replica.start()
        for i, port in enumerate(self.sentinel_ports):
            d = self.data_dir / f"sentinel{i}"
            d.mkdir(parents=True, exist_ok=True)
            conf = d / "sentinel.conf"  # the Sentinel rewrites it: one file each
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {d}\n"
                f"sentinel monitor {self.MASTER} 127.0.0.1 {self.primary.port} 2\n"
                f"sentinel down-after-milliseconds {self.MASTER} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.MASTER} {self.failover_timeout_ms}\n"
                f"sentinel parallel-syncs {self.MASTER} 1\n"
            )
            self.sentinels.append(spawn([_redis_server(), str(conf), "--sentinel"], d / "sentinel.log"))
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        """Until every Sentinel knows the primary, its replica and the two other Sentinels (and the replica is in
        sync): only then can they fail over."""
        deadline = time.monotonic() + timeout_s
        for i, (proc, port) in enumerate(zip(self.sentinels, self.sentinel_ports)):
            _wait_ping(proc, port, self.data_dir / f"sentinel{i}" / "sentinel.log", timeout_s)
            client = redis.Redis(port=port, socket_timeout=1)
            while not self._knows_all(client):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"sentinel on port {port} did not see the whole set within {timeout_s} s"
                    )
                time.sleep(0.1)
            client.close()

    def _knows_all(self, client: redis.Redis) -> bool:
        master: Any = client.sentinel_master(self.MASTER)
        replicas: Any = client.sentinel_slaves(self.MASTER)
        in_sync = any(r.get("master-link-status") == "ok" for r in replicas)
        return bool(master.get("num-other-sentinels") == 2 and in_sync)

    def primary_port(self) -> int:
        """The port of the server the Sentinels name primary now."""
        for port in self.sentinel_ports:
            try:
                addr: Any = redis.Redis(port=port, socket_timeout=1).sentinel_get_master_addr_by_name(
                    self.MASTER
                )
                _, p = addr
                return int(p)
            except (redis.ConnectionError, redis.TimeoutError, TypeError):
                continue
        raise RuntimeError("no sentinel answers")

    def stop(self) -> None:
        for proc in self.sentinels:
            stop(proc)
        self.replica.stop()
        self.primary.stop()


def _wait_ping(proc: subprocess.Popen, port: int, log_path: Path, timeout_s: float) -> None:
    client = redis.Redis(port=port, socket_timeout=1)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited: {log_path.read_text()}") from None
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {port} did not answer within {timeout_s} s")
    finally:
        client.close()
