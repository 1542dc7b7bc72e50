"""Each node's load width from the planner (router.regime): the measured demand, the plan and its note."""

from __future__ import annotations

import math

from flying.messages import Group, QueuedRequest, RouterState
from router.config import PolicyConfig
from router.decision import PlanNote
from router.engine_view import EngineView
from router.regime import (
    PLAN_EVERY_S,
    ewma,
    forming,
    measure,
    node_demand,
    queued_work,
    reuse_share,
    update,
)
from router.round import Round
from router.snapshot import Snapshot

CFG = PolicyConfig()


def engines(n=8, inflight=0, running=0, waiting=0, node=""):
    return [
        EngineView(
            i, f"e{i}", inflight, 350_000, 350_000, num_engines=n, running=running, waiting=waiting, node=node
        )
        for i in range(n)
    ]


def req(rid="r", prompt=1000, at=100.0):
    return QueuedRequest(id=rid, priority="normal", model="m", prompt_tokens=prompt, max_tokens=100, gateway="g", enqueued_at=at)  # fmt: skip


def snap(now=100.0, waiting=(), queued=None, es=None, state=None, **counters):
    return Snapshot(now=now, waiting=list(waiting), queued=len(waiting) if queued is None else queued,
                    engines=engines() if es is None else es, groups=[], state=state or RouterState(), **counters)  # fmt: skip


def test_the_rates_decay_and_add_one_over_tau_per_unit_counted():
    assert math.isclose(ewma(2.0, 9, 5, 2.0, 2.0), 2.0 * math.exp(-1) + 4 / 2.0)
    assert math.isclose(ewma(2.0, 1, 5, 2.0, 2.0), 2.0 * math.exp(-1)), (
        "a counter that went back adds nothing"
    )


def test_the_demand_measures_the_token_mix_and_the_first_round_counts_nothing():
    st = measure(RouterState(), snap(admitted=50, prompt_tokens=50_000, output_tokens=5_000), tau=5.0)
    assert (st.rate, st.admitted, st.prompt_tokens) == (0.0, 50, 50_000), "the first round counts none"
    later = measure(st, snap(now=101.0, admitted=60, prompt_tokens=70_000, output_tokens=6_000), tau=5.0)
    assert math.isclose(later.prompt_rate / later.rate, 2000.0) and math.isclose(
        later.output_rate / later.rate, 100
    )


def test_a_nodes_demand_is_its_share_of_the_queue_and_its_engines_work():
    es = engines(inflight=10, running=4, waiting=6)
    rnd = Round(snap(waiting=[req("a", 3000), req("b", 1000)], queued=4, es=es), CFG)
    d = node_demand(rnd, [e.engine for e in es], queued_work(rnd.s))
    assert d.engines == 8 and d.decoding == 32
    # the queue's head (4,000 tokens) scaled to its depth (4 of 2 seen), and 6 unstarted requests an engine
    assert d.backlog == 8000 + 8 * 6 * d.prompt


def test_an_idle_node_binds_at_its_widest_and_notes_the_predictions():
    rnd = Round(snap(waiting=[req(prompt=4096)]), CFG)
    update(rnd)
    assert rnd.plan == {("", 0, 8): 8} and rnd.out.state.widths == {"0": 8} and not rnd.out.state.busy
    (note,) = [e for e in rnd.out.events if isinstance(e, PlanNote)]
    assert str(note).startswith("node 0: load groups of width 8 (width 8: TTFT ")
    assert "predicted" in str(note) and note.was == 1 and not note.busy


def test_a_plan_holds_for_plan_every_s_then_is_made_again():
    st = RouterState(busy=True, widths={"0": 1}, planned_at=100.0)
    rnd = Round(snap(now=100.0 + PLAN_EVERY_S / 2, state=st), CFG)
    update(rnd)
    assert rnd.plan == {("", 0, 8): 1} and not rnd.out.events
    rnd = Round(snap(now=100.0 + 2 * PLAN_EVERY_S, state=st), CFG)
    update(rnd)
    assert rnd.plan == {("", 0, 8): 8}, "idle: planned again, bound"


def test_a_prompt_the_mix_did_not_foresee_is_planned_for_at_once():
    """A short mix measured (48 tokens a prompt), DP planned a moment ago: a 3,500-token prompt that arrives now is
    planned for in this round (the idle node binds before it is placed); one like the mix keeps the plan."""
    st = RouterState(
        busy=True,
        widths={"0": 1},
        planned_at=100.0,
        rate=1.0,
        prompt_rate=48.0,
        output_rate=8.0,
        rate_ts=100.0,
    )
    now = 100.0 + PLAN_EVERY_S / 2
    rnd = Round(snap(now=now, waiting=[req(prompt=60, at=now)], state=st), CFG)
    update(rnd)
    assert rnd.plan == {("", 0, 8): 1} and not rnd.out.events, "foreseen: the plan holds"
    rnd = Round(snap(now=now, waiting=[req(prompt=3500, at=now)], state=st), CFG)
    update(rnd)
    assert rnd.plan == {("", 0, 8): 8} and isinstance(rnd.out.events[0], PlanNote)


def test_nodes_are_planned_apart_and_load_groups_off_keeps_dp():
    es = engines(4, node="a") + [EngineView(i, f"e{i}", 0, 350_000, 350_000, num_engines=4, node="b",
                                            pool_first=4) for i in range(4, 8)]  # fmt: skip
    rnd = Round(snap(es=es), CFG)
    update(rnd)
    assert rnd.out.state.widths == {"a": 4, "b": 4}
    off = PolicyConfig(off=frozenset({"load"}))
    rnd = Round(snap(es=es), off)
    update(rnd)
    assert rnd.out.state.widths == {"a": 1, "b": 1} and not rnd.out.state.busy, (
        "no load groups; the verdict: light"
    )
    narrow = PolicyConfig(max_width=2)
    rnd = Round(snap(es=es), narrow)
    update(rnd)
    assert rnd.out.state.widths == {"a": 2, "b": 2}


def test_a_load_group_binding_at_the_next_step_boundary_is_forming():
    g = Group(epoch=1, members=(0, 1), reason="load", preempt="hard", state="binding", since=99.5)
    assert forming([g], 100.0, ack_timeout_s=2.0)
    assert not forming([g], 102.0, ack_timeout_s=2.0)


def test_the_demand_carries_the_share_of_dispatched_prompt_tokens_that_repeats():
    st = measure(RouterState(), snap(reuse=(10_000, 0)), tau=5.0)
    st = measure(st, snap(now=101.0, reuse=(20_000, 8_000)), tau=5.0)
    st = measure(st, snap(now=102.0, reuse=(30_000, 16_000)), tau=5.0)
    share = reuse_share(st)
    assert 0.5 < share < 0.8, "(the first 10,000 tokens repeated nothing)"
    es = engines()
    rnd = Round(snap(es=es, state=st), CFG)
    assert node_demand(rnd, [e.engine for e in es], queued_work(rnd.s)).cached == share
    quiet = measure(st, snap(now=130.0, reuse=(30_000, 16_000)), tau=5.0)
    assert math.isclose(reuse_share(quiet), share), "no dispatches: the share is the last measured"
    restarted = measure(st, snap(now=103.0, reuse=(1_000, 1_000)), tau=5.0)
    assert reuse_share(restarted) > share, "counters that went back (another router) count from zero"
