"""The shared-prefix workload (sim.prefix_workload): system prompts and multi-turn sessions."""

from __future__ import annotations

from flying.prefix import BLOCK
from sim.prefix_workload import shared_prefix_workload


def test_sessions_share_system_prompts_and_each_turn_extends_the_last():
    reqs = shared_prefix_workload(300, seed=1, system_prompts=3, system_tokens=10 * BLOCK, max_turns=4)
    assert len(reqs) == 300 and [r.at for r in reqs] == sorted(r.at for r in reqs)
    roots = {r.blocks[9] for r in reqs}  # the system prompt's last block
    assert len(roots) == 3
    assert all(len(r.blocks) == (r.prompt + r.output) // BLOCK for r in reqs)
    # a later turn's prompt holds an earlier turn's prompt and answer: its chain extends that one's
    heads = {r.blocks[-1] for r in reqs}
    followers = [r for r in reqs if any(h in heads for h in r.prompt_blocks[10:])]
    assert len(followers) > 50, "multi-turn sessions"
    assert max(r.prompt for r in reqs) > 10 * BLOCK + 300 + 64, "a turn carries the history"


def test_no_system_prompts_means_nothing_shared():
    reqs = shared_prefix_workload(100, seed=1, system_prompts=0, system_tokens=10 * BLOCK)
    blocks = [h for r in reqs for h in r.blocks]
    assert len(blocks) == len(set(blocks)) and all(r.prompt >= 10 * BLOCK for r in reqs)


def test_mooncake_rows_share_blocks_where_their_hash_ids_do_and_nothing_else():
    from loadgen.trace import MOONCAKE_BLOCK, MooncakeRow
    from sim.workload import mooncake_requests

    per = MOONCAKE_BLOCK // BLOCK
    a, b = mooncake_requests([MooncakeRow(0.0, 1100, 100, (5, 6, 7)), MooncakeRow(1.0, 1500, 10, (5, 6, 9))])
    assert len(a.prompt_blocks) == 1100 // BLOCK and len(a.blocks) == 1200 // BLOCK
    assert a.prompt_blocks[: 2 * per] == b.prompt_blocks[: 2 * per], "ids 5 and 6: 1,024 shared tokens"
    assert not set(a.blocks[2 * per :]) & set(b.blocks), "the rest is each one's own"
    assert len(set(a.blocks)) == len(a.blocks)
