"""Sessions as loadgen runs them (loadgen.conversation, loadgen.runner) against the fake endpoint in-process: each
turn carries the conversation so far, turns of a session never overlap, and the fake's prefix cache shows in the
records' cached tokens and the summary's hit rate."""

from __future__ import annotations

import pytest

from flying.procs import free_port
from loadgen import fake_server, metrics, runner
from loadgen.arrivals import Arrivals
from loadgen.conversation import chat_messages, completion_prompt, conversation_groups
from loadgen.workload import Lengths, PlannedRequest, Sessions, Turn, Workload, plan


def test_groups_keep_a_sessions_turns_together_in_order():
    turn = lambda s, k: PlannedRequest(0.0, "normal", f"q{s}{k}", 1, 1, turn=Turn(s, k, ""))  # noqa: E731
    alone = PlannedRequest(0.0, "normal", "x", 1, 1)
    assert conversation_groups([turn(0, 1), alone, turn(1, 0), turn(0, 0)]) == [[3, 0], [1], [2]]


def test_a_turn_sends_the_system_prompt_the_earlier_turns_and_its_question():
    req = PlannedRequest(0.0, "normal", "q3", 1, 1, turn=Turn(0, 2, "sys"))
    history = [("q1", " a1"), ("q2", " a2")]
    assert [m["role"] for m in chat_messages(req, history)] == ["system", "user", "assistant", "user", "assistant", "user"]  # fmt: skip
    assert chat_messages(req, history)[-1] == {"role": "user", "content": "q3"}
    earlier = completion_prompt(
        PlannedRequest(0.0, "normal", "q2", 1, 1, turn=Turn(0, 1, "sys")), history[:1]
    )
    assert completion_prompt(req, history).startswith(earlier + " a2"), "a turn extends the one before it"


@pytest.mark.parametrize("api", ["chat", "completions"])
async def test_sessions_run_their_turns_in_order_with_the_answers_and_report_cached_tokens(api):
    state = fake_server.EngineState(log=[])
    port = free_port()
    w = Workload(num_requests=4, arrivals=Arrivals("poisson", float("inf")), input_tokens=Lengths("fixed", 8, 8),
                 output_tokens=Lengths("fixed", 3, 3), sessions=Sessions(2, 40, 3))  # fmt: skip
    reqs = plan(w)
    cfg = runner.RunConfig(f"http://127.0.0.1:{port}", "m", api=api, max_concurrency=2)
    async with await fake_server.serve(port, itl_ms=1, state=state):
        records, duration = await runner.run(cfg, reqs)
    assert all(r.ok for r in records) and len(state.log) == 12
    for s in range(4):
        q = reqs[3 * s].prompt
        own = (
            [b for b in state.log if b["messages"][1]["content"] == q]
            if api == "chat"
            else [b for b in state.log if f"\nUser: {q}\n" in b["prompt"]]
        )
        assert len(own) == 3, "every turn of session s carries its first question"
        if api == "chat":
            assert [len(b["messages"]) for b in own] == [2, 4, 6]
            assert own[2]["messages"][2] == {"role": "assistant", "content": " tok tok tok"}
            assert own[2]["messages"][0]["content"] == reqs[3 * s].turn.system
        else:
            assert own[1]["prompt"].startswith(own[0]["prompt"] + " tok tok tok")
    for s in range(4):  # a later turn is sent after the turn before it ended
        turns = records[3 * s : 3 * s + 3]
        assert turns[0].end <= turns[1].sent_at and turns[1].end <= turns[2].sent_at
    first = records[0]
    assert first.cached_tokens is not None and first.cached_tokens < first.prompt_tokens
    later = [r for r, q in zip(records, reqs) if q.turn.session >= 2 or q.turn.index > 0]
    assert all(r.cached_tokens >= 40 for r in later), "later sessions and turns find their prefix"
    summary = metrics.summarize(records, duration)
    prompt, cached = sum(r.prompt_tokens for r in records), sum(r.cached_tokens for r in records)
    assert summary["cache_hit_rate"] == pytest.approx(cached / prompt) and 0.5 < summary["cache_hit_rate"] < 1


async def test_a_failed_turn_ends_its_session():
    port = free_port()  # nothing listens: the first turn fails, the rest are never sent
    reqs = plan(Workload(num_requests=1, sessions=Sessions(1, 10, 3)))
    records, _ = await runner.run(runner.RunConfig(f"http://127.0.0.1:{port}", "m", timeout_s=5), reqs)
    assert records[0].error.startswith("transport")
    assert [r.error for r in records[1:]] == ["session: turn 0 failed"] * 2
    assert all(r.sent_at != r.sent_at for r in records[1:]), "never sent (NaN)"
    assert metrics.summarize(records, 1.0)["errors"] == {"transport": 1, "session": 2}
