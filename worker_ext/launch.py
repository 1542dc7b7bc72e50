"""``flying-worker``: run engine *i* of *N* as a stock ``sglang.launch_server`` with the flying-serving plugin.

The launcher stays as a small parent process: it starts the SGLang server, marks the engine ready in Redis once
the server's HTTP endpoint answers, and exits (clearing the mark) when the server dies or on SIGTERM/SIGINT.

The ready key is the engine's process-liveness signal: it expires ``READY_TTL_MS`` after the launcher last saw
the server process alive (it refreshes it every ``READY_REFRESH_S``), so an engine killed with its launcher
vanishes within that bound however busy its scheduler was, and a Redis that lost its data (a restart without
persistence) gets the key back within one refresh.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Literal

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from flying import cli, logs, redis_conn, settings
from flying.config import add_flags, from_flags, require, setting
from flying.keys import Keys
from flying.logs import FORMAT_HELP, LogFormat
from flying.parent_death import dies_with
from flying.procs import NotReady, port_taken, wait_healthy
from worker_ext import sglang_patches
from worker_ext.cpu_compat import SGLANG_CPU_ARGS, on_cpu_host, sglang_cpu_env

log = logging.getLogger("flying.worker")
READY_TTL_MS = 1500
READY_REFRESH_S = 0.25
KV_SHARE = 0.25  # of the memory available at launch, split among the host's engines, for KV (CPU default)
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "auto": 2}


Device = Literal["auto", "cpu", "cuda"]


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """The engine's settings; ``flying-worker``'s flags are generated from them (:mod:`flying.config`)."""

    engine: int = setting(help="engine index i, 0..N-1 (one per GPU) (required)")
    num_engines: int = setting(
        help="N, engines on this node: its communicator pool spans engines --first-engine .. +N-1 (required)"
    )
    node: str | None = setting(
        None,
        "the node this engine announces: groups bind engines of one node only (default: the host name)",
    )
    first_engine: int = setting(
        0,
        "the first engine of this node's pool: engine indices are global, each node runs its own run of them "
        "(node k of N engines each: k*N); it hosts the pool's rendezvous store",
    )
    model_path: str = setting(help="model directory (required)")
    port: int = setting(help="the SGLang server's HTTP port (required)", type=cli.port)
    host: str = setting("127.0.0.1", "address the SGLang server listens on (keep it private)")
    served_model_name: str = setting("tiny-llama", "model name the engine reports")
    redis_url: str = setting(
        settings.DEFAULT_REDIS_URL, "the Redis of the deployment", flags=cli.add_redis_arguments
    )
    key_prefix: str = "flying"
    dtype: str = setting("float32", "weights and activations dtype (SGLang --dtype)")
    max_total_tokens: int | None = setting(
        None,
        "KV pool size in tokens; by default, on CPU, sized from the memory available for the host's engines "
        "(SGLang's own default on GPU)",
    )
    device: Device = setting("auto", "auto: cuda where a GPU is visible")
    cpu: bool = True  # the device it runs on (--device auto: the host's)
    drain_grace_s: float = setting(
        30.0,
        "seconds: on SIGTERM leave the live set, let assigned requests finish for at most this long, then stop",
    )
    # communicator-pool rendezvous on the pool's first engine
    comm_port: int | None = setting(
        None,
        "rendezvous port (same on every engine of the node) to allow binds; by default none: the engine never "
        "binds",
        type=cli.port,
    )
    comm_host: str = setting(
        "127.0.0.1", "host of the node's first engine, which serves the pool's rendezvous store"
    )
    sp_threshold: int = setting(
        settings.DEFAULT_SP_THRESHOLD,
        "tokens: while bound, a step of at least this many batched tokens (a prefill's tokens, a decode's "
        "sequences) runs sequence-parallel (each member its slice of the tokens through its full weights, "
        "all-to-alls around attention); smaller steps run tensor-parallel; 0: never SP (a bind's own setting, "
        "flyctl bind --sp-threshold, wins)",
    )
    # the launcher's lines, the plugin's, and SGLang's request lines
    log_format: LogFormat = setting("text", FORMAT_HELP)
    log_requests: bool = setting(
        True, "SGLang logs every request's rid (metadata only) when it arrives and when it finishes"
    )
    enable_metrics: bool = setting(
        False,
        "SGLang's own Prometheus metrics on the engine's port, /metrics (off unless given); the switch counters "
        "are in the heartbeat and the router's metrics",
        flag="--enable-metrics",
    )
    # SGLang's radix cache, kept through binds and releases (worker_ext.sglang_patches.prefix_cache)
    prefix_cache: bool = setting(
        True,
        "turn SGLang's prefix (radix) cache off (on unless given; kept through binds and releases, TP requests "
        "bypass it)",
        flag="--disable-radix-cache",
    )
    extra_args: tuple[str, ...] = ()  # after --: extra sglang.launch_server arguments

    def __post_init__(self) -> None:
        first, n = self.pool_first, self.num_engines
        require(n >= 1, f"--num-engines {n} must be >= 1")
        require(
            first <= self.engine < first + n,
            f"--engine {self.engine} is not in its node's pool [{first}, {first + n}) "
            f"(--first-engine {first}, --num-engines {n})",
        )
        require(0 < self.port < 65536, f"--port {self.port} is not a TCP port")
        require(self.sp_threshold >= 0, f"--sp-threshold {self.sp_threshold} must be >= 0 (0: never SP)")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pool_first(self) -> int:
        """The first engine of the node's pool (it hosts the pool's rendezvous store)."""
        return self.first_engine

    @property
    def local_index(self) -> int:
        """The engine's index on its node (its GPU)."""
        return self.engine - self.pool_first


def mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what the host can still give without swapping)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def default_kv_tokens(
    model_path: str, engines_on_host: int, dtype: str, available_bytes: int | None = None
) -> int:
    """KV tokens for a CPU engine started without ``--max-total-tokens``: its share (``KV_SHARE``) of the memory
    available on the host, split among the host's engines, less its weights; at least one context, at most 32.
    (SGLang's own CPU default sizes the pool from the whole machine's memory: one engine takes ~20 GB of 24.)"""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 4)
    weights = sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors"))
    avail = mem_available_bytes() if available_bytes is None else available_bytes
    budget = KV_SHARE * avail / max(1, engines_on_host) - weights
    context = int(cfg.get("max_position_embeddings") or 4096)
    return int(max(context, min(budget // per_token, 32 * context)))


def with_default_kv(cfg: WorkerConfig) -> WorkerConfig:
    """On CPU without ``--max-total-tokens``: size the KV pool with :func:`default_kv_tokens`."""
    if not cfg.cpu or cfg.max_total_tokens:
        return cfg
    tokens = default_kv_tokens(cfg.model_path, cfg.num_engines, cfg.dtype)
    print(
        f"flying-worker: engine {cfg.engine}: --max-total-tokens {tokens} (from the memory available for "
        f"{cfg.num_engines} engines on this host; pass --max-total-tokens to choose)",
        flush=True,
    )
    return dataclasses.replace(cfg, max_total_tokens=tokens)


def sglang_command(cfg: WorkerConfig) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        cfg.model_path,
        "--host",
        cfg.host,
        "--port",
        str(cfg.port),
        "--served-model-name",
        cfg.served_model_name,
        "--dtype",
        cfg.dtype,
        "--enable-priority-scheduling",
        "--enable-cache-report",  # usage.prompt_tokens_details.cached_tokens in every OpenAI answer
        "--log-level",
        "warning",
    ]
    if cfg.max_total_tokens:
        cmd += ["--max-total-tokens", str(cfg.max_total_tokens)]
    if (
        cfg.log_requests
    ):  # level 0: the request's metadata (its rid), no prompt, output or sampling parameters
        cmd += ["--log-requests", "--log-requests-level", "0", "--log-requests-format", cfg.log_format]
    if not cfg.prefix_cache:
        cmd += ["--disable-radix-cache"]
    if cfg.enable_metrics:
        cmd += ["--enable-metrics"]
    if cfg.cpu:
        cmd += list(SGLANG_CPU_ARGS)
    return cmd + list(cfg.extra_args)


def sglang_env(cfg: WorkerConfig, launch_id: str) -> dict[str, str]:
    env = (
        sglang_cpu_env(cpu_bind=str(cfg.local_index % (os.cpu_count() or 1))) if cfg.cpu else dict(os.environ)
    )
    if not cfg.cpu:
        env.setdefault("CUDA_VISIBLE_DEVICES", str(cfg.local_index))
    env.update(
        {
            settings.ENGINE_INDEX: str(cfg.engine),
            settings.NUM_ENGINES: str(cfg.num_engines),
            settings.FIRST_ENGINE: str(cfg.pool_first),
            settings.NODE: cfg.node or "",
            settings.ENGINE_URL: cfg.url,
            settings.SERVED_MODEL: cfg.served_model_name,
            settings.REDIS_URL: cfg.redis_url,
            settings.KEY_PREFIX: cfg.key_prefix,
            settings.LAUNCH_ID: launch_id,
            settings.DEVICE: "cpu" if cfg.cpu else "cuda",
            settings.LOG_FORMAT: cfg.log_format,
        }
    )
    if cfg.comm_port:
        env[settings.COMM_PORT] = str(cfg.comm_port)
        env[settings.COMM_HOST] = cfg.comm_host
        env[settings.SP_THRESHOLD] = str(cfg.sp_threshold)
    return env


PORT_WAIT_S = 10.0  # how long a worker waits for its HTTP port to be free before it gives up


def run(cfg: WorkerConfig, ready_timeout_s: float = 300, drain_grace_s: float = 30) -> int:
    if why := port_taken(cfg.host, cfg.port, wait_s=PORT_WAIT_S):
        # SGLang would find out only after its imports and model load, and then hang in its exit (its scheduler
        # process is joined, never stopped), so the launcher would wait out ready_timeout_s
        raise SystemExit(f"flying-worker: engine {cfg.engine}: cannot serve on {cfg.host}:{cfg.port}: {why}")
    keys = Keys(cfg.key_prefix)
    # one retry: its loops retry every READY_REFRESH_S, and redis-py's default (ten, backed off) would hold a
    # refresh or a drain ~25 s against a Redis that does not answer
    r = redis_conn.sync_client(
        cfg.redis_url, socket_timeout=2, socket_connect_timeout=2, retry=Retry(NoBackoff(), 1)
    )
    with contextlib.suppress(redis.RedisError):
        r.delete(keys.ready(cfg.engine))
    launch_id = uuid.uuid4().hex[:12]
    # Same process group as this launcher: whoever kills the worker's group kills the server with it; and the
    # server gets SIGKILL when the launcher dies alone (kill -9), so a restarted launcher finds its port free (on
    # SIGTERM SGLang would finish its requests first, serving on unseen by the router).
    proc = subprocess.Popen(
        sglang_command(cfg),
        env=sglang_env(cfg, launch_id),
        preexec_fn=dies_with(os.getpid(), signal.SIGKILL),
    )
    life = Lifecycle()
    signal.signal(signal.SIGTERM, life.on_signal)
    signal.signal(signal.SIGINT, life.on_signal)
    try:
        try:
            wait_healthy(proc, cfg.url, ready_timeout_s)
        except NotReady as exc:
            raise SystemExit(f"flying-worker: sglang: {exc}") from None
        print(f"flying-worker: engine {cfg.engine} ready at {cfg.url}", flush=True)
        life.serving()
        rc = keep_ready(r, keys.ready(cfg.engine), launch_id, proc, life.is_draining)
        if life.is_draining():
            drain(r, keys.ready(cfg.engine), keys.inflight(cfg.engine), proc, drain_grace_s)
            return 0
        if rc is None:  # keep_ready returns None only once stopped, and only draining stops it
            raise RuntimeError("the ready key's refresh stopped without a drain")
        how = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
        log.error("engine %d: the SGLang server stopped (%s); the launcher exits with it", cfg.engine, how)
        return rc
    finally:
        life.cleaning_up()
        _terminate(proc)
        with contextlib.suppress(redis.RedisError):
            r.delete(keys.ready(cfg.engine))


class Lifecycle:
    """What the launcher's SIGTERM/SIGINT handler sees and changes: plain flags, no lock. The handler runs between
    two bytecodes of the main thread, so a lock that code may hold at that moment (threading.Event's, a Redis
    connection pool's, Popen.wait's) would deadlock the launcher if the handler took it too. The first signal once
    serving asks for a drain; any other stops the launcher (SystemExit, whose cleanup stops the engine)."""

    def __init__(self) -> None:
        self._ready = False
        self._draining = False
        self._exiting = False

    def serving(self) -> None:
        self._ready = True

    def cleaning_up(self) -> None:
        """From now on a signal is ignored: the cleanup under way ends soon."""
        self._exiting = True

    def is_draining(self) -> bool:
        return self._draining

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._exiting:
            return
        if self._ready and not self._draining:
            self._draining = True
            return
        self._exiting = True
        raise SystemExit(128 + signum)


def drain(r: redis.Redis, ready_key: str, inflight_key: str, proc: subprocess.Popen, grace_s: float) -> int:
    """Graceful stop: withdraw the ready key (routers stop sending work: the engine is no longer live, and a group
    it is in is released), then wait until the requests assigned to it have finished, at most ``grace_s``.
    Returns how many were still unfinished."""
    with contextlib.suppress(redis.RedisError):
        r.delete(ready_key)
    deadline = time.monotonic() + grace_s
    left = -1
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            left = int(r.scard(inflight_key))
        except redis.RedisError:
            left = -1
        if left == 0:
            break
        time.sleep(READY_REFRESH_S)
    log.warning("drained (%s requests unfinished); stopping the engine", max(left, 0))
    return max(left, 0)


def keep_ready(
    r: redis.Redis,
    key: str,
    launch_id: str,
    proc: subprocess.Popen,
    stopped: Callable[[], bool] = lambda: False,
) -> int | None:
    """Refresh the ready key while ``proc`` lives (and until ``stopped()``); return its exit code (None: stopped).
    It polls ``stopped`` every refresh, so a signal handler can stop it by setting a flag (no lock to take).
    Redis errors (an outage, a restart) are ridden out: the key is written again as soon as Redis answers."""
    down_since: float | None = None
    while proc.poll() is None and not stopped():
        try:
            r.set(key, launch_id, px=READY_TTL_MS)
            if down_since is not None:
                log.warning(
                    "redis is back after %.1f s; ready key re-announced", time.monotonic() - down_since
                )
                down_since = None
        except redis.RedisError as exc:
            if down_since is None:
                log.warning("redis unavailable (%r); retrying every %.2f s", exc, READY_REFRESH_S)
                down_since = time.monotonic()
        time.sleep(READY_REFRESH_S)
    return proc.poll()


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        proc.terminate()  # sglang's launch_server stops its scheduler and detokenizer children on SIGTERM
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            # gone, its port with it, before the launcher is (a restart can bind at once)
            proc.wait(timeout=5)


def parser() -> argparse.ArgumentParser:
    p = cli.parser("flying-worker", __doc__.splitlines()[0])
    add_flags(p, WorkerConfig)
    p.add_argument("extra", nargs=argparse.REMAINDER, help="-- then extra sglang.launch_server arguments")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    a = p.parse_args(argv)
    logs.setup(a.log_format)
    try:
        sglang_patches.check_version()  # once, before anything starts: the patches fit one SGLang version
    except sglang_patches.SGLangMismatch as exc:
        sys.exit(f"flying-worker: {exc}")
    try:
        cfg = with_default_kv(worker_config(a))
    except ValueError as exc:  # the options do not fit together (WorkerConfig says which)
        p.error(str(exc))
    except FileNotFoundError as exc:
        p.error(f"--model-path {a.model_path}: {exc.strerror or exc}: {exc.filename} (a model directory)")
    sys.exit(run(cfg, drain_grace_s=cfg.drain_grace_s))


def worker_config(a: argparse.Namespace) -> WorkerConfig:
    """The config the parsed flags name: the device and node resolved on this host."""
    return from_flags(
        WorkerConfig,
        a,
        redis_url=cli.redis_url(a),
        key_prefix=a.key_prefix,
        cpu=on_cpu_host() if a.device == "auto" else a.device == "cpu",
        node=socket.gethostname() if a.node is None else a.node,
        extra_args=tuple(x for x in a.extra if x != "--"),
    )


if __name__ == "__main__":
    main()
