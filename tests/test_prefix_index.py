"""The router's mirror of the engines' prefix caches (router.prefix_index)."""

from __future__ import annotations

from flying.prefix import BLOCK, block_hashes
from router.policy import EngineView
from router.prefix_index import PrefixIndex


def eng(i: int, kv: int = 100 * BLOCK, **kw) -> EngineView:
    return EngineView(i, f"http://e{i}", 0, kv, kv, **kw)


def test_match_counts_leading_blocks_held_including_this_rounds():
    idx = PrefixIndex()
    idx.sync([eng(0)])
    a = block_hashes(list(range(4 * BLOCK)))
    idx.record(0, a[:2])
    assert idx.match(0, a) == 2 and idx.match(1, a) == 0
    assert idx.match(0, a, sent=set(a[2:3])) == 3
    assert idx.match(0, block_hashes([7] + list(range(1, 4 * BLOCK)))) == 0, "block 0 differs: nothing"


def test_capacity_is_the_engines_kv_in_blocks_and_the_deep_blocks_go_first():
    idx = PrefixIndex()
    idx.sync([eng(0, kv=6 * BLOCK)])
    shared = list(range(3 * BLOCK))
    a = block_hashes(shared + [1] * 3 * BLOCK)
    b = block_hashes(shared + [2] * 3 * BLOCK)
    idx.record(0, a)
    idx.record(0, b)  # 9 distinct blocks for 6 places: a's deep blocks are evicted, the shared ones stay
    assert idx.blocks(0) == 6
    assert idx.match(0, b) == 6 and idx.match(0, a) == 3


def test_an_engine_is_forgotten_when_it_restarts_or_leaves_and_kept_through_a_bind():
    """The workers keep the radix tree through a bind and a release; a bound engine records nothing (its TP
    requests bypass the tree)."""
    chain = block_hashes(list(range(2 * BLOCK)))
    other = block_hashes(list(range(5, 5 + 2 * BLOCK)))

    def fresh() -> PrefixIndex:
        idx = PrefixIndex()
        idx.sync([eng(0, launch_id="L1"), eng(1)])
        idx.record(0, chain)
        return idx

    idx = fresh()
    assert idx.sync([eng(0, launch_id="L1"), eng(1)]) == [] and idx.match(0, chain) == 2
    for why in ([eng(0, launch_id="L2")], [eng(1)]):  # restarted; gone (heartbeat expired)
        idx = fresh()
        assert idx.sync(why) == [0], why
        assert idx.match(0, chain) == 0
    idx = fresh()
    for bound in ([eng(0, launch_id="L1", pending=3)], [eng(0, launch_id="L1", mode="tp", epoch=3)]):
        assert idx.sync(bound) == [] and idx.match(0, chain) == 2, "the tree outlives the bind"
        idx.record(0, other)
        assert idx.match(0, other) == 0, "a TP request does not fill the tree"
    idx.sync([eng(0, launch_id="L1")])  # released: back in DP, with what it held before
    idx.record(0, other)
    assert idx.match(0, chain) == 2 and idx.match(0, other) == 2


def test_holders_are_the_engines_whose_entries_hold_a_hash_through_eviction_restart_and_loss():
    idx = PrefixIndex()
    idx.sync([eng(0, kv=2 * BLOCK), eng(1, launch_id="a")])
    a, b = block_hashes(list(range(2 * BLOCK))), block_hashes(list(range(9, 9 + 2 * BLOCK)))
    idx.record(0, a)
    idx.record(1, a)
    assert set(idx.holders(a[0])) == {0, 1} and set(idx.holders(a[1])) == {0, 1}
    idx.record(0, b)  # engine 0 holds 2 blocks: a's are evicted
    assert set(idx.holders(a[0])) == {1} and set(idx.holders(b[0])) == {0}
    idx.sync([eng(0, kv=2 * BLOCK), eng(1, launch_id="b")])  # engine 1 restarted
    assert not idx.holders(a[0]) and set(idx.holders(b[1])) == {0}
    idx.sync([eng(1, launch_id="b")])  # engine 0 gone
    assert not idx.holders(b[0]) and not idx._holders, "no hash is left without a holder"
