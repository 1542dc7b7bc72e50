"""Each node's load width for this round, from the planner (:mod:`router.planner`): 1 keeps its engines in DP,
w >= 2 binds them into load groups of w engines (their large steps sequence-parallel, small ones TP).

The demand the planner plays forward is measured here: the admission rate and token mix (exponential averages over
half the planner's horizon, from the gateways' monotonic counters) and, per node, the prompt tokens queued for it (its
share of the global queue) and on its engines, and its running sequences. The router's state keeps each node's
width, so a restarted router resumes it. ``busy`` is the planner's verdict, apart from the load groups it allows
(``max_width``, ``off`` load): no node is predicted to serve better bound, so priority and long-context
groups take no busy engines and long groups park.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import msgspec

from flying.groups import widths as group_widths
from flying.messages import Group, RouterState
from router.decision import PlanNote
from router.planner import Demand, Targets, choose
from router.round import Round
from router.snapshot import Snapshot

DEFAULT_PROMPT = 512.0  # tokens: the mix assumed before any request was measured
DEFAULT_OUTPUT = 128.0
PLAN_EVERY_S = 0.5  # seconds: rounds closer together than this keep the widths last planned ...
UNFORESEEN = 2.0  # ... unless a request arrived whose prompt is more than this many times the mix's mean


def ewma(old: float, count: float, was: float, dt: float, tau: float) -> float:
    """An exponentially weighted rate: each unit counted adds 1/tau, the sum decays with time constant tau."""
    new = count - was if count >= was else 0.0
    return old * math.exp(-dt / tau) + new / tau


def measure(state: RouterState, s: Snapshot, tau: float) -> RouterState:
    """The admission rate (requests/s), prompt and output tokens/s and high-priority requests/s, from the counters
    in ``s``; and the prompt tokens dispatched and how many of them repeat (:mod:`router.reuse`). A counter that
    went back (Redis flushed, another router took over) restarts the count."""
    dt = max(0.0, s.now - state.rate_ts) if state.rate_ts else 0.0
    if not state.rate_ts or s.admitted < state.admitted:
        state = msgspec.structs.replace(
            state,
            admitted=s.admitted,
            prompt_tokens=s.prompt_tokens,
            output_tokens=s.output_tokens,
            high=s.admitted_high,
        )
    was = state.reuse if s.reuse[0] >= state.reuse[0] else (0, 0)
    return msgspec.structs.replace(
        state,
        dispatched_rate=ewma(state.dispatched_rate, s.reuse[0], was[0], dt, tau),
        reused_rate=ewma(state.reused_rate, s.reuse[1], was[1], dt, tau),
        reuse=s.reuse,
        rate=ewma(state.rate, s.admitted, state.admitted, dt, tau),
        prompt_rate=ewma(state.prompt_rate, s.prompt_tokens, state.prompt_tokens, dt, tau),
        output_rate=ewma(state.output_rate, s.output_tokens, state.output_tokens, dt, tau),
        high_rate=ewma(state.high_rate, s.admitted_high, state.high, dt, tau),
        rate_ts=s.now,
        admitted=s.admitted,
        prompt_tokens=s.prompt_tokens,
        output_tokens=s.output_tokens,
        high=s.admitted_high,
    )


def forming(groups: Iterable[Group], now: float, ack_timeout_s: float) -> bool:
    """A load group binds at its members' next step boundary (hard or adoption; not one that drains), for at
    most ``ack_timeout_s`` so far, or formed this very round (the requests that waited for it go to it now)."""
    return any(
        g.reason == "load"
        and g.preempt == "hard"
        and (
            (g.state == "binding" and now - g.since <= ack_timeout_s)
            or (g.state == "bound" and g.since >= now)
        )
        for g in groups
    )


def reuse_share(st: RouterState) -> float:
    """The share of the recent prompt tokens a prefix cache could hold (0 before any was measured). Without
    dispatches both rates decay alike: the share stays the last measured one."""
    return min(1.0, st.reused_rate / st.dispatched_rate) if st.dispatched_rate > 1e-9 else 0.0


def token_mix(st: RouterState) -> tuple[float, float]:
    """Mean prompt and output tokens of the recent admissions (the defaults before any)."""
    if st.rate > 1e-6:
        return st.prompt_rate / st.rate, st.output_rate / st.rate
    return DEFAULT_PROMPT, DEFAULT_OUTPUT


def queued_work(s: Snapshot) -> tuple[float, float]:
    """Prompt tokens and requests the whole queue holds for DP or load groups (the head's, scaled to the queue's
    depth; long requests apart: they wait for groups of their own)."""
    long = s.too_long
    tokens = sum(r.prompt_tokens for r in s.waiting) - sum(r.prompt_tokens for r in long)
    scale = s.queued / len(s.waiting) if s.waiting else 0.0
    return tokens * scale, (len(s.waiting) - len(long)) * scale


def node_demand(rnd: Round, engines: list[int], queued: tuple[float, float]) -> Demand:
    """What a node's ``engines`` must serve: their share of the arrivals and of the ``queued`` work (prompt
    tokens, requests: :func:`queued_work`), and their own work."""
    st = rnd.out.state
    share = len(engines) / max(len(rnd.live), 1)
    rate = st.rate
    prompt, output = token_mix(st)
    running = sum(rnd.live[e].running for e in engines)
    waiting = sum(rnd.live[e].waiting for e in engines)
    return Demand(
        engines=len(engines),
        rate=rate * share,
        prompt=prompt,
        output=output,
        backlog=queued[0] * share + waiting * prompt,
        waiting=queued[1] * share + waiting,
        decoding=running,
        high_share=min(1.0, st.high_rate / rate) if rate > 1e-6 else 0.0,
        cached=reuse_share(st),
    )


def unforeseen(state: RouterState, s: Snapshot) -> bool:
    """A request arrived since the last plan whose prompt the measured mix did not foresee (more than
    :data:`UNFORESEEN` times its mean): plan again before it is placed (at low load it may want a group)."""
    mean = token_mix(state)[0]
    return any(r.enqueued_at > state.planned_at and r.prompt_tokens > UNFORESEEN * mean for r in s.waiting)


def current_width(rnd: Round, pool: tuple[str, int, int]) -> int:
    """The width node ``pool`` is planned at (the router's state), else its load groups' (1: none)."""
    node = pool_name(pool)
    if node in rnd.out.state.widths:
        return rnd.out.state.widths[node]
    return max(
        (
            g.width
            for g in rnd.groups.values()
            if g.reason == "load" and g.leader in rnd.live and rnd.live[g.leader].pool == pool
        ),
        default=1,
    )


def pool_name(pool: tuple[str, int, int]) -> str:
    """A node's key in the router's state (as :attr:`EngineView.node_key`)."""
    return pool[0] or str(pool[1])


def update(rnd: Round) -> None:
    """Plan every node's width for this round; note each change with the predictions that chose it."""
    cfg, s = rnd.cfg, rnd.s
    targets = Targets(cfg.ttft_target_high_ms, cfg.ttft_target_normal_ms, cfg.horizon_s, cfg.tpot_target_ms)
    state = measure(rnd.out.state, s, cfg.horizon_s / 2)
    rnd.set_state(state)
    pools: dict[tuple[str, int, int], list[int]] = {}
    for e in s.engines:
        pools.setdefault(e.pool, []).append(e.engine)
    if (
        state.planned_at
        and 0 <= s.now - state.planned_at < PLAN_EVERY_S
        and all(pool_name(p) in state.widths for p in pools)
        and not unforeseen(state, s)
    ):  # planned a moment ago, for the work that has come since: the same widths
        rnd.set_plan({pool: state.widths[pool_name(pool)] for pool in pools})
        return
    widths: dict[str, int] = {}
    queued = queued_work(s)
    light = False  # some node is predicted to serve better bound (whether load groups may form or not)
    for pool, engines in sorted(pools.items(), key=lambda kv: kv[0][1]):
        node, now = pool_name(pool), current_width(rnd, pool)
        every = [w for w in group_widths(pool[2]) if w <= len(engines)]
        if len(every) < 2:
            widths[node] = 1
            continue
        allowed = [w for w in every if w <= cfg.max_width] if cfg.on("load") else [1]
        if s.probe.get(node) in allowed:  # an idle node the router measures a group's steps on (router.probe)
            widths[node] = s.probe[node]
            continue
        d = node_demand(rnd, engines, queued)
        choice = choose(s.cost, every, now if now in every else 1, d, targets, s.sp_threshold)
        light = light or choice.width > 1
        if choice.width not in allowed:  # load groups narrower than the best: the best of those allowed
            choice = choose(s.cost, allowed, now if now in allowed else 1, d, targets, s.sp_threshold)
        widths[node] = choice.width
        if choice.width != now and len(allowed) > 1:
            rnd.note(PlanNote(node, now, choice, d))
    busy = not light
    changed = s.now if busy != state.busy else state.changed_at
    rnd.update_state(widths=widths, busy=busy, changed_at=changed, planned_at=s.now)
    rnd.set_plan({pool: widths[pool_name(pool)] for pool in pools})
