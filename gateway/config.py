"""Gateway configuration (frozen; CLI defaults are read from here)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from flying.breaker import BreakerSettings
from flying.logs import LogFormat
from gateway.http.connections import ConnectionLimits


@dataclass(frozen=True)
class GatewayConfig:
    model_path: str
    served_model_name: str = "tiny-llama"
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1  # gateway processes on the port (gateway.http.workers); each is a whole gateway
    reuse_port: bool = False  # bind with SO_REUSEPORT, so several gateway processes share the port
    ssl_certfile: str | None = None  # with ssl_keyfile: serve HTTPS with this certificate (chain), PEM
    ssl_keyfile: str | None = None  # the certificate's private key, PEM
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "flying"
    gateway_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    max_queue: int = 4096  # 429 beyond this many waiting requests (low priority at 60%, normal at 85%)
    max_wait_s: float = 60.0  # caps every class's wait budget; 0: no budgets (bound by count only)
    # each priority class's queue-wait budget: 429 at once when the measured service rate predicts a longer wait,
    # 504 when an admitted request has waited this long
    wait_budget_high_s: float = 5.0
    wait_budget_normal_s: float = 20.0
    wait_budget_low_s: float = 60.0
    queue_timeout_s: float = 120.0  # 504 if not assigned within this
    no_worker_grace_s: float = 5.0  # 503 if no engine is live for this long while a request waits
    no_router_grace_s: float = 5.0  # degraded (new requests 503) once no router has held the lease this long
    request_timeout_s: float = 600.0  # upstream read timeout
    default_max_tokens: int = 256
    max_body_bytes: int = 4 * 1024 * 1024
    max_attempts: int = 3  # dispatches per request when workers die before answering
    # a request whose engine failed goes back to the queue after a jittered back-off: the n-th re-dispatch waits
    # a random 50-100 % of min(redispatch_backoff_max_s, redispatch_backoff_s * 2^(n-1))
    redispatch_backoff_s: float = 0.05
    redispatch_backoff_max_s: float = 1.0
    # engines' circuit breakers (flying.breaker): this many failed requests within breaker_window_s take an engine
    # out of dispatch for breaker_backoff_s, doubled for each trip in a row up to breaker_backoff_max_s
    breaker_failures: int = 5
    breaker_window_s: float = 10.0
    breaker_backoff_s: float = 2.0
    breaker_backoff_max_s: float = 60.0
    redis_max_connections: int = 32  # the pool blocks beyond this; independent of the number of requests
    reconcile_s: float = 2.0  # how often all waiting requests' states are read in one round trip
    drain_grace_s: float = 30.0  # SIGTERM: requests in progress get this long to finish
    monitor_s: float = 0.25  # how often the cluster view and the service rate are refreshed
    # at the door (gateway.http.connections): 431 beyond these header bytes or fields, 414 beyond this URL length, 408
    # when a request head takes longer, 503 with Retry-After beyond this many open connections
    max_header_bytes: int = 16384
    max_header_count: int = 100
    max_url_bytes: int = 8192
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0  # a request body (its declared length) not complete within this: 408
    # an idle keep-alive connection is closed after this: longer than clients keep an idle connection for reuse
    # (httpx and the OpenAI SDK 5 s, aiohttp 15 s), so the client gives it up first; a gateway that closes it
    # first can meet a request the client sent at that moment, which then ends in a reset
    keep_alive_timeout_s: float = 75.0
    max_connections: int = 4096
    # /v1/* needs one as a bearer token (none: open)
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_key_file: str | None = None  # plain keys or TOML tenants (gateway.tenants); reloaded on SIGHUP
    metrics_require_key: bool = False  # /metrics needs a key too
    log_format: LogFormat = "text"  # flying.logs: text, or one JSON object per line
    raw_engine_fields: bool = (
        False  # keep SGLang's fields beyond OpenAI's in answers (gateway.api.engine_fields)
    )
    # at light load, send a request to its engine while its admission runs (gateway.early_dispatch)
    early_dispatch: bool = True
    # OpenTelemetry traces to this OTLP/HTTP collector (gateway.tracing); None: off
    otlp_endpoint: str | None = None
    otel_service_name: str = "flying-gateway"  # the traces' service.name

    def __post_init__(self) -> None:
        _at_least("max_queue", self.max_queue, 1)
        _at_least("workers", self.workers, 1)
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError(
                "ssl_certfile and ssl_keyfile go together: HTTPS needs the certificate and its key"
            )
        _above("queue_timeout_s", self.queue_timeout_s, 0)
        _above("request_timeout_s", self.request_timeout_s, 0)
        _at_least("default_max_tokens", self.default_max_tokens, 1)
        _at_least("max_attempts", self.max_attempts, 1)
        _at_least("redispatch_backoff_s", self.redispatch_backoff_s, 0)
        _at_least("redispatch_backoff_max_s", self.redispatch_backoff_max_s, self.redispatch_backoff_s)
        self.breaker  # noqa: B018 - validated on construction
        _at_least("max_wait_s", self.max_wait_s, 0, " (0: no bound by wait)")
        _above("keep_alive_timeout_s", self.keep_alive_timeout_s, 0)
        self.connection_limits  # noqa: B018 - validated on construction
        for p in ("high", "normal", "low"):
            _above(f"wait_budget_{p}_s", getattr(self, f"wait_budget_{p}_s"), 0)
        _at_least("redis_max_connections", self.redis_max_connections, 4)
        _above("reconcile_s", self.reconcile_s, 0)
        _above("body_timeout_s", self.body_timeout_s, 0)
        _above("monitor_s", self.monitor_s, 0)

    @property
    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(
            self.max_header_bytes,
            self.max_header_count,
            self.max_url_bytes,
            self.header_timeout_s,
            self.max_connections,
        )

    @property
    def breaker(self) -> BreakerSettings:
        return BreakerSettings(
            self.breaker_failures, self.breaker_window_s, self.breaker_backoff_s, self.breaker_backoff_max_s
        )

    def wait_budget_s(self, priority: str) -> float | None:
        """How long a request of ``priority`` may wait in the queue: its class's budget capped by ``max_wait_s``
        (None with ``max_wait_s`` 0: no budgets)."""
        if self.max_wait_s <= 0:
            return None
        return min(self.max_wait_s, getattr(self, f"wait_budget_{priority}_s"))

    def queue_wait_s(self, priority: str) -> float:
        """How long an admitted request of ``priority`` waits for an engine before it ends with 504."""
        budget = self.wait_budget_s(priority)
        return self.queue_timeout_s if budget is None else min(budget, self.queue_timeout_s)


def _at_least(name: str, value: float, low: float, note: str = "") -> None:
    if not value >= low:
        raise ValueError(f"{name} must be >= {low}{note}, got {value!r}")


def _above(name: str, value: float, low: float) -> None:
    if not value > low:
        raise ValueError(f"{name} must be > {low}, got {value!r}")
