"""One real cluster (Redis, 2 SGLang CPU workers, router, gateway) and one stock SGLang server, shared by the
end-to-end tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from devstack.cluster import Cluster, ClusterConfig
from devstack.stock_server import StockServer


@pytest.fixture(scope="session")
def cluster(tiny_model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("cluster")
    config = ClusterConfig(
        model_path=tiny_model,
        num_engines=2,
        log_dir=log_dir,
        max_total_tokens=4096,
        router_args=("--max-inflight-per-worker", "4", "--manual"),  # switching tests drive binds by hand
        log_format="json",  # test_logs_e2e follows one request through the three processes' JSON lines
        worker_args=(
            "--enable-metrics",
        ),  # as docker-compose runs them: SGLang's pool statistics while bound
    )
    with Cluster(config, progress=print) as c:
        yield c


KV_TOKENS = 512  # per engine in cluster4: small, so that a long prompt needs a group


@contextlib.contextmanager
def four_engines(tiny_model, tmp_path_factory, name: str, router_args: tuple[str, ...]):
    """Four engines of KV_TOKENS each (a long prompt needs a group), logs under a temp dir called ``name``."""
    config = ClusterConfig(
        model_path=tiny_model,
        num_engines=4,
        log_dir=tmp_path_factory.mktemp(name),
        max_total_tokens=KV_TOKENS,
        router_args=router_args,
    )
    with Cluster(config, progress=print) as c:
        yield c


@pytest.fixture(scope="session")
def cluster4(tiny_model, tmp_path_factory):
    """Four engines; the router runs with --manual (these tests drive binds by hand)."""
    with four_engines(tiny_model, tmp_path_factory, "cluster4", ("--manual",)) as c:
        yield c


@contextlib.contextmanager
def stock_tp(tiny_model, tmp_path_factory, tp: int):
    """A stock SGLang server with ``--tp tp`` (gloo all-reduce) on the tiny model: the reference a merged group of
    that width must match."""
    log = tmp_path_factory.mktemp(f"stock-tp{tp}") / "server.log"
    server = StockServer(tiny_model, log, tp=tp).start()  # radix cache on, as the workers
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def stock_tp2(tiny_model, tmp_path_factory):
    with stock_tp(tiny_model, tmp_path_factory, 2) as url:
        yield url


@pytest.fixture(scope="session")
def stock_server(tiny_model, tmp_path_factory):
    """A stock SGLang server (no flying-serving involvement) on the same tiny model."""
    server = StockServer(tiny_model, tmp_path_factory.mktemp("stock") / "stock.log").start(timeout_s=240)
    yield server.url
    server.stop()


LOG_TAIL_LINES = 40


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """When a test that uses a cluster fails, its report carries the tails of that cluster's process logs (the
    router's decision log, the gateway's and the workers' errors): what CI shows is all there is to go on."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    for cluster in {
        id(v): v for v in getattr(item, "funcargs", {}).values() if isinstance(v, Cluster)
    }.values():
        for path in sorted(cluster.config.log_dir.glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            report.sections.append((f"{path.name} (last {len(lines)} lines)", "\n".join(lines)))
