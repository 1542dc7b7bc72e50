"""Multi-turn sessions as they run (planned by :class:`loadgen.workload.Sessions`): which requests go out one
after another, and what a turn sends: the conversation so far (the system prompt, the earlier questions and the
model's answers to them) plus its own question.
"""

from __future__ import annotations

from collections.abc import Sequence

from loadgen.workload import PlannedRequest


def conversation_groups(requests: Sequence[PlannedRequest]) -> list[list[int]]:
    """Indices of ``requests`` in the order they go out: a session's turns as one group (in turn order), every
    request outside a session a group of its own; groups in order of their first request."""
    groups: list[list[int]] = []
    by_session: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        if r.turn is None:
            groups.append([i])
        elif r.turn.session in by_session:
            by_session[r.turn.session].append(i)
        else:
            by_session[r.turn.session] = [i]
            groups.append(by_session[r.turn.session])
    for g in by_session.values():
        g.sort(key=lambda i: requests[i].turn.index)  # type: ignore[union-attr]
    return groups


def chat_messages(req: PlannedRequest, history: Sequence[tuple[str, str]]) -> list[dict]:
    """The chat messages of a turn: system prompt, earlier (question, answer) pairs, its own question."""
    out = [{"role": "system", "content": req.turn.system}] if req.turn and req.turn.system else []
    for question, answer in history:
        out += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return out + [{"role": "user", "content": req.prompt}]


def completion_prompt(req: PlannedRequest, history: Sequence[tuple[str, str]]) -> str:
    """The same conversation as one completion prompt; a turn's prompt extends the previous turn's prompt and
    answer, so the whole of it is a prefix the engine has seen."""
    parts = [req.turn.system + "\n"] if req.turn and req.turn.system else []
    parts += [f"\nUser: {q}\nAssistant:{a}" for q, a in history]
    return "".join(parts) + f"\nUser: {req.prompt}\nAssistant:"
