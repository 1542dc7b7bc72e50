"""Router configuration: the policy's (:class:`PolicyConfig`) and the process's (:class:`RouterConfig`); frozen, CLI
defaults are read from here."""

from __future__ import annotations

import argparse
import typing
from dataclasses import dataclass, field
from typing import Literal

from flying.config import require as _require
from flying.config import setting
from flying.logs import LogFormat

DispatchRule = Literal["cache-aware", "least-loaded"]
# how the policy's binds take busy engines (flying.messages.Preempt)
BindPreempt = Literal["hard", "sequential"]


# the policy's mechanisms, each on unless ``PolicyConfig.off`` names it
Mechanism = Literal[
    "load", "priority", "long-context", "kv-transform", "mixed-steps", "park", "spread-ownership"
]
MECHANISMS: dict[str, str] = {
    "load": "load groups of the width the planner predicts best (off: DP for load)",
    "priority": "a group for a high-priority request",
    "long-context": "a group whose pooled KV holds a request one engine's KV cannot",
    "kv-transform": "move KV between DP and TP layouts (bind by adoption, release by scatter) where engines can",
    "mixed-steps": "a busy block binds with its DP requests kept running beside the group's steps",
    "park": "under load, park a group serving a request no engine holds alone (KV kept), resume it when calm",
    "spread-ownership": "a group's TP requests go to its members in turn, so a release scatters them evenly",
}


def mechanisms(text: str) -> frozenset[Mechanism]:
    """``park,kv-transform`` -> those mechanisms ("" or "none": none); an unknown one is an error naming it."""
    names = frozenset(x.strip() for x in text.split(",") if x.strip() and x.strip() != "none")
    unknown = sorted(names - set(MECHANISMS))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown mechanism {', '.join(unknown)} (known: {', '.join(MECHANISMS)})"
        )
    return names  # type: ignore[return-value]


# ``flying-router --manual``: no automatic groups (binds through flyctl only)
MANUAL_OFF: frozenset[Mechanism] = frozenset({"load", "priority", "long-context"})


@dataclass(frozen=True)
class PolicyConfig:
    """The planner's objective and the mechanisms it may use (:mod:`router.policy`). Each field's ``help`` is its
    one description: ``flying-router --help`` shows it (one flag per field), ``flying-sim --policy FIELD=VALUE``
    sets it."""

    ttft_target_high_ms: float = setting(
        200.0, "milliseconds: the TTFT high-priority requests are planned for"
    )
    ttft_target_normal_ms: float = setting(1000.0, "milliseconds: the TTFT other requests are planned for")
    tpot_target_ms: float = setting(
        150.0, "milliseconds: the time per output token the planner keeps below (only its excess counts)"
    )
    horizon_s: float = setting(
        10.0, "seconds the planner predicts ahead (arrival rates are averaged over half of it)"
    )
    max_width: int = setting(
        8, "engines: the widest group the planner considers (a power of two; at most a node's engines); 1: DP"
    )
    long_wait_s: float = setting(
        180.0,
        "seconds: a long request of normal or low priority waits up to this long for calm before it runs (twice "
        "this during a burst where groups are parked); high priority never waits",
    )
    preempt: BindPreempt = setting(
        "hard",
        "how a bind takes busy engines: hard sets their DP work aside (or moves it into the group where they "
        "transform KV), sequential drains it first",
    )
    sp_threshold: int | None = setting(
        None,
        "batched tokens: a bound group's steps of at least this many run sequence-parallel, smaller ones in TP "
        "(0: never SP; unset: each worker's own --sp-threshold); sent in every bind",
    )
    dispatch: DispatchRule = setting(
        "cache-aware",
        "DP dispatch: cache-aware follows the prompt's prefix to the engine that probably caches it while loads "
        "are in balance; least-loaded ignores it",
    )
    off: frozenset[Mechanism] = setting(
        "none",
        "mechanisms the policy does not use: " + ", ".join(MECHANISMS),
        type=mechanisms,
        metavar="MECHANISM[,...]",
    )

    def on(self, mechanism: Mechanism) -> bool:
        """The policy uses ``mechanism``."""
        return mechanism not in self.off

    def __post_init__(self) -> None:
        _require(
            self.dispatch in typing.get_args(DispatchRule),
            f"dispatch must be one of {', '.join(typing.get_args(DispatchRule))}, got {self.dispatch!r}",
        )
        _require(
            self.preempt in typing.get_args(BindPreempt),
            f"preempt must be one of {', '.join(typing.get_args(BindPreempt))}, got {self.preempt!r}",
        )
        unknown = sorted(set(self.off) - set(MECHANISMS))
        _require(not unknown, f"off: unknown mechanism {', '.join(unknown)} (known: {', '.join(MECHANISMS)})")
        w = self.max_width
        _require(w >= 1 and w & (w - 1) == 0, f"max_width must be a power of two >= 1, got {w}")
        _require(self.long_wait_s >= 0, f"long_wait_s must be >= 0, got {self.long_wait_s}")
        for name in ("ttft_target_high_ms", "ttft_target_normal_ms", "tpot_target_ms", "horizon_s"):
            _require(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        _require(
            self.sp_threshold is None or self.sp_threshold >= 0,
            f"sp_threshold must be >= 0 (0: never SP), got {self.sp_threshold}",
        )


@dataclass(frozen=True)
class Limits:
    """What engines and the bind protocol allow the policy: capacities and safety timeouts, not choices. The
    policy plans within them (:func:`router.policy.decide`); ``flying-router`` takes each as a flag."""

    max_inflight_per_worker: int = setting(
        256, "requests one DP engine is handed before the rest wait in Redis (a group member takes as many)"
    )
    tp_inflight_per_engine: int = setting(
        8, "a group of width w running a long request takes w times this many TP requests at once"
    )
    sp_inflight_per_engine: int = setting(
        256,
        "... a load or priority group running no long request takes w times this many (its large steps run "
        "sequence-parallel: as many as its members would hold in DP)",
    )
    adopt_max_inflight: int = setting(
        128, "requests: a busy block is adopted into a group only while each member holds at most this many"
    )
    max_defer_s: float = setting(
        5.0, "seconds: a bind pauses DP work at most this long (then released, retracting)"
    )
    ack_timeout_s: float = setting(
        2.0, "seconds: members must acknowledge a bind within this, else it is rolled back"
    )
    bind_timeout_s: float = setting(
        60.0, "seconds: members must complete a bind within this (a sequential bind drains first)"
    )
    suspect_s: float = setting(
        10.0, "seconds: a member that failed a bind is not picked for another one for this long"
    )

    def __post_init__(self) -> None:
        for name in ("max_inflight_per_worker", "tp_inflight_per_engine", "sp_inflight_per_engine"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _require(
            0 < self.ack_timeout_s <= self.bind_timeout_s,
            f"need 0 < ack_timeout_s <= bind_timeout_s, got {self.ack_timeout_s} and {self.bind_timeout_s}",
        )
        for name in ("max_defer_s", "suspect_s"):
            _require(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class RouterConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "flying"
    peek: int = 256  # queue head examined per dispatch round
    poll_s: float = setting(0.05, "seconds: longest sleep between rounds when nothing wakes it")
    lease_ms: int = setting(
        1000,
        "milliseconds: leadership lease, renewed every quarter of it; a standby router takes over at most 1.25 "
        "times this after the active one crashed",
    )
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    limits: Limits = field(default_factory=Limits)
    metrics_port: int = setting(0, "port of the Prometheus metrics (0: off)")  # router.metrics
    metrics_host: str = setting("127.0.0.1", "address of the Prometheus metrics")
    log_format: LogFormat = "text"  # flying.logs: text, or one JSON object per line
    breaker_probe_timeout_s: float = setting(
        5.0, "seconds: an open circuit breaker's health probe that has not answered within this has failed"
    )
    stall_s: float = setting(
        30.0,
        "seconds: warn (and set flying_router_stalled) when requests wait or run and none was assigned, finished "
        "or re-queued for this long (0: off)",
    )

    def __post_init__(self) -> None:
        _require(
            self.breaker_probe_timeout_s > 0,
            f"breaker_probe_timeout_s must be > 0, got {self.breaker_probe_timeout_s}",
        )
        _require(self.peek >= 1, f"peek must be >= 1, got {self.peek}")
        _require(0 < self.poll_s <= 1, f"poll_s must be in (0, 1], got {self.poll_s}")
        _require(self.lease_ms >= 500, f"lease_ms must be >= 500, got {self.lease_ms}")
