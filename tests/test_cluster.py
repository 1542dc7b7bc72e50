"""The local stack's configuration (devstack.cluster): what it passes to the router."""

from __future__ import annotations

from pathlib import Path

from devstack.cluster import ClusterConfig
from router.main import parse_args
from router.policy import PolicyConfig


def test_dispatch_settings_reach_the_router_and_router_args_override_them():
    default = parse_args(list(ClusterConfig(Path("m")).dispatch_args())).policy
    assert default == PolicyConfig()
    cfg = ClusterConfig(Path("m"), dispatch="least-loaded", cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=2)  # fmt: skip
    p = parse_args(list(cfg.dispatch_args())).policy
    assert (p.dispatch, p.cache_threshold, p.balance_abs_threshold, p.balance_rel_threshold) == (
        "least-loaded",
        0.5,
        4,
        2,
    )
    assert parse_args([*cfg.dispatch_args(), "--dispatch", "cache-aware"]).policy.dispatch == "cache-aware"
