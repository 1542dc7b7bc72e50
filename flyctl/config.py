"""The settings of flyctl's commands that take any: frozen; their flags are generated from them
(:mod:`flying.config`)."""

from __future__ import annotations

from dataclasses import dataclass

from flying import cli
from flying.config import setting
from flying.messages import Preempt


def _wait_help(otherwise: str) -> str:
    """``--wait S`` of a command that binds (``otherwise``: what it does without it)."""
    return (
        "wait up to S seconds until every member reports the group (exit 0) or the router rolls it back "
        f"(exit 1); default 0: {otherwise}"
    )


@dataclass(frozen=True, kw_only=True)
class Queue:
    limit: int = setting(
        20, "how many waiting requests to list", flag="-n", metavar="N", type=cli.non_negative(int)
    )


@dataclass(frozen=True, kw_only=True)
class Watch:
    interval: float = setting(
        1.0, "seconds between refreshes (default 1, at least 0.1)", type=cli.at_least(float, 0.1)
    )
    count: int = setting(0, "stop after this many refreshes (0: until Ctrl-C)", type=cli.non_negative(int))


@dataclass(frozen=True, kw_only=True)
class Bind:
    preempt: Preempt = setting(
        "hard",
        "how the members' DP work makes way: hard sets it aside at the next step, sequential drains it first, "
        "soft drains it while the group's first requests start in DP (prefilled again at the bind)",
    )
    adopt: bool = setting(
        False, "the members' DP requests become the group's (no drain, no recompute)", flag="--adopt"
    )
    wait: float = setting(
        0.0,
        _wait_help("print the epoch and return (the router binds it in the background)"),
        metavar="S",
        type=cli.non_negative(float),
    )
    sp_threshold: int | None = setting(
        None,
        "the group's steps of at least this many batched tokens run sequence-parallel (0: never; default: the "
        "leader's flying-worker --sp-threshold)",
        type=cli.non_negative(int),
    )


@dataclass(frozen=True, kw_only=True)
class Resume:
    wait: float = setting(
        0.0, _wait_help("print the new epoch and return"), metavar="S", type=cli.non_negative(float)
    )
