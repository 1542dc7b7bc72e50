"""Run ``loadgen run`` as a user does (its own process) and read back its summary: shared by the benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_loadgen(url: str, out: Path, *args: str, quiet_stderr: bool = False) -> dict:
    """``loadgen run --url url *args --out out --quiet``; the ``summary`` of the ``out.json`` it writes."""
    cmd = [sys.executable, "-m", "loadgen.cli", "run", "--url", url, *args, "--out", str(out), "--quiet"]
    stderr = subprocess.DEVNULL if quiet_stderr else None
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=stderr)
    return json.loads(out.with_suffix(".json").read_text())["summary"]
