"""Everything needed to run stock SGLang 0.5.23 on a CPU-only host, in one place.

* ``site/sgl_kernel``: a pure-PyTorch stand-in for the CUDA-only ``sgl_kernel`` package. Put on ``PYTHONPATH``
  only for CPU SGLang processes (see :func:`sglang_cpu_env`); never installed into site-packages.
* :mod:`worker_ext.cpu_compat.install`: the torchvision import guard, applied once by ``scripts/setup.sh``.

Nothing here is used on a GPU host.
"""

from __future__ import annotations

import os
from pathlib import Path

STANDIN_DIR = Path(__file__).resolve().parent / "site"


def on_cpu_host() -> bool:
    """True unless the user says this is a GPU host (``FLYING_DEVICE=cuda``) or torch sees a GPU."""
    device = os.environ.get("FLYING_DEVICE", "").lower()
    if device:
        return device == "cpu"
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a hard dependency of the workers
        return True


def sglang_cpu_env(base: dict[str, str] | None = None, cpu_bind: str | None = None) -> dict[str, str]:
    """Environment for one CPU SGLang server process: stand-in on the path, CPU engine, one OpenMP thread."""
    env = dict(os.environ if base is None else base)
    parts = [str(STANDIN_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    if cpu_bind is not None:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_bind
    return env


SGLANG_CPU_ARGS: tuple[str, ...] = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-cuda-graph",
    "--sleep-on-idle",
    "--disable-overlap-schedule",
)
