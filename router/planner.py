"""The planner: per node, the width its load groups should have (1: DP), chosen by predicting each candidate.

Each round the node's demand (:class:`Demand`: the work queued and running on it, the measured arrival rate and
token mix) is played forward over ``horizon_s`` through every candidate width with the shared cost model
(:mod:`flying.cost_model`): width 1 is static DP, a width-w group runs its large steps sequence-parallel and its
small ones TP, so the candidates span static DP, static TP and Shift Parallelism. The prediction is a fluid one
(:func:`forecast`): one representative unit of each candidate, its prefill backlog and decoding batch advanced in
a few slices of the horizon. A candidate other than the current width pays its switch (``switch_ms`` and the KV
transformation of the running requests) as a stall at the start, so hysteresis comes from what a switch costs,
plus :data:`MARGIN` against near-ties. The objective (:func:`score`) is the predicted TTFT of each priority class
against its target, weighted by the class's share of arrivals, plus the predicted TPOT's excess over its target;
requests still waiting at the horizon count with the time their backlog takes to drain, so a candidate cannot look
good by starving the queue.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flying.cost_model import CostModel

SLICES = 8  # steps of the fluid prediction over the horizon
MARGIN = 0.05  # a switch must predict a score this much (relative) better than keeping the current width


@dataclass(frozen=True)
class Demand:
    """What one node must serve: measured arrivals (``rate`` per second, their mean ``prompt`` and ``output``
    tokens, ``high_share`` of them high priority) and the work it holds now (``backlog``: prompt tokens not yet
    prefilled, queued or on its engines, in ``waiting`` requests; ``decoding``: running sequences), over
    ``engines`` engines; ``cached``: the share of prompt tokens the prefix caches would hold (the prompts' measured
    repetition, router.reuse): a DP engine and a bound group alike prefill only the rest."""

    engines: int
    rate: float
    prompt: float
    output: float
    backlog: float = 0.0
    decoding: float = 0.0
    waiting: float = 0.0  # (0 with a backlog: as many as the mean prompt makes of it)
    high_share: float = 0.0
    cached: float = 0.0  # share of the prompt tokens the prefix caches hold


@dataclass(frozen=True)
class Targets:
    """Per-class TTFT targets (ms) the objective measures against, and the prediction's horizon (s)."""

    high_ms: float = 200.0
    normal_ms: float = 1000.0
    horizon_s: float = 10.0
    tpot_ms: float = 150.0


@dataclass(frozen=True)
class Forecast:
    """One candidate's prediction: mean TTFT of normal work and of high priority (ms), output tokens per second
    over the horizon, the switch's stall (ms) and the objective (lower is better)."""

    width: int
    ttft_ms: float
    high_ttft_ms: float
    tpot_ms: float
    tokens_per_s: float
    stall_ms: float
    score: float

    def __str__(self) -> str:
        where = "DP" if self.width == 1 else f"width {self.width}"
        return f"{where}: TTFT {self.ttft_ms:.0f} ms, TPOT {self.tpot_ms:.0f} ms predicted"


def forecast(
    cost: CostModel, width: int, d: Demand, t: Targets, sp_threshold: int, stall_ms: float = 0.0
) -> Forecast:
    """Play ``d`` forward over ``t.horizon_s`` on the node's engines grouped at ``width`` (units of ``width``
    engines, the arrivals spread evenly over them), after a stall of ``stall_ms`` (a switch). Each slice of the
    horizon first drains the unit's backlog in full chunks, then runs steady steps that prefill what arrived
    during the step before (or, where the arrivals outrun full chunks, the backlog grows)."""
    units = max(1, d.engines // width)
    sp = width > 1 and sp_threshold > 0
    chunk = cost.chunk_tokens * (width if sp else 1)
    cap = cost.max_running * (width if sp else 1)
    whole, output = max(d.prompt, 1.0), max(d.output, 1.0)
    ctx = whole + output / 2  # a decoding sequence's mean context
    # the tokens a request prefills: what the prefix cache (its engine's, or its group's) does not hold
    prompt = max(whole * (1.0 - d.cached), 1.0)
    pairs = prompt * (whole - prompt / 2)  # (query, key) pairs of one prefill: after the cached part, causal

    def step_s(p: float, b: float) -> float:
        return cost.group_step_ms(width, sp_threshold, p, b, b * ctx, p / prompt * pairs) / 1000

    inflow = d.rate / units * prompt  # prompt tokens to prefill arriving per second at one unit
    # prompt tokens to prefill (a request prefills on one unit: a backlog of k requests keeps at most k busy) and
    # decoding sequences
    waiting = d.waiting if d.waiting > 0 else d.backlog / whole
    backlog = d.backlog * prompt / whole
    x, b = backlog / min(units, max(1.0, waiting)), min(d.decoding / units, cap)
    stall = stall_ms / 1000
    waited = (x + inflow * stall / 2) / prompt * stall  # request-seconds spent waiting for a first token
    x += inflow * stall
    arrivals = x / prompt + inflow * max(t.horizon_s - stall, 0.0) / prompt
    tokens = busy_s = stepped_s = 0.0
    steps = 0.0
    dt = max(t.horizon_s - stall, 0.0) / SLICES

    def run(seconds: float, step: float, prefilled: float) -> None:
        nonlocal b, tokens, busy_s, steps, stepped_s
        n = seconds / step
        steps += n
        stepped_s += seconds
        tokens += n * b
        busy_s += n * b * step
        b = min(cap, max(0.0, b + prefilled / prompt - b * min(1.0, n / output)))

    for _ in range(SLICES):
        left = dt
        if x > 0 and b < cap:  # drain the backlog at the rate of full chunks
            s_full = step_s(chunk, b)
            net = chunk / s_full - inflow
            took = min(dt, x / net) if net > 0 else dt
            x_end = max(0.0, x - net * took)
            waited += (x + x_end) / 2 / prompt * took
            # the decoding sequences see steps of what the backlog holds, at most a chunk (a lone long prompt:
            # one step of its length, not a full chunk's)
            run(took, step_s(min(chunk, x + inflow * s_full), b), x + inflow * took - x_end)
            x, left = x_end, dt - took
        if left <= 0:
            continue
        step = step_s(0.0, b)
        p = 0.0
        for _ in range(2) if b < cap else ():  # steady: a step prefills what arrived during the one before
            p = min(chunk, inflow * step)
            step = step_s(p, b)
        p = min(chunk, inflow * step) if b < cap else 0.0
        grow = max(0.0, inflow - p / step)  # what the steps cannot keep up with
        waited += (inflow * step / 2 + (x + grow * left / 2)) / prompt * left
        run(left, step, p / step * left)
        x += grow * left
    one = cost.group_step_ms(width, sp_threshold, prompt, b, b * ctx, pairs)
    full = step_s(chunk, b)
    drain_s = x / chunk * full  # what is left at the horizon still waits for its backlog to drain
    waited += x / prompt * drain_s / 2
    ttft = (waited / arrivals * 1000 if arrivals > 0 else 0.0) + one
    # high priority jumps the queue: it waits for the step under way (half a step on average), then its own
    mean_step = stepped_s / steps * 1000 if steps else one
    high = stall_ms + mean_step / 2 + one
    tpot = busy_s / tokens * 1000 if tokens > 0 else cost.group_step_ms(width, sp_threshold, 0, 1, ctx)
    return Forecast(width, ttft, high, tpot, units * tokens / max(t.horizon_s, 1e-9), stall_ms, 0.0)


def score(f: Forecast, d: Demand, t: Targets) -> float:
    """The objective: each class's predicted TTFT over its target, weighted by its share of the arrivals, plus how
    far the predicted time per output token exceeds its target (a hinge: below the target TTFT alone decides; a
    candidate that cannot keep up shows in both, its backlog grows and its steps lengthen)."""
    ttft = (1 - d.high_share) * f.ttft_ms / t.normal_ms + d.high_share * f.high_ttft_ms / t.high_ms
    return ttft + max(0.0, f.tpot_ms / t.tpot_ms - 1.0)


def switch_ms(cost: CostModel, now: int, width: int, d: Demand, sp_threshold: int) -> float:
    """The stall of going from width ``now`` to ``width``: ``switch_ms`` for each switch (a bind or a release;
    both, to change a group's width), plus moving the running requests' KV head slices among the members ((w-1)/w
    of their context). (The wait for the members' step boundary is no stall: the step under way completes.)"""
    if width == now:
        return 0.0
    wide = max(now, width)
    per_member = d.decoding / max(d.engines, 1) * (d.prompt + d.output / 2) * (wide - 1) / wide
    switches = 2 if now > 1 and width > 1 else 1
    return switches * cost.switch_ms + cost.transform_ms([(per_member, per_member)])


@dataclass(frozen=True)
class Choice:
    """A node's choice: the width it takes (``best``), the prediction for keeping its current width (``keep``)
    and the best other candidate (``runner_up``)."""

    best: Forecast
    keep: Forecast
    runner_up: Forecast | None

    @property
    def width(self) -> int:
        return self.best.width

    def __str__(self) -> str:
        other = self.runner_up if self.runner_up is not None else self.keep
        return f"{self.best}; {other}"


def choose(cost: CostModel, widths: list[int], now: int, d: Demand, t: Targets, sp_threshold: int) -> Choice:
    """Predict every candidate width in ``widths`` (``now``: the current one, kept unless another scores
    :data:`MARGIN` better) and choose."""
    cands = []
    for w in widths:
        f = forecast(cost, w, d, t, sp_threshold, switch_ms(cost, now, w, d, sp_threshold))
        cands.append(dataclasses.replace(f, score=score(f, d, t)))
    keep = next((c for c in cands if c.width == now), cands[0])
    best = min(cands, key=lambda c: (c.score, c.width))
    if best.width != keep.width and best.score > keep.score * (1 - MARGIN):
        best = keep
    others = [c for c in cands if c.width != best.width]
    return Choice(best, keep, min(others, key=lambda c: c.score) if others else None)
