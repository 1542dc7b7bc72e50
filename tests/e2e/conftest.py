"""One real cluster (Redis, 2 SGLang CPU workers, router, gateway) and one stock SGLang server, shared by the
end-to-end tests."""

from __future__ import annotations

import sys

import pytest

from flying.cluster import Cluster, ClusterConfig
from flying.procs import free_port, spawn, stop, wait_healthy
from worker_ext.cpu_compat import SGLANG_CPU_ARGS, sglang_cpu_env


@pytest.fixture(scope="session")
def cluster(tiny_model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("cluster")
    config = ClusterConfig(
        model_path=tiny_model,
        num_engines=2,
        log_dir=log_dir,
        max_total_tokens=4096,
        router_args=("--max-inflight-per-worker", "4"),
    )
    with Cluster(config, progress=print) as c:
        yield c


@pytest.fixture(scope="session")
def stock_server(tiny_model, tmp_path_factory):
    """A stock SGLang server (no flying-serving involvement) on the same tiny model."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(tiny_model),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--dtype",
        "float32",
        "--max-total-tokens",
        "4096",
        *SGLANG_CPU_ARGS,
    ]
    env = sglang_cpu_env()
    env.pop("FLYING_ENGINE_INDEX", None)
    proc = spawn(cmd, tmp_path_factory.mktemp("stock") / "stock.log", env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, timeout_s=240)
    yield url
    stop(proc)
