"""What a KV transformation costs (router.transform_cost), and one round's adoption check."""

from __future__ import annotations

import pytest

from flying.cost_model import CostModel, kv_transform_ms
from router.config import PolicyConfig
from router.engine_view import EngineView
from router.transform_cost import TransformCost, adopt_moves, scatter_moves

CFG = PolicyConfig()
COST = CostModel(kv_bytes_per_token=1000, link_gbps=1.0, transform_fixed_ms=4.0)


def eng(i, used=0, kvt=True):
    return EngineView(i, f"e{i}", 0, 1000 - used, 1000, kv_transform=kvt)


def test_the_busiest_members_bytes_over_the_link_plus_the_fixed_part():
    assert kv_transform_ms([], 1000, 1.0, 4.0) == 4.0
    assert kv_transform_ms([(1000.0, 0.0), (0.0, 500.0)], 1000, 1.0, 4.0) == pytest.approx(4.0 + 1.0)
    assert adopt_moves([400, 0]) == [(200.0, 0.0), (0.0, 200.0)] and scatter_moves([400, 0]) == [(0.0, 200.0), (200.0, 0.0)]  # fmt: skip


def test_a_round_adopts_only_where_every_member_transforms_and_the_stall_is_small(monkeypatch):
    monkeypatch.setattr("router.transform_cost.ADOPT_MAX_MS", 10.0)
    live = {0: eng(0, used=400), 1: eng(1), 2: eng(2, kvt=False)}
    dp_kv = {0: 0, 1: 0, 2: 0}
    kv = TransformCost(CFG, COST, live, dp_kv)
    assert kv.possible((0, 1)) and not kv.possible((1, 2)) and not kv.possible((0, 9))
    assert kv.adopt_ms((0, 1)) == pytest.approx(4.0 + 200 * 1000 / 1e9 * 1000)
    assert kv.may_adopt((0, 1))
    dp_kv[1] = 30_000  # the round sends engine 1 more DP work: its KV moves too
    assert kv.used_kv(1) == 30_000 and not kv.may_adopt((0, 1))
    assert not TransformCost(PolicyConfig(off=frozenset({"kv-transform"})), COST, live, dp_kv).possible(
        (0, 1)
    )
