"""The planner's reasons (router.planner), on constructed demands of one 8-engine H200 node."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flying.cost_model import H200_LLAMA70B as H200
from router.planner import MARGIN, Demand, Targets, choose, forecast, switch_ms

WIDTHS = [1, 2, 4, 8]
T = Targets()


def test_an_idle_node_and_one_4k_prompt_binds_wide_in_sp():
    d = Demand(engines=8, rate=0.0, prompt=4096, output=128, backlog=4096)
    c = choose(H200, WIDTHS, 1, d, T, sp_threshold=256)
    assert c.width == 8
    assert c.best.ttft_ms < c.keep.ttft_ms / 3, "SP over 8 engines prefills the prompt several times faster"
    assert c.keep.width == 1 and str(c).startswith("width 8: TTFT")


def test_a_prefill_heavy_burst_keeps_a_wide_sp_group():
    """Long prompts, one-token answers: SP steps prefill as fast per GPU as DP, and each prompt on 8 GPUs."""
    d = Demand(engines=8, rate=12.0, prompt=6000, output=4, backlog=60_000, decoding=8)
    assert choose(H200, WIDTHS, 8, d, T, sp_threshold=256).width == 8


def test_a_decode_heavy_burst_goes_to_dp():
    """Short prompts, long answers, a node full of decoding sequences: the bound node's steps decode them slower per
    GPU than DP's, the prompts that keep arriving wait behind them, and DP is predicted faster at both."""
    d = Demand(engines=8, rate=60.0, prompt=300, output=400, backlog=18_000, decoding=3000)
    c = choose(H200, WIDTHS, 8, d, T, sp_threshold=256)
    assert c.width == 1 and c.best.ttft_ms < c.keep.ttft_ms
    assert c.best.tpot_ms < c.keep.tpot_ms and c.best.tokens_per_s > c.keep.tokens_per_s


def test_prompts_the_caches_hold_are_prefilled_in_part_in_dp_and_in_a_group_alike():
    """Long prompts that repeat: DP and a bound group (its own prefix cache) each prefill a tenth of each; the group
    still prefills its share faster."""
    d = Demand(engines=8, rate=6.0, prompt=8000, output=200, decoding=16)
    cached = Demand(engines=8, rate=6.0, prompt=8000, output=200, decoding=16, cached=0.9)
    for w in (1, 8):
        assert forecast(H200, w, cached, T, 256).ttft_ms < forecast(H200, w, d, T, 256).ttft_ms / 2
    assert choose(H200, WIDTHS, 1, cached, T, sp_threshold=256).width > 1


def test_a_high_share_of_high_priority_weighs_its_own_ttft():
    d = Demand(engines=8, rate=2.0, prompt=2000, output=64, high_share=0.5)
    f1 = forecast(H200, 1, d, T, 256)
    f8 = forecast(H200, 8, d, T, 256)
    assert f8.high_ttft_ms < f1.high_ttft_ms
    assert choose(H200, WIDTHS, 1, d, T, sp_threshold=256).width > 1


def test_a_switch_costs_a_stall_and_keeping_costs_none():
    d = Demand(engines=8, rate=4.0, prompt=1000, output=100, backlog=5000, decoding=40)
    assert switch_ms(H200, 8, 8, d, 256) == 0.0
    once, twice = switch_ms(H200, 1, 8, d, 256), switch_ms(H200, 4, 8, d, 256)
    assert once > H200.switch_ms and twice > once, "a width change is a release and a bind"


@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(0, 80),
    prompt=st.floats(16, 20_000),
    output=st.floats(1, 2000),
    backlog=st.floats(0, 200_000),
    decoding=st.floats(0, 2000),
    now=st.sampled_from(WIDTHS),
)
def test_the_chosen_width_is_never_predicted_worse_than_keeping(rate, prompt, output, backlog, decoding, now):
    d = Demand(engines=8, rate=rate, prompt=prompt, output=output, backlog=backlog, decoding=decoding)
    c = choose(H200, WIDTHS, now, d, T, sp_threshold=256)
    assert c.best.score <= c.keep.score
    if c.width != now:
        assert c.best.score <= c.keep.score * (1 - MARGIN), "a switch must win by the margin"
