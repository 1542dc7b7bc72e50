"""The cost model the live router plans with, fitted to what the engines measure (their heartbeats' step costs).

Each kind of step (DP, a group's TP step or SP step, at a width) is fitted with one line, milliseconds against
batched tokens, by weighted least squares over the engines' size buckets, with the buckets far off the first line
left out and the line fitted again (robust to a bucket of outliers: a step that waited for the GIL, say). The lines
set the shared model's fields (:func:`apply`): DP's gives the per-step overhead and the compute per token, TP's
the all-reduce rounds' latency and volume on top, SP's the all-to-alls'. A kind with too few samples keeps the
prior's: the H200 profile, or :data:`flying.cost_model.CPU_PRIOR` when the engines run on CPU. The fit lives in
Redis (``flying:cost_model``), so a restarted or standby router starts from it; ``flyctl model`` prints it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import msgspec

from flying.cost_model import CPU_PRIOR, H200_LLAMA70B, CostModel
from flying.messages import StepCost

MIN_STEPS = 8  # steps a line needs in all ...
MIN_BUCKETS = 2  # ... over at least this many size buckets ...
MIN_SPAN = 4.0  # ... whose sizes span at least this factor (a slope from decode steps of 1-3 tokens is noise)
MIN_OVERHEAD_MS = 0.1  # a fitted step's fixed cost is at least this: a step of nothing never costs nothing


class Curve(msgspec.Struct, frozen=True, kw_only=True):
    """One fitted line: a ``mode`` step at ``width`` costs ``ms`` + ``ms_per_token`` x batched tokens; ``steps``
    and ``buckets`` it was fitted to, ``error`` the steps' relative RMS residual."""

    mode: str
    width: int
    ms: float
    ms_per_token: float
    steps: int
    buckets: int
    error: float

    def at(self, tokens: float) -> float:
        return self.ms + self.ms_per_token * tokens


class CostFit(msgspec.Struct, frozen=True, kw_only=True):
    """The router's fitted cost model (``flying:cost_model``): the prior it started from, the lines, the model."""

    prior: str
    curves: tuple[Curve, ...] = ()
    model: dict[str, float | int | str] = {}

    def cost_model(self) -> CostModel:
        fields = {f.name for f in dataclasses.fields(CostModel)}
        return CostModel(**{k: v for k, v in self.model.items() if k in fields})  # type: ignore[arg-type]


def prior_for(devices: Iterable[str]) -> CostModel:
    """The CPU prior where any engine runs on CPU, else the H200 profile."""
    return CPU_PRIOR if "cpu" in set(devices) else H200_LLAMA70B


def line(points: list[StepCost]) -> tuple[float, float, float] | None:
    """(intercept, slope, relative RMS error) of ms against tokens, each bucket weighted by its steps; buckets whose
    residual is over three times the median are dropped and the line fitted again. None if under-determined."""
    pts = [p for p in points if p.n > 0]
    if sum(p.n for p in pts) < MIN_STEPS or len({round(p.tokens) for p in pts}) < MIN_BUCKETS:
        return None
    if max(p.tokens for p in pts) < MIN_SPAN * max(min(p.tokens for p in pts), 1.0):
        return None
    fit = _wls(pts)
    if fit is None:
        return None
    kept = pts
    res = sorted(abs(p.ms - (fit[0] + fit[1] * p.tokens)) for p in pts)
    cut = 3 * res[len(res) // 2]
    inliers = [p for p in pts if abs(p.ms - (fit[0] + fit[1] * p.tokens)) <= cut] if cut > 0 else pts
    if len({round(p.tokens) for p in inliers}) >= MIN_BUCKETS and len(inliers) < len(pts):
        kept, fit = inliers, _wls(inliers) or fit
    a, b = fit if fit[0] >= 0 else (0.0, _through_origin(kept))  # a step never takes negative time
    n = sum(p.n for p in pts)
    err = math.sqrt(sum(p.n * ((p.ms - (a + b * p.tokens)) / max(p.ms, 1e-9)) ** 2 for p in pts) / n)
    return a, max(b, 0.0), err


def _wls(pts: list[StepCost]) -> tuple[float, float] | None:
    w = sum(p.n for p in pts)
    mx = sum(p.n * p.tokens for p in pts) / w
    my = sum(p.n * p.ms for p in pts) / w
    sxx = sum(p.n * (p.tokens - mx) ** 2 for p in pts)
    if sxx <= 0:
        return None
    b = sum(p.n * (p.tokens - mx) * (p.ms - my) for p in pts) / sxx
    return my - b * mx, b


def _through_origin(pts: list[StepCost]) -> float:
    """The slope of the line through the origin (the intercept a free fit puts below zero is clamped to 0)."""
    return sum(p.n * p.tokens * p.ms for p in pts) / sum(p.n * p.tokens**2 for p in pts)


def merge(samples: Iterable[StepCost]) -> dict[tuple[str, int], list[StepCost]]:
    """The engines' buckets pooled by kind (mode, width): engines of one node measure the same steps."""
    pooled: dict[tuple[str, int, int], list[float]] = {}
    for s in samples:
        key = (s.mode, s.width, max(int(s.tokens), 1).bit_length())
        acc = pooled.setdefault(key, [0, 0.0, 0.0])
        acc[0] += s.n
        acc[1] += s.n * s.tokens
        acc[2] += s.n * s.ms
    out: dict[tuple[str, int], list[StepCost]] = {}
    for (mode, width, _), (n, tok, ms) in sorted(pooled.items()):
        out.setdefault((mode, width), []).append(StepCost(mode, width, int(n), tok / n, ms / n))
    return out


def fit(prior: CostModel, samples: Iterable[StepCost]) -> CostFit:
    """Fit a line to each kind of step with enough samples and set the model from them (:func:`apply`)."""
    curves = []
    for (mode, width), pts in merge(samples).items():
        got = line(pts)
        if got is not None:
            a, b, err = got
            steps = sum(p.n for p in pts)
            curves.append(
                Curve(mode=mode, width=width, ms=a, ms_per_token=b, steps=steps, buckets=len(pts), error=err)
            )
    model = apply(prior, curves)
    return CostFit(prior=prior.name, curves=tuple(curves), model=dataclasses.asdict(model))


def apply(prior: CostModel, curves: Iterable[Curve]) -> CostModel:
    """The prior with the fitted lines in its fields. DP's line is the whole step (overhead + compute per token:
    the prior's weight read, decode, attention and host terms folded in); a TP line at width w adds log2(w)
    all-reduce rounds to DP's compute split w ways; an SP line adds the all-to-alls to a member's slice of the
    tokens through the full weights."""
    by = {(c.mode, c.width): c for c in curves}
    m = prior
    if (dp := by.get(("dp", 1))) is not None:
        m = dataclasses.replace(
            m,
            name=f"fitted ({prior.name} prior)",
            overhead_ms=max(dp.ms, MIN_OVERHEAD_MS),
            prefill_ms_per_token=dp.ms_per_token,
            weight_read_ms=0.0,
            decode_ms_per_seq=0.0,
            kv_ms_per_1k_tokens=0.0,
            prefill_attn_ms_per_mpair=0.0,
            sp_host_ms_per_seq=0.0,
        )
    c = m.prefill_ms_per_token
    tp = max((x for x in curves if x.mode == "tp" and x.width > 1), key=lambda x: x.steps, default=None)
    if tp is not None:
        rounds = math.log2(tp.width)
        m = dataclasses.replace(
            m,
            merged_overhead=0.0,
            allreduce_ms=max(tp.ms - m.overhead_ms, 0.0) / rounds,
            allreduce_ms_per_token=max(tp.ms_per_token - c / tp.width, 0.0) / rounds,
        )
    sp = max((x for x in curves if x.mode == "sp" and x.width > 1), key=lambda x: x.steps, default=None)
    if sp is not None:
        m = dataclasses.replace(
            m,
            sp_alltoall_ms=max(sp.ms - m.overhead_ms, 0.0),
            sp_alltoall_ms_per_token=max(sp.ms_per_token * sp.width - c, 0.0),
        )
    return m


REFIT_S = 2.0  # seconds between fits while the samples keep changing


class Fitter:
    """The live router's fit, refitted at most every :data:`REFIT_S` as the engines' samples change; ``fit`` is
    what was last fitted or loaded from Redis (None: nothing yet, the prior applies)."""

    def __init__(self, fitted: CostFit | None = None) -> None:
        self.fit = fitted
        self._at = -math.inf
        self._steps = -1

    def update(self, now: float, samples: list[StepCost], devices: list[str]) -> CostFit | None:
        """Refit from the live engines' ``samples``; the new fit if it changed (to be stored), else None."""
        prior = prior_for(devices)
        steps = sum(s.n for s in samples)
        same_prior = self.fit is not None and self.fit.prior == prior.name
        if same_prior and (steps == self._steps or now - self._at < REFIT_S):
            return None
        if same_prior and not samples:
            return None  # (loaded from Redis, the engines have not reported yet: keep it)
        self._at, self._steps = now, steps
        new = fit(prior, samples)
        if new == self.fit:
            return None
        self.fit = new
        return new

    def model(self, devices: list[str]) -> CostModel:
        return self.fit.cost_model() if self.fit is not None else prior_for(devices)
