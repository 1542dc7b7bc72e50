"""Router configuration: the policy's (:class:`PolicyConfig`) and the process's (:class:`RouterConfig`); frozen, CLI
defaults are read from here."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal

from flying.config import require as _require
from flying.config import setting
from flying.logs import LogFormat
from flying.messages import Preempt

DispatchRule = Literal["cache-aware", "least-loaded"]


@dataclass(frozen=True)
class PolicyConfig:
    """The bind/release policy's settings (:mod:`router.policy`). Each field's ``help`` is its one description:
    ``flying-router --help`` shows it (one flag per field), ``flying-sim --policy FIELD=VALUE`` sets it."""

    load_adaptation: bool = setting(
        True, "bind load groups of the width the planner predicts best (up to max_width); off: DP"
    )
    priority: bool = setting(True, "bind a priority_width group for a high-priority request")
    long_context: bool = setting(True, "bind a group whose pooled KV holds a request one engine's KV cannot")
    max_width: int = setting(
        8, "widest load group the planner considers (a power of two; at most a node's engines): 1 keeps DP"
    )
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
    priority_width: int = setting(2, "engines per group bound for a high-priority request (a power of two)")
    priority_preempt: Preempt = setting(
        "hard", "how a priority bind takes busy engines: hard pauses their DP work, sequential drains it"
    )
    long_preempt: Preempt = setting(
        "hard",
        "how a long-context bind takes busy engines (hard only where their free KV holds it, then by adoption "
        "where they transform KV; sequential drains them first)",
    )
    max_inflight_per_worker: int = setting(
        256, "requests one DP engine is handed before the rest wait in Redis"
    )
    spread_s: float = setting(
        3.0, "seconds: DP dispatch also counts requests an engine was sent within about this long"
    )
    tp_inflight_per_engine: int = setting(8, "a group of width w takes w times this many TP requests at once")
    sp_inflight_per_engine: int = setting(
        256,
        "... a load or priority group running no long request takes w times this many (its large steps run "
        "sequence-parallel: as many as its members would hold in DP)",
    )
    keep_s: float = setting(
        1.0, "seconds: a priority or long-context group without TP work for this long is released"
    )
    long_max_share: float = setting(
        0.5, "long-context groups hold at most this share of the engines (one always allowed)"
    )
    long_wait_s: float = setting(
        180.0,
        "seconds: a long request of normal or low priority waits up to this long for calm (admissions within "
        "long_calm_rate, small backlog, no other long request running) before it runs; where groups are parked, "
        "during a burst (admissions above busy_rate) it waits on, up to twice this; high priority never waits",
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
    kv_transform: bool = setting(
        True, "move KV between DP and TP layouts (bind by adoption, release by scatter) where engines can"
    )
    spread_ownership: bool = setting(
        True,
        "a bound group's TP requests go to its members in turn, each streaming its own, so a release scatters them "
        "evenly (where the members transform KV); off: all to the leader",
    )
    adopt_max_ms: float = setting(
        200.0,
        "milliseconds: adopt only if the estimated KV transformation stalls the group at most this (a block too "
        "costly to adopt whole binds narrower groups, whose SP prefill is slower until they widen)",
    )
    adopt_max_inflight: int = setting(128, "adopt only if each member holds at most this many DP requests")
    mixed_steps: bool = setting(
        True,
        "light load: a busy block binds at once with its members' DP requests kept running beside the group's steps "
        "(Bind.keep), where every member reports mixed_steps; otherwise it adopts or drains",
    )
    park: bool = setting(
        True,
        "busy load: a group serving a request no engine holds alone is released by parking it (its KV head "
        "slices kept on the members, no steps) where every member reports park, and resumed on the same members "
        "once load is light; off: the group keeps serving through the burst until that request ends",
    )
    long_min_width: int = setting(
        4,
        "engines per normal-priority long-context group at least, where groups are parked (a power of two, at most "
        "half a node's engines; the width its KV needs if wider): parked for a burst, its request's KV head slices "
        "leave each member more room for DP",
    )
    sp_threshold: int | None = setting(
        None,
        "batched tokens: a bound group's steps of at least this many (a prefill's tokens, a decode's sequences) "
        "run sequence-parallel, smaller ones in TP (0: never SP; unset: each worker's own --sp-threshold); sent "
        "in every bind",
    )
    dispatch: DispatchRule = setting(
        "cache-aware",
        "DP dispatch: cache-aware follows the prompt's prefix to the engine that probably caches it "
        "(least loaded when none holds cache_threshold of it, or loads are out of balance); least-loaded ignores it",
    )
    cache_threshold: float = setting(
        0.3, "cache-aware: share (0-1) of the prompt's prefix blocks the best engine must hold"
    )
    balance_abs_threshold: float = setting(
        8.0, "cache-aware: requests; loads out of balance when max - min exceeds this ..."
    )
    balance_rel_threshold: float = setting(1.5, "... and max exceeds this times min (then least loaded)")

    def __post_init__(self) -> None:
        for name, allowed in (("dispatch", typing.get_args(DispatchRule)),):
            _require(
                getattr(self, name) in allowed,
                f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}",
            )
        for name in ("priority_width",):
            w = getattr(self, name)
            _require(w >= 2 and w & (w - 1) == 0, f"{name} must be a power of two >= 2, got {w}")
        w = self.long_min_width
        _require(w >= 1 and w & (w - 1) == 0, f"long_min_width must be a power of two >= 1, got {w}")
        for name in ("max_inflight_per_worker", "tp_inflight_per_engine", "sp_inflight_per_engine"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        w = self.max_width
        _require(w >= 1 and w & (w - 1) == 0, f"max_width must be a power of two >= 1, got {w}")
        _require(self.long_wait_s >= 0, f"long_wait_s must be >= 0, got {self.long_wait_s}")
        for name in ("ttft_target_high_ms", "ttft_target_normal_ms", "tpot_target_ms", "horizon_s"):
            _require(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        _require(
            0 < self.ack_timeout_s <= self.bind_timeout_s,
            f"need 0 < ack_timeout_s <= bind_timeout_s, got {self.ack_timeout_s} and {self.bind_timeout_s}",
        )
        _require(
            self.sp_threshold is None or self.sp_threshold >= 0,
            f"sp_threshold must be >= 0 (0: never SP), got {self.sp_threshold}",
        )
        _require(0 <= self.cache_threshold <= 1, f"cache_threshold {self.cache_threshold} not in [0, 1]")
        _require(
            self.balance_abs_threshold >= 0,
            f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}",
        )
        _require(
            self.balance_rel_threshold >= 1,
            f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}",
        )


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
