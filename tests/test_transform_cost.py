"""What a KV transformation costs (router.transform_cost), and one round's adoption check."""

from __future__ import annotations

import dataclasses

import pytest

from router.config import PolicyConfig
from router.engine_view import EngineView
from router.transform_cost import TransformCost, adopt_moves, kv_transform_ms, scatter_moves

CFG = PolicyConfig(kv_bytes_per_token=1000, kv_link_gbps=1.0, kv_transform_fixed_ms=4.0, adopt_max_ms=10.0)


def eng(i, used=0, kvt=True):
    return EngineView(i, f"e{i}", 0, 1000 - used, 1000, kv_transform=kvt)


def test_the_busiest_members_bytes_over_the_link_plus_the_fixed_part():
    assert kv_transform_ms([], 1000, 1.0, 4.0) == 4.0
    assert kv_transform_ms([(1000.0, 0.0), (0.0, 500.0)], 1000, 1.0, 4.0) == pytest.approx(4.0 + 1.0)
    assert adopt_moves([400, 0]) == [(200.0, 0.0), (0.0, 200.0)] and scatter_moves([400, 0]) == [(0.0, 200.0), (200.0, 0.0)]  # fmt: skip


def test_a_round_adopts_only_where_every_member_transforms_and_the_stall_is_small():
    live = {0: eng(0, used=400), 1: eng(1), 2: eng(2, kvt=False)}
    dp_kv = {0: 0, 1: 0, 2: 0}
    kv = TransformCost(CFG, live, dp_kv)
    assert kv.possible((0, 1)) and not kv.possible((1, 2)) and not kv.possible((0, 9))
    assert kv.adopt_ms((0, 1)) == pytest.approx(4.0 + 200 * 1000 / 1e9 * 1000)
    assert kv.may_adopt((0, 1))
    dp_kv[1] = 30_000  # the round sends engine 1 more DP work: its KV moves too
    assert kv.used_kv(1) == 30_000 and not kv.may_adopt((0, 1))
    assert not TransformCost(dataclasses.replace(CFG, kv_transform=False), live, dp_kv).possible((0, 1))


def test_a_round_does_not_adopt_where_a_member_has_no_room_for_the_slices_it_would_receive():
    """Two engines of 1,000 KV tokens, each 700 used by its own DP requests: at width 2 each must carve the other's
    700 tokens in half-head slots, 1,400 of them, from its 300 free tokens' 600; the workers would bind hard and
    pause both engines' DP work, so the round does not ask them to adopt."""
    cfg = dataclasses.replace(CFG, adopt_max_ms=1e9)  # the stall is not what refuses it
    full = TransformCost(cfg, {0: eng(0, used=700), 1: eng(1, used=700)}, {0: 0, 1: 0})
    assert not full.kv_fits((0, 1)) and not full.may_adopt((0, 1))
    room = TransformCost(cfg, {0: eng(0, used=300), 1: eng(1, used=300)}, {0: 0, 1: 0})
    assert room.kv_fits((0, 1)) and room.may_adopt((0, 1))  # 300 <= 2 x 700
    lopsided = TransformCost(cfg, {0: eng(0, used=900), 1: eng(1, used=300)}, {0: 0, 1: 0})
    assert not lopsided.kv_fits((0, 1))  # engine 1 carves 900 of its 1,400 slots, engine 0 300 of its 200: no
    assert TransformCost(cfg, {0: eng(0, used=900), 1: eng(1, used=100)}, {0: 0, 1: 0}).kv_fits((0, 1))
