"""Start and stop a whole local deployment: Redis, N workers, the router and the gateway.

With ``nodes`` > 1 the engines are split into that many "nodes" on this machine (each announces its node, each
node's engines build their own communicator pool on their own rendezvous port), and with ``gateways`` > 1 more
gateway processes on their own ports share the one Redis: a many-node stack in miniature.

Used by the demo (``flying-demo``) and by the end-to-end tests. Every process gets its own process group and log
file under ``log_dir``; ``stop()`` tears all of them down.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from devstack.redis_server import RedisServer
from flying import redis_conn
from flying.keys import Keys
from flying.messages import Heartbeat
from flying.procs import NotReady, free_port, spawn, stop, stop_all, tail, wait_healthy
from flying.workers import live_heartbeat
from router.policy import DispatchRule, PolicyConfig


@dataclass(frozen=True)
class ClusterConfig:
    model_path: Path
    num_engines: int = 2  # in all: nodes x engines per node
    nodes: int = 1  # "nodes" on this machine: bind domains, each with its own communicator pool
    gateways: int = 1  # gateway processes over the one Redis (the first on gateway_port)
    log_dir: Path = Path(".flying/logs")
    redis_url: str | None = None  # None: start a private redis-server
    key_prefix: str = "flying"
    served_model_name: str = "tiny-llama"
    max_total_tokens: int = 16384
    gateway_port: int = field(default_factory=free_port)
    worker_ports: tuple[int, ...] = ()
    router_args: tuple[str, ...] = ()
    worker_args: tuple[
        str, ...
    ] = ()  # more flying-worker flags for every worker (e.g. --disable-radix-cache)
    bindable: bool = True  # workers build the communicator pool and accept bind/release commands
    comm_port: int = field(default_factory=free_port)
    gateway_args: tuple[str, ...] = ()
    standby_router: bool = False  # a second router waiting for the lease (the demo runs one)
    log_format: str = "text"  # every process's --log-format: text or json (see flying.logs)
    router_metrics_port: int = field(default_factory=free_port)  # the router's Prometheus metrics (0: off)
    # the router's DP dispatch (router_args given after these override them)
    dispatch: DispatchRule = PolicyConfig.dispatch
    # each node's rendezvous (the first: comm_port)
    comm_ports: tuple[int, ...] = field(init=False, default=())
    gateway_ports: tuple[int, ...] = field(init=False, default=())  # each gateway's (the first: gateway_port)

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {self.num_engines}")
        if not self.worker_ports:
            object.__setattr__(self, "worker_ports", tuple(free_port() for _ in range(self.num_engines)))
        if len(self.worker_ports) != self.num_engines:
            raise ValueError(
                f"worker_ports needs one port per engine: {len(self.worker_ports)} for {self.num_engines} engines"
            )
        if self.nodes < 1 or self.num_engines % self.nodes:
            raise ValueError(f"{self.num_engines} engines do not split evenly over {self.nodes} nodes")
        if self.gateways < 1:
            raise ValueError(f"gateways must be >= 1, got {self.gateways}")
        more_comm = tuple(free_port() for _ in range(self.nodes - 1))
        object.__setattr__(self, "comm_ports", (self.comm_port, *more_comm))
        more_gw = tuple(free_port() for _ in range(self.gateways - 1))
        object.__setattr__(self, "gateway_ports", (self.gateway_port, *more_gw))

    @property
    def per_node(self) -> int:
        return self.num_engines // self.nodes

    def node_of(self, engine: int) -> int:
        return engine // self.per_node

    def node_engines(self, node: int) -> range:
        return range(node * self.per_node, (node + 1) * self.per_node)

    def node_name(self, node: int) -> str:
        return f"node{node}"

    def gateway_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.gateway_ports]

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def dispatch_args(self) -> tuple[str, ...]:
        """The router's dispatch flags for these settings."""
        return ("--dispatch", self.dispatch)


class ClusterError(RuntimeError):
    pass


class Cluster:
    def __init__(self, config: ClusterConfig, progress: Callable[[str], None] = lambda s: None) -> None:
        self.config = config
        self.progress = progress
        self.keys = Keys(config.key_prefix)
        self.redis_server: RedisServer | None = None
        self.redis_url = config.redis_url or ""
        self.workers: dict[int, subprocess.Popen] = {}
        self.router: subprocess.Popen | None = None
        self.standby: subprocess.Popen | None = None
        self.gateway: subprocess.Popen | None = None
        self.more_gateways: dict[int, subprocess.Popen] = {}  # the second gateway on, by index (gateways > 1)

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 300) -> Cluster:
        try:
            if not self.redis_url:
                self.redis_server = RedisServer(data_dir=self.config.log_dir / "redis", aof=True).start()
                self.redis_url = self.redis_server.url
                self.progress(f"redis-server on {self.redis_url}")
            for i in range(self.config.num_engines):
                self.start_worker(i)
            self.start_router()
            if self.config.standby_router:
                self.start_standby()
            self.start_gateway()
            for g in range(1, self.config.gateways):
                self.start_more_gateway(g)
            self.wait_live(range(self.config.num_engines), timeout_s)
            self.wait_gateway(timeout_s=60)
            for g in self.more_gateways:
                self.wait_gateway(timeout_s=60, index=g)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        stop_all(
            [self.gateway, *self.more_gateways.values(), self.router, self.standby, *self.workers.values()]
        )
        if self.redis_server:
            self.redis_server.stop()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- processes ---------------------------------------------------------------------------------------------
    def log(self, name: str) -> Path:
        return self.config.log_dir / f"{name}.log"

    def _command(self, module: str, *args: str) -> list[str]:
        """``python -m module`` pointed at this cluster's Redis and key prefix, plus ``args``."""
        redis_args = ["--redis-url", self.redis_url, "--key-prefix", self.config.key_prefix]
        log_args = ["--log-format", self.config.log_format]
        return [sys.executable, "-m", module, *redis_args, *log_args, *args]

    def worker_command(self, i: int) -> list[str]:
        """``flying-worker`` for engine ``i``: its node's pool (engines, first engine, rendezvous port)."""
        c = self.config
        cmd = self._command(
            "worker_ext.launch",
            "--engine",
            str(i),
            "--num-engines",
            str(c.per_node),
            "--model-path",
            str(c.model_path),
            "--port",
            str(c.worker_ports[i]),
            "--served-model-name",
            c.served_model_name,
            "--max-total-tokens",
            str(c.max_total_tokens),
        )
        node = c.node_of(i)
        if c.nodes > 1:
            cmd += ["--node", c.node_name(node), "--first-engine", str(c.node_engines(node).start)]
        if c.bindable and c.per_node > 1:
            cmd += ["--comm-port", str(c.comm_ports[node])]
        return cmd + list(c.worker_args)

    def start_worker(self, i: int) -> None:
        self.workers[i] = spawn(self.worker_command(i), self.log(f"worker{i}"))
        self.progress(f"worker {i} starting on port {self.config.worker_ports[i]}")

    def start_router(self, args: tuple[str, ...] | None = None) -> None:
        """Start the router with ``args`` (default: the config's router_args)."""
        args = self.config.router_args if args is None else args
        metrics = (
            ("--metrics-port", str(self.config.router_metrics_port))
            if self.config.router_metrics_port
            else ()
        )
        cmd = self._command("router.main", *metrics, *self.config.dispatch_args(), *args)
        self.router = spawn(cmd, self.log("router"))
        self.progress("router starting")

    def start_standby(self, args: tuple[str, ...] | None = None) -> None:
        """A second router with the same arguments: it dispatches only once the router's lease is free."""
        args = self.config.router_args if args is None else args
        cmd = self._command("router.main", *self.config.dispatch_args(), *args)
        self.standby = spawn(cmd, self.log("router-standby"))
        self.progress("standby router starting")

    def _gateway(self, index: int) -> subprocess.Popen:
        c = self.config
        cmd = self._command(
            "gateway.main",
            "--model-path",
            str(c.model_path),
            "--port",
            str(c.gateway_ports[index]),
            "--served-model-name",
            c.served_model_name,
            *c.gateway_args,
        )
        self.progress(f"gateway {index} starting on {c.gateway_urls()[index]}")
        return spawn(cmd, self.log("gateway" if index == 0 else f"gateway{index}"))

    def start_gateway(self) -> None:
        self.gateway = self._gateway(0)

    def start_more_gateway(self, index: int) -> None:
        """Gateway ``index`` (1 ..): another gateway process on its own port, over the same Redis."""
        self.more_gateways[index] = self._gateway(index)

    def kill_node(self, node: int, sig: int = signal.SIGKILL) -> None:
        """Every engine of ``node`` at once (its launchers and servers), as a lost host."""
        procs = [self.workers.pop(i) for i in self.config.node_engines(node) if i in self.workers]
        for proc in procs:  # all at once, then reap each
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        for proc in procs:
            stop(proc, sig=sig)

    def kill_worker(self, i: int, sig: int = signal.SIGKILL) -> None:
        stop(self.workers.pop(i), sig=sig)

    def restart_redis(self, down_s: float = 1.0, sig: int = signal.SIGTERM) -> None:
        """Stop the private redis-server with ``sig``, wait ``down_s``, start it again on the same port and data
        directory (with AOF it comes back with its data, all but the last second after a SIGKILL)."""
        if self.redis_server is None:
            raise RuntimeError(
                "only a Redis this cluster started can be restarted (this one uses an external one)"
            )
        old = self.redis_server
        stop(old.proc, sig=sig)
        time.sleep(down_s)
        self.redis_server = RedisServer(port=old.port, data_dir=old.data_dir, aof=old.aof).start()

    def kill_gateway(self, sig: int = signal.SIGKILL) -> None:
        stop(self.gateway, sig=sig)
        self.gateway = None

    def kill_router(self, sig: int = signal.SIGKILL) -> None:
        stop(self.router, sig=sig)
        self.router = None

    def fail_over_router(self) -> None:
        """Kill the active router (SIGKILL): the standby, which takes the lease, is the router now, and a new
        standby starts."""
        self.kill_router()
        self.router, self.standby = self.standby, None
        self.start_standby()

    def kill_standby(self, sig: int = signal.SIGKILL) -> None:
        stop(self.standby, sig=sig)
        self.standby = None

    # -- readiness ---------------------------------------------------------------------------------------------
    def client(self) -> redis.Redis:
        return redis_conn.sync_client(self.redis_url)

    def heartbeats(self) -> dict[int, Heartbeat]:
        r = self.client()
        engines = range(self.config.num_engines)  # (every node's)
        beats = r.mget([self.keys.worker(i) for i in engines])
        readies = r.mget([self.keys.ready(i) for i in engines])
        return {hb.engine: hb for raw, ready in zip(beats, readies) if (hb := live_heartbeat(raw, ready))}

    def wait_live(self, engines, timeout_s: float) -> None:
        want = set(engines)
        deadline = time.monotonic() + timeout_s
        announced: set[int] = set()
        while time.monotonic() < deadline:
            try:
                live = set(self.heartbeats())
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # Redis slow to answer while the workers load the CPU: poll again
                self.progress(f"redis not answering yet ({exc}); still waiting")
                time.sleep(0.5)
                continue
            for i in sorted((live & want) - announced):
                self.progress(f"worker {i} live")
                announced.add(i)
            if want <= live:
                return
            for i in want - live:
                proc = self.workers.get(i)
                if proc is not None and proc.poll() is not None:
                    raise ClusterError(
                        f"worker {i} exited ({proc.returncode}):\n{tail(self.log(f'worker{i}'))}"
                    )
            time.sleep(0.5)
        raise ClusterError(
            f"workers {sorted(want - set(self.heartbeats()))} not live after {timeout_s:.0f} s"
        )

    def wait_gateway(self, timeout_s: float, index: int = 0) -> None:
        proc = self.gateway if index == 0 else self.more_gateways[index]
        name = "gateway" if index == 0 else f"gateway{index}"
        try:
            wait_healthy(proc, self.config.gateway_urls()[index], timeout_s)
        except NotReady as exc:
            raise ClusterError(f"{name}: {exc}:\n{tail(self.log(name))}") from None
        self.progress(f"{name} ready")
