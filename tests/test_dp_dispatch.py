"""DP dispatch alone (router.dp_dispatch): least loaded, cache-aware, and the rule each dispatch followed."""

from __future__ import annotations

import dataclasses
import random

import msgspec

from flying.messages import QueuedRequest, RouterState
from flying.prefix import block_hashes, encode_chain
from router import dp_dispatch, placement
from router import round as round_
from router.config import MANUAL_OFF, Limits, PolicyConfig
from router.decision import Dispatch
from router.dp_dispatch import dp_score, to_dp
from router.engine_view import EngineView
from router.policy import decide
from router.prefix_index import PrefixIndex
from router.round import Round
from router.snapshot import Snapshot

CFG = PolicyConfig(off=MANUAL_OFF)
LIMITS = Limits(max_inflight_per_worker=4)


def eng(i, inflight=0, cap=1000, **kw):
    return EngineView(i, f"e{i}", inflight, cap, cap, num_engines=4, beat_ts=100.0, **kw)


def req(i="r", chain=(), keyed=False):
    return QueuedRequest(id=i, priority="normal", model="m", prompt_tokens=10, max_tokens=10, gateway="g",
                         enqueued_at=100.0, prefix=encode_chain(list(chain)), keyed=keyed)  # fmt: skip


def rnd(engines, cfg=CFG, prefixes=None, state=None, limits=LIMITS):
    s = Snapshot(now=100.0, waiting=[], queued=0, engines=engines, groups=[], state=state or RouterState(),
                 prefixes=prefixes or PrefixIndex(), limits=limits)  # fmt: skip
    return Round(s, cfg)


def tight(monkeypatch) -> Limits:
    """Loads out of balance as soon as they differ; 8 requests an engine."""
    monkeypatch.setattr(dp_dispatch, "BALANCE_ABS", 1.0)
    monkeypatch.setattr(dp_dispatch, "BALANCE_REL", 1.0)
    return Limits(max_inflight_per_worker=8)


def test_least_loaded_with_a_free_slot_and_the_kv_for_it():
    r = rnd([eng(0, inflight=1), eng(1, inflight=4), eng(2, inflight=2, cap=5)])
    assert to_dp(r, req("a")) and to_dp(r, req("b")) and to_dp(r, req("c"))
    assert [(x.engine, x.rule) for x in r.out.dispatches] == [
        (0, "no-chain"),
        (0, "no-chain"),
        (0, "no-chain"),
    ]
    assert r.dp_inflight[0] == 4 and not to_dp(r, req("d")), "engine 0 is full, 1 too, 2 cannot hold it"


def test_cache_aware_follows_the_prefix_unless_loads_are_out_of_balance(monkeypatch):
    index = PrefixIndex()
    engines = [eng(0, inflight=2), eng(1)]
    index.sync(engines)
    index.record(0, [11, 12, 13])
    r = rnd(engines, prefixes=index)
    assert to_dp(r, req(chain=[11, 12, 13, 14]))
    assert [(x.engine, x.rule) for x in r.out.dispatches] == [(0, "prefix")]
    r = rnd([eng(0, inflight=3), eng(1)], CFG, index, limits=tight(monkeypatch))
    to_dp(r, req(chain=[11, 12]))
    assert [(x.engine, x.rule) for x in r.out.dispatches] == [(1, "imbalanced")]
    r = rnd(engines, dataclasses.replace(CFG, dispatch="least-loaded"), index)
    to_dp(r, req(chain=[11]))
    assert [(x.engine, x.rule) for x in r.out.dispatches] == [(1, "least-loaded")]


def test_recent_dispatches_count_twice_while_they_decay(monkeypatch):
    monkeypatch.setattr(round_, "SPREAD_S", 2.0)
    r = rnd([eng(0, inflight=1), eng(1, inflight=1)], state=RouterState(recent={1: 2.0}, rate_ts=98.0))
    assert abs(dp_score(r, 1) - (1 + 2.0 / 2.718281828459045)) < 1e-9 and dp_score(r, 0) == 1
    to_dp(r, req())
    assert r.out.dispatches[0].engine == 0 and r.recent[0] == 1.0


# --- the round's candidate pool makes the decisions a scan of every engine made -------------------------------


def scan_to_dp(rnd_: Round, r: QueuedRequest) -> bool:
    """The reference: a scan of every engine per request (what :func:`to_dp` decided before its pool)."""
    taken = rnd_.in_groups()
    fits = [
        e
        for e in rnd_.s.engines
        if e.mode == "dp"
        and not e.pending
        and e.engine not in taken
        and not rnd_.avoid(r, (e.engine,))
        and rnd_.dp_inflight[e.engine] < rnd_.limits.max_inflight_per_worker
        and e.max_total_tokens >= r.kv_tokens
    ]
    if not fits:
        return False
    key = lambda e: (dp_score(rnd_, e.engine), -e.free_kv_tokens, e.engine)  # noqa: E731
    best, rule = min(fits, key=key), "least-loaded"
    chain = r.chain
    if rnd_.cfg.dispatch == "cache-aware":
        loads = [dp_score(rnd_, e.engine) for e in fits]
        hi, lo = max(loads), min(loads)
        rule = "no-chain" if not chain else "imbalanced"
        if chain and not (hi - lo > dp_dispatch.BALANCE_ABS and hi > dp_dispatch.BALANCE_REL * lo):
            held = {
                e.engine: rnd_.s.prefixes.match(e.engine, chain, rnd_.sent.get(e.engine, ())) for e in fits
            }
            top = max(held.values())
            rule = "no-match"
            if top and top >= dp_dispatch.CACHE_THRESHOLD * len(chain):
                best, rule = min((e for e in fits if held[e.engine] == top), key=key), "prefix"
    rnd_.sent.setdefault(best.engine, set()).update(chain)
    rnd_.dp_inflight[best.engine] += 1
    if round_.SPREAD_S > 0:
        rnd_.recent[best.engine] = rnd_.recent.get(best.engine, 0.0) + 1
    rnd_.dp_kv[best.engine] += r.kv_tokens
    rnd_.out.dispatches.append(Dispatch(r, best.engine, best.url, rule=rule))
    return True


def random_snapshot(seed: int) -> tuple[Snapshot, PolicyConfig, float, float]:
    """A cluster with mixed loads, KV sizes, modes, failed requests, prefix chains and groups; light or busy; the
    policy, and the spread (seconds) and balance threshold (requests) to run it with."""
    rng = random.Random(seed)
    n = rng.choice((2, 4, 8, 16))
    chains = [[rng.randrange(1, 50) + 100 * k for k in range(rng.randrange(1, 6))] for _ in range(6)]
    engines = []
    for i in range(n):
        cap = rng.choice((300, 1000, 1000, 4000))
        mode = "dp" if rng.random() < 0.85 else "tp"
        engines.append(EngineView(i, f"e{i}", rng.randrange(0, 10), cap - rng.randrange(0, 300), cap,
                                  mode=mode, epoch=0 if mode == "dp" else 1, pending=int(rng.random() < 0.05),
                                  num_engines=n, beat_ts=100.0, launch_id="l"))  # fmt: skip
    index = PrefixIndex()
    index.sync(engines)
    for e in engines:
        for c in rng.sample(chains, 2):
            index.record(e.engine, c)
    waiting = [
        QueuedRequest(id=f"q{k}", priority=rng.choice(("high", "normal", "normal", "low")), model="m",
                      prompt_tokens=rng.randrange(10, 1500), max_tokens=rng.randrange(1, 200), gateway="g",
                      enqueued_at=99.0 + rng.random(), failed_on=rng.choice((-1, -1, -1, rng.randrange(n))),
                      prefix=encode_chain(rng.choice(chains)[: rng.randrange(0, 6)] if rng.random() < 0.7 else []))
        for k in range(rng.randrange(1, 120))
    ]  # fmt: skip
    state = RouterState(busy=rng.random() < 0.6, recent={e: rng.random() * 3 for e in range(n)},
                        rate_ts=99.0)  # fmt: skip
    limits = Limits(max_inflight_per_worker=rng.choice((4, 8, 16)))
    spread = rng.choice((0.0, 3.0))
    cfg = PolicyConfig(dispatch=rng.choice(("cache-aware", "cache-aware", "least-loaded")))
    balance = rng.choice((2.0, 8.0))
    return Snapshot(now=100.0, waiting=waiting, queued=len(waiting), engines=engines, groups=[], state=state,
                    prefixes=index, limits=limits), cfg, spread, balance  # fmt: skip


def test_the_candidate_pool_decides_what_a_scan_of_every_engine_decided(monkeypatch):
    rules: dict[str, int] = {}
    for seed in range(200):
        s, cfg, spread, balance = random_snapshot(seed)
        monkeypatch.setattr(round_, "SPREAD_S", spread)
        monkeypatch.setattr(dp_dispatch, "BALANCE_ABS", balance)
        pooled = decide(s, cfg)
        with monkeypatch.context() as m:
            m.setattr(placement, "to_dp", scan_to_dp)
            scanned = decide(s, cfg)
        assert pooled == scanned, f"seed {seed}"
        for x in pooled.dispatches:
            rules[x.rule] = rules.get(x.rule, 0) + 1
    assert set(rules) == {"prefix", "no-chain", "no-match", "imbalanced", "least-loaded"}, rules
    assert min(rules.values()) >= 20, f"every rule is exercised: {rules}"


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


def test_a_cache_key_yields_to_a_full_engine_and_to_imbalance(monkeypatch):
    index = PrefixIndex()
    engines = [eng(0, inflight=4), eng(1)]
    index.sync(engines)
    index.record(0, keyed("a", "k", 1).chain)
    r = rnd(engines, prefixes=index)
    assert to_dp(r, keyed("b", "k", 1)) and r.out.dispatches[-1].engine == 1, "no room on 0"
    r = rnd([eng(0, inflight=3), eng(1)], CFG, index, limits=tight(monkeypatch))
    assert to_dp(r, keyed("c", "k", 1)) and (r.out.dispatches[-1].engine, r.out.dispatches[-1].rule) == (
        1,
        "imbalanced",
    )


def test_a_suspect_request_goes_only_to_an_engine_running_no_other_suspect():
    """An engine died holding it: alone among suspects, so a second death names it (gateway.waiting)."""
    engines = [eng(0), eng(1), eng(2)]
    s = Snapshot(now=100.0, waiting=[], queued=0, engines=engines, groups=[], state=RouterState(),
                 suspect_holders=frozenset({0}))  # fmt: skip
    r = Round(s, CFG)
    sus = [msgspec.structs.replace(req(f"s{i}"), suspect=1) for i in range(3)]
    assert to_dp(r, sus[0]) and to_dp(r, sus[1]) and not to_dp(r, sus[2]), "one suspect per engine"
    assert sorted(d.engine for d in r.out.dispatches) == [1, 2]
    assert to_dp(r, req("plain")) and r.out.dispatches[-1].engine == 0, "other requests go anywhere"
