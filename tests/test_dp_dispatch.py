"""DP dispatch alone (router.dp_dispatch): least loaded, cache-aware, and the rule each dispatch followed."""

from __future__ import annotations

import dataclasses

from flying.messages import QueuedRequest, RouterState
from flying.prefix import block_hashes, encode_chain
from router.config import PolicyConfig
from router.dp_dispatch import dp_score, to_dp
from router.engine_view import EngineView
from router.prefix_index import PrefixIndex
from router.round import Round
from router.snapshot import Snapshot

CFG = PolicyConfig(load_adaptation=False, priority=False, long_context=False, max_inflight_per_worker=4)


def eng(i, inflight=0, cap=1000, **kw):
    return EngineView(i, f"e{i}", inflight, cap, cap, num_engines=4, beat_ts=100.0, **kw)


def req(i="r", chain=(), keyed=False):
    return QueuedRequest(id=i, priority="normal", model="m", prompt_tokens=10, max_tokens=10, gateway="g",
                         enqueued_at=100.0, prefix=encode_chain(list(chain)), keyed=keyed)  # fmt: skip


def rnd(engines, cfg=CFG, prefixes=None, state=None):
    s = Snapshot(now=100.0, waiting=[], queued=0, engines=engines, groups=[], state=state or RouterState(),
                 prefixes=prefixes or PrefixIndex())  # fmt: skip
    return Round(s, cfg)


def test_least_loaded_with_a_free_slot_and_the_kv_for_it():
    r = rnd([eng(0, inflight=1), eng(1, inflight=4), eng(2, inflight=2, cap=5)])
    assert to_dp(r, req("a")) and to_dp(r, req("b")) and to_dp(r, req("c"))
    assert [(x.engine, x.rule) for x in r.out.dispatches] == [
        (0, "no-chain"),
        (0, "no-chain"),
        (0, "no-chain"),
    ]
    assert r.dp_inflight[0] == 4 and not to_dp(r, req("d")), "engine 0 is full, 1 too, 2 cannot hold it"


def test_cache_aware_follows_the_prefix_unless_loads_are_out_of_balance():
    index = PrefixIndex()
    engines = [eng(0, inflight=2), eng(1)]
    index.sync(engines)
    index.record(0, [11, 12, 13])
    r = rnd(engines, prefixes=index)
    assert to_dp(r, req(chain=[11, 12, 13, 14]))
    assert [(x.engine, x.rule) for x in r.out.dispatches] == [(0, "prefix")]
    tight = dataclasses.replace(
        CFG, balance_abs_threshold=1.0, balance_rel_threshold=1.0, max_inflight_per_worker=8
    )
    r = rnd([eng(0, inflight=3), eng(1)], tight, index)
    to_dp(r, req(chain=[11, 12]))
    assert [(x.engine, x.rule) for x in r.out.dispatches] == [(1, "imbalanced")]
    r = rnd(engines, dataclasses.replace(CFG, dispatch="least-loaded"), index)
    to_dp(r, req(chain=[11]))
    assert [(x.engine, x.rule) for x in r.out.dispatches] == [(1, "least-loaded")]


def test_recent_dispatches_count_twice_while_they_decay():
    cfg = dataclasses.replace(CFG, spread_s=2.0)
    r = rnd([eng(0, inflight=1), eng(1, inflight=1)], cfg, state=RouterState(recent={1: 2.0}, rate_ts=98.0))
    assert abs(dp_score(r, 1) - (1 + 2.0 / 2.718281828459045)) < 1e-9 and dp_score(r, 0) == 1
    to_dp(r, req())
    assert r.out.dispatches[0].engine == 0 and r.recent[0] == 1.0


def keyed(i: str, key: str, blocks: int) -> QueuedRequest:
    """A request with cache ``key`` and a prompt of ``blocks`` blocks of its own (shared with no other)."""
    prompt = [hash(i) % 1000 + 1000 * j for j in range(64 * blocks)]
    return req(i, block_hashes(prompt, key=key), keyed=True)


def test_a_cache_key_goes_where_it_went_before_whatever_its_prompt():
    index = PrefixIndex()
    engines = [eng(0, inflight=1), eng(1)]
    index.sync(engines)
    first = keyed("a", "user-7", 4)
    index.record(0, first.chain)
    r = rnd(engines, prefixes=index)
    assert to_dp(r, keyed("b", "user-7", 6)), "1 block of 7 held: below cache_threshold, followed for the key"
    assert to_dp(r, keyed("c", "user-8", 6)) and to_dp(r, req("d", keyed("d", "user-7", 6).chain))
    assert [(x.request.id, x.engine, x.rule) for x in r.out.dispatches] == [
        ("b", 0, "prefix"),
        ("c", 1, "no-match"),  # another key: least loaded
        ("d", 1, "no-match"),  # the same chain without the key's rule: the threshold applies
    ]


def test_a_cache_key_yields_to_a_full_engine_and_to_imbalance():
    index = PrefixIndex()
    engines = [eng(0, inflight=4), eng(1)]
    index.sync(engines)
    index.record(0, keyed("a", "k", 1).chain)
    r = rnd(engines, prefixes=index)
    assert to_dp(r, keyed("b", "k", 1)) and r.out.dispatches[-1].engine == 1, "no room on 0"
    tight = dataclasses.replace(
        CFG, balance_abs_threshold=1.0, balance_rel_threshold=1.0, max_inflight_per_worker=8
    )
    r = rnd([eng(0, inflight=3), eng(1)], tight, index)
    assert to_dp(r, keyed("c", "k", 1)) and (r.out.dispatches[-1].engine, r.out.dispatches[-1].rule) == (
        1,
        "imbalanced",
    )
