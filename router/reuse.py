"""How much of the traffic's prompts repeat: what a node's prefix caches could hold of each request.

The planner needs the prefix caches' hit share: a DP engine and a bound group (which keeps a cache of its own)
prefill only what their caches lack. Measured on the engines it would depend on the configuration the planner
chose. So the router measures the traffic instead: per node, an LRU of the block
hashes (flying.prefix) of every prompt it dispatched there, DP or TP, bounded by the node's KV in blocks; a
request's reuse is the longest prefix of its chain found there. Cache-aware dispatch brings DP close to it. The
counters are cumulative (the regime turns them into rates); a restarted router starts again from nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from flying.prefix import BLOCK
from router.engine_view import EngineView

MAX_NODE_BLOCKS = 1 << 16  # a node's LRU holds at most this many blocks (4M tokens: eight H200s' KV is 2.4M)


class Reuse:
    def __init__(self, block: int = BLOCK) -> None:
        self.block = block
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._cap: dict[str, int] = {}  # node -> its KV in blocks
        self._node: dict[int, str] = {}  # engine -> its node
        self.prompt_tokens = 0  # prompt tokens dispatched ...
        self.reused_tokens = 0  # ... and how many of them a cache of their node could have held

    def sync(self, engines: Iterable[EngineView]) -> None:
        """Each node's engines and capacity from a snapshot's live engines."""
        cap: dict[str, int] = {}
        for e in engines:
            cap[e.node_key] = cap.get(e.node_key, 0) + e.max_total_tokens // self.block
            self._node[e.engine] = e.node_key
        self._cap = {node: min(n, MAX_NODE_BLOCKS) for node, n in cap.items()}

    @property
    def counters(self) -> tuple[int, int]:
        """(prompt tokens dispatched, those a cache of their node could have held), since the router started."""
        return self.prompt_tokens, self.reused_tokens

    def observe(self, engine: int, chain: Sequence[int], prompt_tokens: int) -> None:
        """A request with ``chain`` and ``prompt_tokens`` was dispatched to ``engine`` (DP, or a group it is in):
        count what repeats in its node, then hold its chain there (deepest block first, so shared shallow blocks
        are evicted last)."""
        node = self._node.get(engine, "")
        lru = self._lru.setdefault(node, OrderedDict())
        n = 0
        for h in chain:
            if h not in lru:
                break
            n += 1
        self.prompt_tokens += prompt_tokens
        self.reused_tokens += min(n * self.block, max(prompt_tokens - 1, 0))  # (its last token is computed)
        for h in reversed(chain):
            lru[h] = None
            lru.move_to_end(h)
        cap = self._cap.get(node, 0)
        while len(lru) > cap:
            lru.popitem(last=False)
