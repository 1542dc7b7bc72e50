import dataclasses
from collections import Counter

import numpy as np
import pytest
from tokenizers import Tokenizer

from loadgen.arrivals import Arrivals
from loadgen.trace import TraceRow
from loadgen.workload import Lengths, PromptMaker, Workload, parse_mix, plan


@pytest.mark.parametrize(
    "spec,expect",
    [
        ("128", Lengths("fixed", 128, 128)),
        ("64:256", Lengths("uniform", 64, 256)),
        ("normal:200:50", Lengths("normal", 200, 50)),
        ("lognormal:200:0.5", Lengths("lognormal", 200, 0.5)),
    ],
)
def test_length_specs(spec, expect):
    assert Lengths.parse(spec) == expect


@pytest.mark.parametrize("spec", ["", "a:b", "9:3", "normal:1", "-4"])
def test_bad_length_specs(spec):
    with pytest.raises(ValueError):
        Lengths.parse(spec)


def test_uniform_lengths_cover_the_inclusive_range():
    rng = np.random.default_rng(0)
    got = {Lengths.parse("3:5").sample(rng) for _ in range(200)}
    assert got == {3, 4, 5}
    assert min(Lengths.parse("normal:2:50").sample(rng) for _ in range(200)) == 1


def test_plan_is_deterministic_and_follows_the_mix():
    w = Workload(
        num_requests=2000,
        arrivals=Arrivals("constant", 100),
        priority_mix={"high": 0.2, "normal": 0.8},
        long_share=0.1,
    )
    a, b = plan(w), plan(w)
    assert a == b
    c = Counter(r.priority for r in a)
    assert c["high"] / 2000 == pytest.approx(0.2, abs=0.03) and set(c) == {"high", "normal"}
    longs = [r for r in a if r.long]
    assert len(longs) / 2000 == pytest.approx(0.1, abs=0.02)
    assert all(2048 <= r.input_tokens <= 4096 for r in longs)
    assert all(16 <= r.input_tokens <= 64 for r in a if not r.long)
    assert a[1].at == pytest.approx(0.01)


def test_trace_fixes_times_lengths_and_priorities():
    trace = [TraceRow(0.0, 5, 7, "high"), TraceRow(0.5, 9, 3, None)]
    reqs = plan(Workload(priority_mix={"low": 1.0}), trace=trace)
    assert [(r.at, r.input_tokens, r.max_tokens, r.priority) for r in reqs] == [
        (0.0, 5, 7, "high"),
        (0.5, 9, 3, "low"),
    ]


def test_prompts_have_the_asked_token_count_with_a_tokenizer(tiny_model):
    make = PromptMaker(tiny_model)
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    rng = np.random.default_rng(0)
    for n in (1, 17, 300):
        got = len(tok.encode(make(n, rng), add_special_tokens=False).ids)
        assert abs(got - n) <= max(1, n // 50)


def test_priority_mix_parsing():
    assert parse_mix("high=0.2,normal=0.8") == {"high": 0.2, "normal": 0.8}
    for bad in ("high", "high=x", "high=-1"):
        with pytest.raises(ValueError):
            parse_mix(bad)
    with pytest.raises(ValueError):
        Workload(priority_mix={"high": 0.5})


def test_a_priority_class_the_gateway_lacks_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown class 'urgent' \\(the classes are high, normal, low\\)"):
        parse_mix("urgent=1")
    with pytest.raises(ValueError, match="bad priority mix"):
        parse_mix("high=nan")
    with pytest.raises(ValueError, match="unknown priority class 'urgent'"):
        Workload(priority_mix={"urgent": 1.0})


def test_sessions_plan_every_turn_with_its_sessions_system_prompt():
    from loadgen.workload import Sessions, system_prompt

    w = Workload(num_requests=5, arrivals=Arrivals("constant", 10), input_tokens=Lengths("fixed", 6, 6),
                 sessions=Sessions(system_prompts=2, system_prompt_words=50, turns=3))  # fmt: skip
    reqs = plan(w)
    assert len(reqs) == 15 and reqs == plan(w)
    assert [(r.turn.session, r.turn.index) for r in reqs[:4]] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert [r.turn.system for r in reqs[::3]] == [system_prompt(i % 2, 50) for i in range(5)]
    assert len(system_prompt(0, 50).split()) == 52 and system_prompt(0, 50) != system_prompt(1, 50)
    assert len({r.prompt for r in reqs}) == 15, "distinct questions"
    assert {r.priority for r in reqs[:3]} == {reqs[0].priority} and reqs[1].at == reqs[0].at == 0.0
    assert all(len(r.prompt.split()) == 6 for r in reqs)
    no_system = plan(Workload(num_requests=2, sessions=Sessions(system_prompts=0, turns=2)))
    assert {r.turn.system for r in no_system} == {""}


def test_sessions_have_long_turns_at_the_long_share():
    from loadgen.workload import Sessions

    w = Workload(num_requests=40, input_tokens=Lengths("fixed", 6, 6), long_share=0.25,
                 long_input_tokens=Lengths("fixed", 300, 300), sessions=Sessions(system_prompts=2, turns=3))  # fmt: skip
    reqs = plan(w)
    long = [r for r in reqs if r.long]
    assert 10 <= len(long) <= 50 and {r.input_tokens for r in long} == {300}
    assert all(len(r.prompt.split()) == 300 for r in long) and all(r.turn is not None for r in long)
    assert {r.input_tokens for r in reqs if not r.long} == {6}
    short = plan(dataclasses.replace(w, long_share=0.0))
    assert not any(r.long for r in short), "none without a long share"


def test_bad_sessions_and_a_trace_replayed_as_sessions_are_refused():
    from loadgen.workload import Sessions

    with pytest.raises(ValueError):
        Sessions(turns=0)
    with pytest.raises(ValueError, match="trace"):
        plan(Workload(sessions=Sessions()), trace=[TraceRow(0.0, 5, 7, None)])
