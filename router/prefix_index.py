"""What each engine's prefix cache probably holds: the block hashes (flying.prefix) of the prompts it was sent.

The router cannot see the engines' radix caches; like SGLang's model gateway it mirrors them approximately from
its own dispatches. Per engine an LRU of chain hashes, bounded by the engine's KV in blocks
(``max_total_tokens // BLOCK``: a radix cache holds at most the whole pool), with a chain recorded deepest block
first, so the shallow blocks a prompt shares with others are the most recent and the deep ones are evicted
first, as a radix cache evicts leaves (a client's cache key heads its requests' chains, flying.prefix: it is the
most recent entry of all and the last evicted). An engine's entries are forgotten when it restarts (a new launch id) or leaves
the live set. They are kept while it is bound: the workers keep the radix tree through a bind and a release
(worker_ext/sglang_patches/prefix_cache.py; a group's TP requests bypass it, and its KV demand may evict unlocked
DP prefixes, which the index does not see), and nothing is recorded for a bound engine.

The policy (router.policy) only reads it (:meth:`PrefixIndex.match`); the caller (the router's dispatcher, the
simulator) updates it: :meth:`sync` with the engines of each snapshot before the round, :meth:`record` with each
DP dispatch the round decided. A restarted router starts with an empty index (the engines' caches outlive it;
its affinity comes back with the traffic).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

from flying.prefix import BLOCK
from router.engine_view import EngineView


class PrefixIndex:
    def __init__(self, block: int = BLOCK) -> None:
        self.block = block
        self._lru: dict[int, OrderedDict[int, None]] = {}
        self._cap: dict[int, int] = {}
        self._launch: dict[int, str] = {}  # the launch the entries are valid for
        self._dp: dict[int, bool] = {}  # in DP, no bind read: its prompts go through the prefix cache
        self._holders: dict[int, set[int]] = {}  # hash -> engines whose entries hold it (the LRUs, inverted)

    def sync(self, engines: Iterable[EngineView]) -> list[int]:
        """Bring the index in line with a snapshot's live engines; returns those whose entries were forgotten."""
        forgotten, seen = [], set()
        for e in engines:
            engine = e.engine
            seen.add(engine)
            if self._launch.get(engine) != e.launch_id or engine not in self._lru:
                if self._lru.get(engine):
                    forgotten.append(engine)
                self._forget(engine)
                self._lru[engine] = OrderedDict()
                self._launch[engine] = e.launch_id
            self._dp[engine] = e.mode == "dp" and not e.epoch and not e.pending
            self._cap[engine] = max(1, e.max_total_tokens // self.block)
        for engine in [e for e in self._lru if e not in seen]:
            if self._lru.get(engine):
                forgotten.append(engine)
            self._forget(engine)
            del self._lru[engine]
            self._launch.pop(engine, None)
            self._dp.pop(engine, None)
            self._cap.pop(engine, None)
        return sorted(forgotten)

    def match(self, engine: int, chain: Sequence[int], sent: Collection[int] = ()) -> int:
        """How many leading blocks of ``chain`` the engine probably holds (also counting hashes in ``sent``: what
        the current round has sent it)."""
        lru: Collection[int] = self._lru.get(engine, ())
        n = 0
        for h in chain:
            if h not in lru and h not in sent:
                break
            n += 1
        return n

    def record(self, engine: int, chain: Sequence[int]) -> None:
        """The engine was sent a prompt with ``chain`` (its cache will hold it): touch deepest first, evict the
        least recently used beyond its capacity. Ignored for an engine :meth:`sync` does not know as in DP (a
        bound engine's TP requests bypass its cache)."""
        if not self._dp.get(engine, False):
            return
        lru = self._lru[engine]
        for h in reversed(chain):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._holders.setdefault(h, set()).add(engine)
        while len(lru) > self._cap[engine]:
            self._drop_holder(lru.popitem(last=False)[0], engine)

    def holders(self, h: int) -> Collection[int]:
        """The engines whose entries hold hash ``h`` (those :meth:`match` finds at least one block on, for a
        chain starting with ``h``), without a scan of every engine."""
        return self._holders.get(h, ())

    def _forget(self, engine: int) -> None:
        for h in self._lru.get(engine, ()):
            self._drop_holder(h, engine)

    def _drop_holder(self, h: int, engine: int) -> None:
        engines = self._holders[h]
        engines.discard(engine)
        if not engines:
            del self._holders[h]

    def blocks(self, engine: int) -> int:
        """Hashes held for ``engine``."""
        return len(self._lru.get(engine, ()))
