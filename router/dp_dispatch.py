"""Where a request served in DP goes: the least loaded DP engine with a free slot, or, cache-aware (``dispatch``),
the one whose prefix cache probably holds most of its prompt (:mod:`router.prefix_index`) while loads are in
balance. Load counts the requests sent within about ``spread_s`` twice (a released group's follower, whose TP
requests its leader owns, would otherwise take every new request at once). The rule each dispatch followed is
its :data:`router.decision.DpRule`."""

from __future__ import annotations

from flying.messages import QueuedRequest
from router.decision import Dispatch, DpRule
from router.engine_view import EngineView
from router.round import Round


def to_dp(rnd: Round, r: QueuedRequest) -> bool:
    """Dispatch ``r`` to a DP engine with a free slot and the KV for it; False if there is none."""
    taken = rnd.in_groups()
    fits = [
        e
        for e in rnd.s.engines
        if e.mode == "dp"
        and not e.pending
        and e.engine not in taken
        and not rnd.avoid(r, (e.engine,))
        and rnd.dp_inflight[e.engine] < rnd.cfg.max_inflight_per_worker
        and e.max_total_tokens >= r.kv_tokens
    ]
    if not fits:
        return False
    best, rule = pick_dp(rnd, r, fits)
    rnd.sent.setdefault(best.engine, set()).update(r.chain)
    rnd.dp_inflight[best.engine] += 1
    if rnd.cfg.spread_s > 0:
        rnd.recent[best.engine] = rnd.recent.get(best.engine, 0.0) + 1
    rnd.dp_kv[best.engine] += r.kv_tokens
    rnd.out.dispatches.append(Dispatch(r, best.engine, best.url, rule=rule))
    return True


def pick_dp(rnd: Round, r: QueuedRequest, fits: list[EngineView]) -> tuple[EngineView, DpRule]:
    """Cache-aware (SGLang's model gateway's rule): the engine holding the longest prefix of ``r``'s chain, the
    least loaded of those, when it holds at least ``cache_threshold`` of the chain's blocks and the
    candidates' loads are balanced (not both more than ``balance_abs_threshold`` apart and the highest above
    ``balance_rel_threshold`` times the lowest); otherwise, and for a request without a chain, least loaded. A
    request with a cache key (``keyed``: its chain starts with the key's hash) goes where its key went before,
    whatever the share of its prompt found there: the engine holding the key and most of the prompt."""
    key = lambda e: dp_key(rnd, e)  # noqa: E731
    least = min(fits, key=key)
    chain = r.chain
    if rnd.cfg.dispatch != "cache-aware":
        return least, "least-loaded"
    if not chain:
        return least, "no-chain"
    if imbalanced(rnd, fits):
        return least, "imbalanced"
    held = {e.engine: rnd.s.prefixes.match(e.engine, chain, rnd.sent.get(e.engine, ())) for e in fits}
    top = max(held.values())
    if top == 0 or (top < rnd.cfg.cache_threshold * len(chain) and not r.keyed):
        return least, "no-match"
    return min((e for e in fits if held[e.engine] == top), key=key), "prefix"


def imbalanced(rnd: Round, fits: list[EngineView]) -> bool:
    loads = [dp_score(rnd, e.engine) for e in fits]
    hi, lo = max(loads), min(loads)
    return hi - lo > rnd.cfg.balance_abs_threshold and hi > rnd.cfg.balance_rel_threshold * lo


def dp_key(rnd: Round, e: EngineView) -> tuple[float, int, int]:
    return dp_score(rnd, e.engine), -e.free_kv_tokens, e.engine


def dp_score(rnd: Round, e: int) -> float:
    """Least loaded first: requests in flight, those sent within about ``spread_s`` counted twice (their
    prefill is still ahead). Without it an engine that has just become free (a released group's member, whose
    TP requests its leader owns) takes every new request until its count catches up, all of them prefilling
    at once while the other engines only decode."""
    return rnd.dp_inflight[e] + rnd.recent.get(e, 0.0)
