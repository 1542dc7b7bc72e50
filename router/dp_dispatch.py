"""Where a request served in DP goes: the least loaded DP engine with a free slot, or, cache-aware (``dispatch``),
the one whose prefix cache probably holds most of its prompt (:mod:`router.prefix_index`) while loads are in
balance. Load counts the requests sent within about ``SPREAD_S`` twice (an engine that has just become free, e.g.
a released group's member holding few of its requests, would otherwise take every new request at once). The rule each dispatch followed is
its :data:`router.decision.DpRule`."""

from __future__ import annotations

import heapq
import weakref
from collections.abc import Callable
from typing import Any

from flying.messages import QueuedRequest
from router.decision import Dispatch, DpRule
from router.engine_view import EngineView
from router.round import Round

Fits = Callable[[int], bool] | None  # which engines may take a request (None: every open one)

# cache-aware dispatch follows a prefix held for at least this share of the prompt's blocks (SGLang's model
# gateway's default) ...
CACHE_THRESHOLD = 0.3
# ... while loads are in balance: not when the most loaded candidate has more than BALANCE_ABS requests above the
# least loaded and more than BALANCE_REL times its load
BALANCE_ABS = 8.0
BALANCE_REL = 1.5

# each round's pool, built at its first DP dispatch (and again when the engines in groups change)
_pools: weakref.WeakKeyDictionary[Round, DpPool] = weakref.WeakKeyDictionary()


def to_dp(rnd: Round, r: QueuedRequest) -> bool:
    """Dispatch ``r`` to a DP engine with a free slot and the KV for it; False if there is none."""
    pool = DpPool.of(rnd)
    if not pool.open:
        return False  # every DP engine is full: the rest of the queue waits without a scan
    fits = pool.fits(rnd, r)
    least = pool.least(rnd, fits)
    if least is None:
        return False
    chain = r.chain
    best, rule = pick_dp(rnd, chain, least, pool, fits, r.keyed)
    rnd.sent_dp(best.engine, chain, r.kv_tokens)
    pool.sent_to(rnd, best.engine, chain)
    rnd.dispatch(Dispatch(r, best.engine, best.url, rule=rule))
    if r.suspect:
        rnd.holds_suspect(best.engine)
    return True


def nothing_dispatches(rnd: Round, r: QueuedRequest) -> bool:
    """Placing ``r`` this round would do nothing: busy load, no group record (none to take it or to reuse), every
    DP engine full (the pool is current and empty: nothing frees a slot within a round), and ``r`` fits one engine
    (a long request may still bind). Lets a round skip the rest of a deep queue at once."""
    pool = _pools.get(rnd)
    return (
        pool is not None
        and not pool.open
        and rnd.out.state.busy
        and not rnd.groups
        and pool.taken is rnd.in_groups()
        and rnd.s.fits_one(r)
    )


def pick_dp(
    rnd: Round, chain: tuple[int, ...], least: EngineView, pool: DpPool, fits: Fits, keyed: bool = False
) -> tuple[EngineView, DpRule]:
    """Cache-aware (SGLang's model gateway's rule): the least loaded engine holding the longest prefix of
    ``chain``, if that is at least :data:`CACHE_THRESHOLD` of it and loads are balanced (:func:`imbalanced`);
    otherwise ``least``, the least loaded candidate. A ``keyed`` request (its chain starts with a cache key's
    hash) follows its key whatever share of the prompt is found there."""
    if rnd.cfg.dispatch != "cache-aware":
        return least, "least-loaded"
    if not chain:
        return least, "no-chain"
    if imbalanced(rnd, dp_score(rnd, least.engine), pool.highest(rnd, fits)):
        return least, "imbalanced"
    top, held = pool.deepest(rnd, chain, fits)
    if top == 0 or (top < CACHE_THRESHOLD * len(chain) and not keyed):
        return least, "no-match"
    _, _, best = min(dp_key(rnd, pool.open[e]) for e in held)  # (its last field: e)
    return pool.open[best], "prefix"


def imbalanced(rnd: Round, lo: float, hi: float) -> bool:
    """The candidates' loads (lowest ``lo``, highest ``hi``) are out of balance."""
    return hi - lo > BALANCE_ABS and hi > BALANCE_REL * lo


def dp_key(rnd: Round, e: EngineView) -> tuple[float, int, int]:
    return dp_score(rnd, e.engine), -e.free_kv_tokens, e.engine


def dp_score(rnd: Round, e: int) -> float:
    """Least loaded first: requests in flight, those sent within about ``SPREAD_S`` counted twice (their
    prefill is still ahead). Without it an engine that has just become free (a released group's member holding
    few of its TP requests) takes every new request until its count catches up, all of them prefilling
    at once while the other engines only decode."""
    return rnd.dp_inflight[e] + rnd.recent.get(e, 0.0)


class DpPool:
    """The engines a round may still send DP work to (in DP, no bind pending, in no group, a free slot), in two
    heaps by load, so that a dispatch costs a few heap operations instead of a scan. Rebuilt when the engines in
    groups change; :meth:`sent_to` pushes an engine's new entries, and older versions are skipped as stale."""

    def __init__(self, rnd: Round) -> None:
        self.taken = rnd.in_groups()
        cap = rnd.limits.max_inflight_per_worker
        self.open = {
            e.engine: e
            for e in rnd.s.engines
            if e.mode == "dp"
            and not e.pending
            and e.engine not in self.taken
            and rnd.dp_inflight[e.engine] < cap
        }
        self.version = dict.fromkeys(self.open, 0)
        self.low = [(dp_key(rnd, e), e.engine, 0) for e in self.open.values()]
        self.high = [(-dp_score(rnd, e), e, 0) for e in self.open]
        heapq.heapify(self.low)
        heapq.heapify(self.high)
        self.min_kv = min((e.dp_room for e in self.open.values()), default=0)
        self.sent_by: dict[int, set[int]] = {}  # chain hash -> engines this round sent it
        for e, hashes in rnd.sent.items():
            for h in hashes:
                self.sent_by.setdefault(h, set()).add(e)

    @classmethod
    def of(cls, rnd: Round) -> DpPool:
        """The round's pool, built again if the engines in groups changed since."""
        pool = _pools.get(rnd)
        if pool is None or pool.taken is not rnd.in_groups():
            pool = _pools[rnd] = cls(rnd)
        return pool

    def fits(self, rnd: Round, r: QueuedRequest) -> Fits:
        """Which open engines may take ``r``: the KV for it, ``r`` did not just fail there, and, for a suspect
        request, no other suspect runs there (None: all)."""
        kv = r.kv_tokens
        held = rnd.suspect_holders if r.suspect else ()
        if (
            kv <= self.min_kv
            and not held
            and (r.failed_on not in self.open or not rnd.avoid(r, (r.failed_on,)))
        ):
            return None
        return lambda e: self.open[e].dp_room >= kv and not rnd.avoid(r, (e,)) and e not in held

    def least(self, rnd: Round, fits: Fits) -> EngineView | None:
        """The least loaded open engine that ``fits`` (:func:`dp_key`), None if there is none."""
        e = self._top(self.low, fits)
        return None if e is None else self.open[e]

    def highest(self, rnd: Round, fits: Fits) -> float:
        """The highest load (:func:`dp_score`) among the open engines that ``fits`` (there is one)."""
        e = self._top(self.high, fits)
        return 0.0 if e is None else dp_score(rnd, e)

    def holding(self, rnd: Round, h: int) -> set[int]:
        """Open engines whose cache probably holds hash ``h`` (the prefix index's, or sent this round)."""
        out = {e for e in rnd.s.prefixes.holders(h) if e in self.open}
        return out | {e for e in self.sent_by.get(h, ()) if e in self.open}

    def deepest(self, rnd: Round, chain: tuple[int, ...], fits: Fits) -> tuple[int, set[int]]:
        """The most leading blocks of ``chain`` an open engine that ``fits`` probably holds, and the engines that
        hold that many (:meth:`PrefixIndex.match` for each, as set intersections along the chain)."""
        held = {e for e in self.holding(rnd, chain[0]) if fits is None or fits(e)}
        if not held:
            return 0, held
        depth = 1
        for h in chain[1:]:
            deeper = held.intersection(rnd.s.prefixes.holders(h))
            if h in self.sent_by:
                deeper |= held & self.sent_by[h]
            if not deeper:
                break
            held, depth = deeper, depth + 1
        return depth, held

    def sent_to(self, rnd: Round, e: int, chain: tuple[int, ...]) -> None:
        """``e`` was sent a request with ``chain``: its load changed (it leaves the pool when full)."""
        for h in chain:
            self.sent_by.setdefault(h, set()).add(e)
        if rnd.dp_inflight[e] >= rnd.limits.max_inflight_per_worker:
            del self.open[e]
            return
        v = self.version[e] = self.version[e] + 1
        heapq.heappush(self.low, (dp_key(rnd, self.open[e]), e, v))
        heapq.heappush(self.high, (-dp_score(rnd, e), e, v))

    def _top(self, heap: list[Any], fits: Fits) -> int | None:
        """The engine of the first current entry of ``heap`` that ``fits``; stale entries are dropped, current
        ones that do not fit are put back."""
        aside, found, version = [], None, self.version
        while heap:
            _, e, v = heap[0]
            if e not in self.open or version[e] != v:
                heapq.heappop(heap)
            elif fits is None or fits(e):
                found = e
                break
            else:
                aside.append(heapq.heappop(heap))
        for item in aside:
            heapq.heappush(heap, item)
        return found
