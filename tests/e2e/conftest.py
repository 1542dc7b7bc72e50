"""One real cluster (Redis, 2 SGLang CPU workers, router, gateway) shared by the end-to-end tests."""

from __future__ import annotations

import pytest

from flying.cluster import Cluster, ClusterConfig


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
