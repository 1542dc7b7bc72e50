"""Run a *stock* ``sglang.launch_server`` on CPU (no flying-serving plugin active): the reference that tests and
benchmarks compare against (same model, fp32, optionally ``--tp N``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from flying.procs import free_port, spawn, stop, wait_healthy
from worker_ext.cpu_compat import SGLANG_CPU_ARGS, sglang_cpu_env


class StockServer:
    def __init__(
        self,
        model: Path,
        log: Path,
        tp: int = 1,
        max_total_tokens: int = 4096,
        disable_radix_cache: bool = False,
        cpu_bind: str | None = None,  # default: one core per rank, round robin (tp > 1); unpinned for tp = 1
    ) -> None:
        self.model, self.log, self.tp, self.max_total_tokens = model, log, tp, max_total_tokens
        self.disable_radix_cache = disable_radix_cache
        cores = os.cpu_count() or 1
        self.cpu_bind = (
            cpu_bind if cpu_bind is not None or tp == 1 else "|".join(str(i % cores) for i in range(tp))
        )
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        # --enable-cache-report: cached tokens in usage, as the flying workers report them
        cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(self.model),
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--dtype",
            "float32",
            "--max-total-tokens",
            str(self.max_total_tokens),
            "--enable-cache-report",
        ]
        if self.tp > 1:
            cmd += ["--tp", str(self.tp)]
        if self.disable_radix_cache:
            cmd += ["--disable-radix-cache"]
        return cmd + list(SGLANG_CPU_ARGS)

    def launch(self) -> StockServer:
        """Start the process without waiting (see :meth:`wait`), so several servers can start at once."""
        env = sglang_cpu_env(cpu_bind=self.cpu_bind)
        env.pop("FLYING_ENGINE_INDEX", None)  # keep our plugin inert: this server stays stock
        self.proc = spawn(self.command(), self.log, env=env)
        return self

    def wait(self, timeout_s: float = 300) -> StockServer:
        wait_healthy(self.proc, self.url, timeout_s)
        return self

    def start(self, timeout_s: float = 300) -> StockServer:
        return self.launch().wait(timeout_s)

    def stop(self) -> None:
        stop(self.proc)
