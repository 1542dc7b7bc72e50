"""``flying-worker``: run engine *i* of *N* as a stock ``sglang.launch_server`` with the flying-serving plugin.

The launcher stays as a small parent process: it starts the SGLang server, marks the engine ready in Redis once
the server's HTTP endpoint answers, and exits (clearing the mark) when the server dies or on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field

import redis

from flying import settings
from flying.keys import Keys
from flying.procs import NotReady, wait_healthy
from worker_ext.cpu_compat import SGLANG_CPU_ARGS, on_cpu_host, sglang_cpu_env


@dataclass(frozen=True)
class WorkerConfig:
    engine: int
    num_engines: int
    model_path: str
    port: int
    host: str = "127.0.0.1"
    served_model_name: str = "tiny-llama"
    redis_url: str = settings.DEFAULT_REDIS_URL
    key_prefix: str = "flying"
    dtype: str = "float32"
    max_total_tokens: int | None = None
    cpu: bool = True
    comm_port: int | None = None  # communicator-pool rendezvous on engine 0; None: this engine never binds
    comm_host: str = "127.0.0.1"
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        assert 0 <= self.engine < self.num_engines, f"engine {self.engine} not in [0, {self.num_engines})"
        assert 0 < self.port < 65536, f"bad port {self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


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
        "--log-level",
        "warning",
    ]
    if cfg.max_total_tokens:
        cmd += ["--max-total-tokens", str(cfg.max_total_tokens)]
    if cfg.comm_port:  # bound-capable: TP requests' KV slots are per-request views, not sharable prefixes
        cmd += ["--disable-radix-cache"]
    if cfg.cpu:
        cmd += list(SGLANG_CPU_ARGS)
    return cmd + list(cfg.extra_args)


def sglang_env(cfg: WorkerConfig, launch_id: str) -> dict[str, str]:
    env = sglang_cpu_env(cpu_bind=str(cfg.engine % (os.cpu_count() or 1))) if cfg.cpu else dict(os.environ)
    if not cfg.cpu:
        env.setdefault("CUDA_VISIBLE_DEVICES", str(cfg.engine))
    env.update(
        {
            settings.ENGINE_INDEX: str(cfg.engine),
            settings.NUM_ENGINES: str(cfg.num_engines),
            settings.ENGINE_URL: cfg.url,
            settings.SERVED_MODEL: cfg.served_model_name,
            settings.REDIS_URL: cfg.redis_url,
            settings.KEY_PREFIX: cfg.key_prefix,
            settings.LAUNCH_ID: launch_id,
            settings.DEVICE: "cpu" if cfg.cpu else "cuda",
        }
    )
    if cfg.comm_port:
        env[settings.COMM_PORT] = str(cfg.comm_port)
        env[settings.COMM_HOST] = cfg.comm_host
    return env


def run(cfg: WorkerConfig, ready_timeout_s: float = 300) -> int:
    keys = Keys(cfg.key_prefix)
    r = redis.Redis.from_url(cfg.redis_url)
    r.delete(keys.ready(cfg.engine))
    launch_id = uuid.uuid4().hex[:12]
    # Same process group as this launcher: whoever kills the worker's group kills the server with it.
    proc = subprocess.Popen(sglang_command(cfg), env=sglang_env(cfg, launch_id))

    def stop(signum, frame):
        _terminate(proc)
        r.delete(keys.ready(cfg.engine))
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        try:
            wait_healthy(proc, cfg.url, ready_timeout_s)
        except NotReady as exc:
            raise SystemExit(f"flying-worker: sglang: {exc}") from None
        r.set(keys.ready(cfg.engine), launch_id)
        print(f"flying-worker: engine {cfg.engine} ready at {cfg.url}", flush=True)
        return proc.wait()
    finally:
        _terminate(proc)
        r.delete(keys.ready(cfg.engine))


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        proc.terminate()  # sglang's launch_server stops its scheduler and detokenizer children on SIGTERM
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="flying-worker", description=__doc__.splitlines()[0])
    p.add_argument("--engine", type=int, required=True, help="engine index i (one per GPU)")
    p.add_argument("--num-engines", type=int, required=True, help="N, engines in the deployment")
    p.add_argument("--model-path", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--served-model-name", default="tiny-llama")
    p.add_argument("--redis-url", default=settings.redis_url())
    p.add_argument("--key-prefix", default=settings.key_prefix())
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--comm-port", type=int, default=None, help="rendezvous port (same on every engine) to allow binds"
    )
    p.add_argument(
        "--comm-host", default="127.0.0.1", help="host of engine 0, which serves the rendezvous store"
    )
    p.add_argument("extra", nargs=argparse.REMAINDER, help="-- then extra sglang.launch_server arguments")
    a = p.parse_args(argv)
    cpu = on_cpu_host() if a.device == "auto" else a.device == "cpu"
    extra = tuple(x for x in a.extra if x != "--")
    cfg = WorkerConfig(
        engine=a.engine,
        num_engines=a.num_engines,
        model_path=a.model_path,
        port=a.port,
        host=a.host,
        served_model_name=a.served_model_name,
        redis_url=a.redis_url,
        key_prefix=a.key_prefix,
        dtype=a.dtype,
        max_total_tokens=a.max_total_tokens,
        cpu=cpu,
        comm_port=a.comm_port,
        comm_host=a.comm_host,
        extra_args=extra,
    )
    sys.exit(run(cfg))


if __name__ == "__main__":
    main()
