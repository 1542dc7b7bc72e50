"""How much of the dispatched prompts repeats (router.reuse): the planner's DP hit share."""

from __future__ import annotations

from flying.prefix import BLOCK
from router.engine_view import EngineView
from router.reuse import Reuse


def view(e: int, node: str, kv: int = 100 * BLOCK) -> EngineView:
    return EngineView(e, f"e{e}", 0, kv, kv, node=node)


def test_a_prompt_repeats_as_far_as_its_chain_was_dispatched_to_its_node_before():
    r = Reuse()
    r.sync([view(0, "a"), view(1, "a"), view(2, "b")])
    r.observe(0, (1, 2, 3), 3 * BLOCK + 10)
    r.observe(1, (1, 2, 9), 3 * BLOCK + 10)  # another engine of the node: two blocks repeat
    r.observe(2, (1, 2, 3), 3 * BLOCK + 10)  # another node: nothing
    r.observe(0, (1, 2, 3), 3 * BLOCK)  # a whole prompt repeats but its last token is computed
    assert r.counters == (4 * (3 * BLOCK) + 30, 2 * BLOCK + 3 * BLOCK - 1)


def test_a_nodes_chains_are_held_within_its_kv_shallow_blocks_last():
    r = Reuse()
    r.sync([view(0, "a", kv=4 * BLOCK)])
    r.observe(0, (1, 2, 3), 3 * BLOCK)
    r.observe(0, (1, 7, 8), 3 * BLOCK)  # 5 blocks seen, 4 held: the deep 3 goes first
    before = r.counters[1]
    r.observe(0, (1, 2, 3), 4 * BLOCK)
    assert r.counters[1] - before == 2 * BLOCK
