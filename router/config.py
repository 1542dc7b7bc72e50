"""Router configuration: the policy's (:class:`PolicyConfig`) and the process's (:class:`RouterConfig`); frozen, CLI
defaults are read from here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from flying.logs import LogFormat
from flying.messages import Preempt

DispatchRule = Literal["cache-aware", "least-loaded"]


@dataclass(frozen=True)
class PolicyConfig:
    load_adaptation: bool = True
    priority: bool = True
    long_context: bool = True
    light_width: int = 2  # width of the groups formed under light load
    priority_width: int = 2  # width of a group bound for a high-priority request
    priority_preempt: Preempt = "hard"
    long_preempt: Preempt = "sequential"  # hard only where the members' free KV holds the request
    max_inflight_per_worker: int = 32  # requests one DP engine is handed before the rest wait in Redis
    spread_s: float = 0.0  # DP dispatch also counts the requests an engine was sent within about this long
    tp_inflight_per_engine: int = 4  # a group of width w takes w * this TP requests at once
    regime: Literal["inflight", "rate"] = "inflight"  # what says light or busy load (see update_regime)
    light_load: float = (
        0.5  # light: queued + inflight <= this share of the groups' capacity (all engines bound) ...
    )
    calm_s: float = 2.0  # ... for this long before load groups form
    busy_load: float = 1.0  # busy: queued + inflight above this share of the groups' capacity (or a wait)
    light_rate: float = 0.75  # rate regime: light at most this many admissions per second per engine ...
    busy_rate: float = 1.0  # ... busy above this many
    rate_tau_s: float = 2.0  # time constant of the admission rate's exponential average
    busy_wait_s: float = 0.25  # busy: a normal request has waited this long in the queue
    keep_s: float = 1.0  # a priority/long group without TP work for this long is released
    long_max_share: float = 0.5  # long groups hold at most this share of the engines (the rest stay DP)
    long_wait_s: float = 60.0  # under busy load a long request waits up to this long before binding
    max_defer_s: float = 5.0  # a bind pauses DP work at most this long (then released, retracting)
    ack_timeout_s: float = 2.0  # members must acknowledge a bind within this ...
    bind_timeout_s: float = 60.0  # ... and complete it within this (a sequential bind drains DP work first)
    suspect_s: float = 10.0  # a member that failed a bind is not picked for another one for this long
    # KV transformation (Bind.adopt / Release.scatter), used only where every member's heartbeat says kv_transform
    kv_transform: bool = True
    adopt_max_ms: float = 100.0  # a bind adopts only if its estimated transformation stalls the group <= this
    adopt_max_inflight: int = 64  # ... and its members hold at most this many DP requests each
    kv_bytes_per_token: int = 163_840  # for that estimate (Llama-3-70B, FP8 KV); see router.transform_cost
    kv_link_gbps: float = 360.0  # per member and direction
    kv_transform_fixed_ms: float = 4.0
    # DP dispatch (issue 16): by prefix affinity (router.prefix_index), or least loaded only
    dispatch: DispatchRule = "cache-aware"
    cache_threshold: float = 0.3  # follow the engine holding most of the prompt, at least this share ...
    balance_abs_threshold: float = 8.0  # ... unless loads differ by more than this ...
    balance_rel_threshold: float = 1.5  # ... and the highest is above this times the lowest

    def __post_init__(self) -> None:
        for name in ("light_width", "priority_width"):
            w = getattr(self, name)
            assert w >= 2 and w & (w - 1) == 0, f"{name} must be a power of two >= 2, got {w}"
        assert self.max_inflight_per_worker >= 1 and self.tp_inflight_per_engine >= 1
        assert self.light_load >= 0 and self.calm_s >= 0 and self.busy_wait_s > 0
        assert 0 <= self.light_rate <= self.busy_rate and self.rate_tau_s > 0
        assert 0 < self.ack_timeout_s <= self.bind_timeout_s, "need 0 < ack_timeout_s <= bind_timeout_s"
        assert 0 <= self.cache_threshold <= 1, f"cache_threshold {self.cache_threshold} not in [0, 1]"
        assert self.balance_abs_threshold >= 0 and self.balance_rel_threshold >= 1


@dataclass(frozen=True)
class RouterConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "flying"
    peek: int = 256  # queue head examined per dispatch round
    poll_s: float = 0.05  # longest sleep between rounds when nothing wakes the router
    lease_ms: int = 2000  # router leadership lease; a standby takes over this long after a crash
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    metrics_port: int = 0  # Prometheus metrics (router.metrics); 0: off
    metrics_host: str = "127.0.0.1"
    log_format: LogFormat = "text"  # flying.logs: text, or one JSON object per line

    def __post_init__(self) -> None:
        assert self.peek >= 1, "peek must be >= 1"
        assert 0 < self.poll_s <= 1, "poll_s must be in (0, 1]"
        assert self.lease_ms >= 500, "lease_ms must be >= 500"
