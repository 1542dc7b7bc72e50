"""Gateway configuration: frozen; each setting's help is its one description, and ``flying-gateway``'s flags
are generated from the settings (:mod:`flying.config`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from flying import cli, settings
from flying.breaker import BreakerSettings
from flying.config import require, setting
from flying.logs import FORMAT_HELP, LogFormat
from gateway.http.connections import ConnectionLimits
from gateway.tracing import endpoint_from_env, service_name_from_env

DOOR = "limits at the door (per connection)"  # --help's sections
FAILURES = "failing engines"


def _budget_help(priority: str) -> str:
    return (
        f"seconds a {priority}-priority request may wait in the queue: 429 at once when the measured service rate "
        "predicts a longer wait, 504 when an admitted one has waited this long"
    )


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    model_path: str = setting(help="model (or tokenizer) directory, for prompt token counts (required)")
    served_model_name: str = setting("tiny-llama", "the model name clients ask for")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "HTTP port", type=cli.port)
    # gateway processes on the port (gateway.http.workers); each is a whole gateway
    workers: int = setting(
        1,
        "gateway processes sharing the port (SO_REUSEPORT): one serves about 2,000 requests/s on one core; "
        "each is a whole gateway, and /metrics on any of them counts all",
    )
    reuse_port: bool = setting(
        False,
        "bind the port with SO_REUSEPORT, so that other gateway processes can share it",
        flag="--reuse-port",
    )
    ssl_certfile: str | None = setting(
        None, "serve HTTPS with this certificate (PEM, the chain after it); needs --ssl-keyfile"
    )
    ssl_keyfile: str | None = setting(None, "the certificate's private key (PEM, unencrypted)")
    redis_url: str = setting(
        settings.DEFAULT_REDIS_URL, "the Redis the queue lives in", flags=cli.add_redis_arguments
    )
    key_prefix: str = "flying"
    gateway_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    max_queue: int = setting(
        4096,
        "requests waiting in the queue beyond which new ones get 429 (low priority at 60%, normal at 85%)",
    )
    queue_timeout_s: float = setting(
        120.0, "seconds a request may wait for an engine before it ends with 504"
    )
    max_wait_s: float = setting(
        60.0, "seconds: caps every priority's wait budget (0: no budgets; the queue is bounded by count only)"
    )
    wait_budget_high_s: float = setting(5.0, _budget_help("high"))
    wait_budget_normal_s: float = setting(20.0, _budget_help("normal"))
    wait_budget_low_s: float = setting(60.0, _budget_help("low"))
    no_worker_grace_s: float = 5.0  # 503 if no engine is live for this long while a request waits
    no_router_grace_s: float = 5.0  # degraded (new requests 503) once no router has held the lease this long
    request_timeout_s: float = 600.0  # upstream read timeout
    max_body_bytes: int = 4 * 1024 * 1024
    max_header_bytes: int = setting(16384, "431 beyond this many bytes of request header fields", group=DOOR)
    max_header_count: int = setting(100, "431 beyond this many request header fields", group=DOOR)
    max_url_bytes: int = setting(8192, "414 beyond this URL length", group=DOOR)
    header_timeout_s: float = setting(
        10.0, "seconds a request head may take to arrive (408); a silent connection is closed", group=DOOR
    )
    body_timeout_s: float = setting(
        30.0, "seconds a request body may take to arrive once its head has (408)", group=DOOR
    )
    # longer than clients keep an idle connection for reuse (httpx and the OpenAI SDK 5 s, aiohttp 15 s), so the
    # client gives it up first; a gateway that closes it first can meet a request the client sent at that moment,
    # which then ends in a reset
    keep_alive_timeout_s: float = setting(
        75.0, "seconds an idle keep-alive connection stays open", group=DOOR
    )
    max_connections: int = setting(
        4096, "open connections beyond which new ones are answered 503 with Retry-After", group=DOOR
    )
    # independent of the number of requests
    redis_max_connections: int = setting(
        32, "Redis connection pool size; requests wait for a connection beyond it"
    )
    # engines' circuit breakers (flying.breaker)
    breaker_failures: int = setting(
        5,
        "failed requests (refused, reset, timed out, 5xx) within --breaker-window-s that take an engine out of "
        "dispatch (its circuit breaker opens)",
        group=FAILURES,
    )
    breaker_window_s: float = setting(
        10.0, "seconds over which an engine's failed requests are counted", group=FAILURES
    )
    breaker_backoff_s: float = setting(
        2.0,
        "seconds an engine stays out of dispatch after its breaker opens, before a probe of its health endpoint; "
        "doubled for each trip in a row",
        group=FAILURES,
    )
    breaker_backoff_max_s: float = setting(60.0, "seconds: the longest back-off", group=FAILURES)
    # the n-th re-dispatch waits a random 50-100 % of min(redispatch_backoff_max_s, redispatch_backoff_s * 2^(n-1))
    redispatch_backoff_s: float = setting(
        0.05,
        "seconds before a request whose engine failed goes back to the queue (a random 50-100% of it, doubled "
        "for each attempt)",
        group=FAILURES,
    )
    redispatch_backoff_max_s: float = setting(
        1.0, "seconds: the longest re-dispatch back-off", group=FAILURES
    )
    max_attempts: int = 3  # dispatches per request when workers die before answering
    reconcile_s: float = 2.0  # how often all waiting requests' states are read in one round trip
    monitor_s: float = 0.25  # how often the cluster view and the service rate are refreshed
    drain_grace_s: float = setting(
        30.0,
        "seconds: on SIGTERM stop admitting, let requests in progress finish for at most this long, then exit",
    )
    default_max_tokens: int = setting(
        256, "tokens generated when a request sets no max_tokens (capped by the context left)"
    )
    # /v1/* needs one as a bearer token (none: open); from the environment and api_key_file
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_key_file: str | None = setting(
        None,
        f"API keys, one per line, or tenants with limits in a *.toml file (see docs/operations.md), added to "
        f"those in ${settings.API_KEYS} (comma-separated); with any, /v1/* needs 'Authorization: Bearer <key>' "
        "(none: open); SIGHUP reloads it",
    )
    metrics_require_key: bool = setting(False, "/metrics needs an API key too", flag="--metrics-require-key")
    early_dispatch: bool = setting(
        True,
        "send a request to its engine only after its admission (default: at light load, while it runs)",
        flag="--no-early-dispatch",
    )
    raw_engine_fields: bool = setting(
        False,
        "keep SGLang's fields beyond OpenAI's in answers (metadata, matched_stop, ...); default: removed",
        flag="--raw-engine-fields",
    )
    otlp_endpoint: str | None = setting(
        help="OpenTelemetry: send each request's spans to this OTLP/HTTP collector (http://collector:4318; "
        "default $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT); none: tracing off",
        factory=endpoint_from_env,
    )
    otel_service_name: str = setting(
        help="the traces' service.name (default $OTEL_SERVICE_NAME or flying-gateway)",
        factory=service_name_from_env,
    )
    log_format: LogFormat = setting("text", FORMAT_HELP)

    def __post_init__(self) -> None:
        _at_least("max_queue", self.max_queue, 1)
        _at_least("workers", self.workers, 1)
        require(
            (self.ssl_certfile is None) == (self.ssl_keyfile is None),
            "ssl_certfile and ssl_keyfile go together: HTTPS needs the certificate and its key",
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
    require(value >= low, f"{name} must be >= {low}{note}, got {value!r}")


def _above(name: str, value: float, low: float) -> None:
    require(value > low, f"{name} must be > {low}, got {value!r}")
