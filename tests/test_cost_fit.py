"""The cost model fitted to the engines' step costs (router.cost_fit), and the planner's choices on it."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from flying.cost_model import CPU_PRIOR, H200_LLAMA70B, CostModel
from flying.messages import Heartbeat, StepCost, decode, encode
from router.config import RouterConfig
from router.cost_fit import REFIT_S, CostFit, Fitter, fit, line, prior_for
from router.dispatcher import Dispatcher
from router.planner import Demand, Targets, choose

# a CPU pair: steps cost 12 ms + 0.3 ms a token alone; TP adds 25 ms and 0.05 ms a token; SP adds 8 ms
TRUE = dataclasses.replace(
    CPU_PRIOR, overhead_ms=12.0, prefill_ms_per_token=0.3, allreduce_ms=25.0, allreduce_ms_per_token=0.05,
    sp_alltoall_ms=8.0, sp_alltoall_ms_per_token=0.04,
)  # fmt: skip
SIZES = (2, 4, 16, 64, 256, 1024, 4096)  # (an SP step of one token is a TP step)


def samples(model: CostModel, noise: float = 0.02, seed: int = 0, n: int = 20) -> list[StepCost]:
    rng = random.Random(seed)
    out = []
    for tokens in SIZES:
        dp = model.group_step_ms(1, 0, tokens, 0, 0)
        tp = model.group_step_ms(2, 0, tokens, 0, 0)
        sp = model.group_step_ms(2, 1, tokens, 0, 0)
        for mode, ms in (("dp", dp), ("tp", tp), ("sp", sp)):
            out.append(
                StepCost(mode, 1 if mode == "dp" else 2, n, tokens, ms * (1 + rng.uniform(-noise, noise)))
            )
    return out


def test_the_fit_recovers_known_lines_and_their_fields():
    got = fit(CPU_PRIOR, samples(TRUE))
    by = {(c.mode, c.width): c for c in got.curves}
    assert set(by) == {("dp", 1), ("tp", 2), ("sp", 2)}
    assert by["dp", 1].ms == pytest.approx(12.0, rel=0.1) and by["dp", 1].ms_per_token == pytest.approx(
        0.3, rel=0.05
    )
    m = got.cost_model()
    for name in (
        "overhead_ms",
        "prefill_ms_per_token",
        "allreduce_ms",
        "allreduce_ms_per_token",
        "sp_alltoall_ms",
    ):
        assert getattr(m, name) == pytest.approx(getattr(TRUE, name), rel=0.2, abs=0.01), name
    for tokens in (8, 512, 3000):  # the fitted model predicts the steps it was fitted to
        assert m.group_step_ms(2, 1, tokens, 0, 0) == pytest.approx(
            TRUE.group_step_ms(2, 1, tokens, 0, 0), rel=0.05
        )
    assert all(c.error < 0.1 for c in got.curves), (
        "(an SP step pads its tokens to the width: not quite a line)"
    )


def test_a_bucket_of_outliers_is_left_out_of_the_line():
    pts = [StepCost("dp", 1, 10, t, 12.0 + 0.3 * t) for t in SIZES]
    pts[2] = StepCost("dp", 1, 10, 16, 400.0)  # steps that waited for the GIL
    a, b, _ = line(pts)
    assert a == pytest.approx(12.0, rel=0.01) and b == pytest.approx(0.3, rel=0.01)


def test_too_few_samples_keep_the_prior():
    few = [StepCost("dp", 1, 3, 100, 40.0), StepCost("tp", 2, 50, 100, 60.0)]  # 3 steps; one size only
    got = fit(H200_LLAMA70B, few)
    assert not got.curves and got.cost_model() == H200_LLAMA70B
    assert prior_for(["cuda", "cpu"]) is CPU_PRIOR and prior_for(["cuda"]) is H200_LLAMA70B


def test_the_planner_flips_at_the_crossover_prompt_length_the_fitted_lines_imply():
    """One prompt on an idle CPU pair: DP prefills it in a + b P, an SP pair, after the bind's stall s, in
    s + a' + b' P with b' < b and a' > a, so the pair wins from P* = (s + a' - a) / (b - b') on; the planner keeps
    shorter prompts in DP and binds for longer ones."""
    got = fit(CPU_PRIOR, samples(TRUE))
    m = got.cost_model()
    by = {(c.mode, c.width): c for c in got.curves}
    dp, sp = by["dp", 1], by["sp", 2]
    stall = m.switch_ms + m.transform_fixed_ms
    crossover = (stall + sp.ms - dp.ms) / (dp.ms_per_token - sp.ms_per_token)
    assert 100 < crossover < 1000

    def width(prompt: float) -> int:
        d = Demand(engines=2, rate=0.0, prompt=prompt, output=8, backlog=prompt)
        return choose(m, [1, 2], 1, d, Targets(), sp_threshold=1).width

    assert width(crossover * 0.5) == 1 and width(crossover * 2) == 2


def test_the_fitter_refits_as_samples_change_and_at_most_every_refit_s():
    f = Fitter()
    first = f.update(0.0, samples(TRUE), ["cpu"])
    assert first is not None and f.fit is first
    assert f.update(0.5, samples(TRUE, seed=1, n=30), ["cpu"]) is None, "within REFIT_S"
    assert f.update(REFIT_S + 1, samples(TRUE, seed=1, n=20), ["cpu"]) is None, "no new steps"
    assert f.update(REFIT_S + 1, samples(TRUE, seed=1, n=30), ["cpu"]) is not None
    loaded = Fitter(first)
    assert loaded.update(0.0, [], ["cpu"]) is None and loaded.model(["cpu"]) == first.cost_model()
    assert Fitter().model(["cuda"]) is H200_LLAMA70B


async def test_a_restarted_router_starts_from_the_stored_fit_and_the_heartbeats_refit_it(aredis, keys):
    stored = fit(CPU_PRIOR, samples(TRUE))
    await aredis.set(keys.cost_model, encode(stored))
    d = Dispatcher(RouterConfig(key_prefix=keys.prefix), aredis)
    await d.load_costs()
    assert d.costs.fit == stored
    hb = Heartbeat(engine=0, url="http://e0", pid=1, model="m", device="cpu", ts=time.time(),
                   step_costs=tuple(samples(dataclasses.replace(TRUE, overhead_ms=30.0))))  # fmt: skip
    model = await d._fit_costs([hb], ["cpu"])
    assert model.overhead_ms == pytest.approx(30.0, rel=0.1), "the engines' own steps win"
    assert decode(await aredis.get(keys.cost_model), CostFit).model["overhead_ms"] == model.overhead_ms


def test_a_line_over_too_narrow_a_range_of_sizes_is_not_trusted():
    """Decode steps of 1-3 sequences alone say nothing of what a 3,000-token prefill costs: the prior stays."""
    narrow = [StepCost("tp", 2, 50, 1, 30.0), StepCost("tp", 2, 50, 2.5, 36.0)]
    assert line(narrow) is None and not fit(CPU_PRIOR, narrow).curves


def test_a_line_whose_free_fit_falls_below_zero_goes_through_the_origin_and_the_planner_still_plans():
    """Noisy small steps can put a free fit's intercept below zero: a step of nothing would then cost nothing and
    the planner's rates divide by zero. The line is refitted through the origin, the overhead kept positive."""
    pts = [StepCost("dp", 1, 10, 4, 0.5), StepCost("dp", 1, 10, 40, 1.0), StepCost("dp", 1, 10, 400, 60.0)]
    a, b, _ = line(pts)
    assert a == 0.0 and b > 0
    m = fit(CPU_PRIOR, pts).cost_model()
    assert m.group_step_ms(1, 0, 0, 0, 0) > 0
    d = Demand(engines=2, rate=1.5, prompt=10, output=160)
    assert choose(m, [1, 2], 1, d, Targets(), 0).width in (1, 2)
