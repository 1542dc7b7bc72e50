"""A simulated engine's prefix cache: an LRU of the blocks an engine has computed (prompts when they start, prompt
and answer when they finish, as SGLang's radix cache inserts them), bounded by its KV less what its running
requests reserve for their outputs; a request that starts prefills only the blocks after its longest cached
prefix (at least its last token). It is kept through a bind and a release, as the workers keep SGLang's radix tree
(worker_ext/sglang_patches/prefix_cache.py): a group's requests use the group's own cache instead, and the group's
KV demand evicts from it (``sim.simulator.SimGroup.trim_caches``). Every group (bound, static TP, shift) has one of
its own over its KV (``SimGroup(cache=True)``), empty when it forms, as the workers' group tree is.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from flying.prefix import BLOCK

# the simulated engines' caches match whole prompts (the router's chains stop at MAX_BLOCKS)
UNCAPPED = 1 << 30


class PrefixCache:
    def __init__(self, block: int = BLOCK) -> None:
        self.block = block
        self.lru: OrderedDict[int, None] = OrderedDict()

    def hit(self, chain: Sequence[int]) -> int:
        """Leading blocks of ``chain`` held (touched: they are in use again)."""
        n = 0
        for h in chain:
            if h not in self.lru:
                break
            n += 1
        for h in reversed(chain[:n]):
            self.lru.move_to_end(h)
        return n

    def insert(self, chain: Sequence[int], room_tokens: int) -> None:
        """Hold ``chain`` (deepest first: shared shallow blocks outlive private deep ones), within ``room_tokens``."""
        for h in reversed(chain):
            self.lru[h] = None
            self.lru.move_to_end(h)
        while self.lru and len(self.lru) * self.block > room_tokens:
            self.lru.popitem(last=False)
