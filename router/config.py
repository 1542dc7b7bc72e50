"""Router configuration (frozen; CLI defaults are read from here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from flying.logs import LogFormat
from router.policy import PolicyConfig


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
