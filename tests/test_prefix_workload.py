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
