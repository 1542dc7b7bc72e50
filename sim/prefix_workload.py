"""The shared-prefix workload: system prompts and multi-turn sessions, for the simulator.

Sessions arrive as a Poisson process; each uses one of ``system_prompts`` system prompts of ``system_tokens``
tokens and has 1 to ``max_turns`` turns; turn k's prompt is turn k-1's prompt and answer plus a new user message,
and it arrives an exponential think time after turn k-1 (whether turn k-1 has finished or not: an open loop). Token
ids are random (seeded), hashed with the gateway's own :func:`flying.prefix.block_hashes`, so the router's policy
sees the chains the gateway would record. ``system_prompts=0``: no shared prefixes at all (one turn each, every
prompt random, as long as a system prompt plus a user message).
"""

from __future__ import annotations

import numpy as np

from flying.prefix import block_hashes
from sim.prefix_cache import UNCAPPED
from sim.workload import SimRequest


def shared_prefix_workload(
    n: int = 2000,
    seed: int = 0,
    session_rate: float = 2.0,
    system_prompts: int = 8,
    system_tokens: int = 1500,
    max_turns: int = 4,
    user_tokens: tuple[int, int] = (50, 300),
    output_tokens: tuple[int, int] = (64, 512),
    think_s: float = 10.0,
    vocab: int = 128_000,
) -> list[SimRequest]:
    """``n`` requests by arrival; each carries the block chain of its prompt and answer (``SimRequest.blocks``)."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(vocab, size=system_tokens).tolist() for _ in range(system_prompts)]
    out: list[SimRequest] = []
    t = 0.0
    while len(out) < n:
        t += float(rng.exponential(1 / session_rate))
        if system_prompts:
            history = list(systems[int(rng.integers(system_prompts))])
            turns = int(rng.integers(1, max_turns + 1))
        else:
            history, turns = rng.integers(vocab, size=system_tokens).tolist(), 1  # (random: nothing shared)
        at = t
        for _ in range(min(turns, n - len(out))):
            prompt = (
                history + rng.integers(vocab, size=int(rng.integers(*user_tokens, endpoint=True))).tolist()
            )
            answer = rng.integers(vocab, size=int(rng.integers(*output_tokens, endpoint=True))).tolist()
            chain = tuple(block_hashes(prompt + answer, cap=UNCAPPED))
            out.append(SimRequest(at, "normal", len(prompt), len(answer), blocks=chain))
            history = prompt + answer
            at += float(rng.exponential(think_s))
    return sorted(out, key=lambda r: r.at)
