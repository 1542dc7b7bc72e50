"""The local stack's configuration (devstack.cluster): what it passes to the router."""

from __future__ import annotations

from pathlib import Path

import pytest

from devstack.cluster import Cluster, ClusterConfig
from router.main import parse_args
from router.policy import PolicyConfig


def test_dispatch_settings_reach_the_router_and_router_args_override_them():
    default = parse_args(list(ClusterConfig(Path("m")).dispatch_args())).policy
    assert default == PolicyConfig()
    cfg = ClusterConfig(Path("m"), dispatch="least-loaded")
    assert parse_args(list(cfg.dispatch_args())).policy.dispatch == "least-loaded"
    assert parse_args([*cfg.dispatch_args(), "--dispatch", "cache-aware"]).policy.dispatch == "cache-aware"


def test_an_engine_count_or_ports_that_do_not_fit_are_value_errors():
    with pytest.raises(ValueError, match="num_engines must be >= 1, got 0"):
        ClusterConfig(Path("m"), num_engines=0)
    with pytest.raises(ValueError, match="worker_ports needs one port per engine: 1 for 2 engines"):
        ClusterConfig(Path("m"), num_engines=2, worker_ports=(30001,))


def test_only_a_redis_the_cluster_started_can_be_restarted():
    cluster = Cluster(ClusterConfig(Path("m"), redis_url="redis://127.0.0.1:1/0"))
    with pytest.raises(RuntimeError, match="only a Redis this cluster started can be restarted"):
        cluster.restart_redis()


def test_the_routers_sp_threshold_is_unset_by_default_and_set_by_its_flag():
    assert parse_args([]).policy.sp_threshold is None
    assert parse_args(["--sp-threshold", "0"]).policy.sp_threshold == 0
    with pytest.raises(ValueError, match="sp_threshold must be >= 0"):
        PolicyConfig(sp_threshold=-1)


def test_two_nodes_of_two_engines_each_build_their_own_pools_and_two_gateways_their_own_ports():
    cfg = ClusterConfig(Path("m"), num_engines=4, nodes=2, gateways=2)
    assert len(set(cfg.comm_ports)) == 2 and cfg.comm_ports[0] == cfg.comm_port
    assert len(set(cfg.gateway_ports)) == 2 and cfg.gateway_urls()[0] == cfg.gateway_url
    assert [list(cfg.node_engines(n)) for n in (0, 1)] == [[0, 1], [2, 3]]
    cmd = Cluster(cfg, progress=print).worker_command(3)
    flag = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert (flag("--engine"), flag("--num-engines"), flag("--node"), flag("--first-engine")) == (
        "3",
        "2",
        "node1",
        "2",
    )
    assert flag("--comm-port") == str(cfg.comm_ports[1])
    one = Cluster(ClusterConfig(Path("m"), num_engines=2)).worker_command(1)
    assert "--node" not in one and one[one.index("--num-engines") + 1] == "2", "one node: as before"
    with pytest.raises(ValueError, match="3 engines do not split evenly over 2 nodes"):
        ClusterConfig(Path("m"), num_engines=3, nodes=2)
