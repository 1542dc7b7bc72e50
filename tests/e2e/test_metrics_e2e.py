"""A real Prometheus (the Debian package's binary) scrapes the live CPU stack's gateway and router; our series come
back through its HTTP API: requests by priority after traffic, a bind and a release after a manual bind/release."""

from __future__ import annotations

import shutil
import subprocess
import time

import httpx
import openai
import pytest

from flying import control
from flying.procs import free_port, spawn, stop, wait_healthy
from tests.e2e.test_switching import wait_mode

pytestmark = pytest.mark.e2e
PROMETHEUS = shutil.which("prometheus")


@pytest.fixture
def prometheus(cluster, tmp_path):
    if PROMETHEUS is None:
        pytest.skip(
            "no prometheus binary on PATH (Debian: apt-get install prometheus; scripts/setup.sh does)"
        )
    gateway = cluster.config.gateway_url.removeprefix("http://")
    router = f"127.0.0.1:{cluster.config.router_metrics_port}"
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - {{job_name: gateway, static_configs: [{{targets: ['{gateway}']}}]}}\n"
        f"  - {{job_name: router, static_configs: [{{targets: ['{router}']}}]}}\n"
    )
    port = free_port()
    cmd = [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
           f"--web.listen-address=127.0.0.1:{port}"]  # fmt: skip
    proc: subprocess.Popen = spawn(cmd, tmp_path / "prometheus.log")
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", 60, path="/-/ready")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def query(prom: str, expr: str, timeout_s: float = 30) -> float:
    """The sum of ``expr``'s series once it is positive (scrapes run every second), else 0 after the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = httpx.get(f"{prom}/api/v1/query", params={"query": f"sum({expr})"}).json()
        result = body["data"]["result"]
        value = float(result[0]["value"][1]) if result else 0.0
        if value > 0 or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def test_prometheus_reads_our_series_from_the_live_stack(cluster, prometheus):
    client = openai.OpenAI(base_url=cluster.config.gateway_url + "/v1", api_key="unused", max_retries=0)
    for _ in range(3):
        client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "metrics"}], max_tokens=2,
            extra_headers={"X-Priority": "high"},
        )  # fmt: skip
    r = cluster.client()
    epoch = control.bind(r, cluster.keys, (0, 1))
    wait_mode(cluster, (0, 1), "tp")
    control.release(r, cluster.keys, (0, 1), epoch)
    wait_mode(cluster, (0, 1), "dp")

    assert query(prometheus, 'flying_gateway_requests_total{priority="high",status="200"}') >= 3
    assert query(prometheus, 'flying_gateway_ttft_seconds_count{priority="high"}') >= 3
    assert query(prometheus, 'flying_router_binds_total{reason="manual",outcome="bound"}') >= 1
    assert query(prometheus, 'flying_router_releases_total{reason="manual",outcome="done"}') >= 1
    assert query(prometheus, 'flying_engine_mode{mode="dp"}') == 2
    assert query(prometheus, "flying_router_leader") == 1
