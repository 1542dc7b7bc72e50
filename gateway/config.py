"""Gateway configuration (frozen; CLI defaults are read from here)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GatewayConfig:
    model_path: str
    served_model_name: str = "tiny-llama"
    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "flying"
    gateway_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    max_queue: int = 4096  # 429 beyond this many waiting requests
    queue_timeout_s: float = 120.0  # 504 if not assigned within this
    no_worker_grace_s: float = 5.0  # 503 if no engine is live for this long while a request waits
    request_timeout_s: float = 600.0  # upstream read timeout
    default_max_tokens: int = 256
    max_body_bytes: int = 4 * 1024 * 1024
    max_attempts: int = 3  # dispatches per request when workers die before answering

    def __post_init__(self) -> None:
        assert self.max_queue >= 1, "max_queue must be >= 1"
        assert self.queue_timeout_s > 0 and self.request_timeout_s > 0, "timeouts must be > 0"
        assert self.default_max_tokens >= 1, "default_max_tokens must be >= 1"
        assert self.max_attempts >= 1, "max_attempts must be >= 1"
