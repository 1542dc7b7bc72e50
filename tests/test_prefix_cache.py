"""A simulated engine's prefix cache (sim.prefix_cache)."""

from __future__ import annotations

from flying.prefix import BLOCK, block_hashes
from sim.prefix_cache import PrefixCache


def test_hits_are_leading_blocks_and_eviction_keeps_the_shared_ones():
    c = PrefixCache()
    shared = list(range(2 * BLOCK))
    a = block_hashes(shared + [1] * 2 * BLOCK)
    b = block_hashes(shared + [2] * 2 * BLOCK)
    assert c.hit(a) == 0
    c.insert(a, room_tokens=100 * BLOCK)
    assert c.hit(a) == 4 and c.hit(b) == 2
    c.insert(b, room_tokens=5 * BLOCK)  # 6 distinct blocks for 5 places: a's deepest goes
    assert c.hit(b) == 4 and c.hit(a) == 3
    c.insert([], room_tokens=2 * BLOCK)  # less room (running requests reserve KV): the least recent go
    assert c.hit(b) == 2 and c.hit(a) == 2
