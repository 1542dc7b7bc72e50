"""``flying-gateway``: the OpenAI-style HTTP gateway process."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import socket
import sys
import time
from pathlib import Path

import redis
import uvicorn

from flying import cli, logs, redis_conn, settings
from flying.procs import port_taken
from gateway.app import create_app
from gateway.auth import read_keys
from gateway.config import GatewayConfig
from gateway.drain import Drain, DrainingServer
from gateway.http.connections import guarded_protocol
from gateway.http.cork import corked
from gateway.http.workers import PortTaken, Supervisor, reuse_port_socket, worker_command
from gateway.tenants import Tenants
from gateway.tracing import endpoint_from_env, service_name_from_env

log = logging.getLogger("flying.gateway")
REDIS_WAIT_S = 30.0  # at start, how long Redis may take to answer (it may be starting beside the gateway)


def parser() -> argparse.ArgumentParser:
    d = GatewayConfig(model_path="")
    p = cli.parser("flying-gateway", "OpenAI-style API over the flying-serving queue.")
    p.add_argument(
        "--model-path",
        required=True,
        help="model (or tokenizer) directory, for prompt token counts (required)",
    )
    p.add_argument("--served-model-name", default=d.served_model_name, help="the model name clients ask for")
    p.add_argument("--host", default=d.host, help="address to listen on")
    p.add_argument("--port", type=cli.port, default=d.port, help="HTTP port")
    p.add_argument(
        "--workers",
        type=int,
        default=d.workers,
        help="gateway processes sharing the port (SO_REUSEPORT): one serves about 2,000 requests/s on one core; "
        "each is a whole gateway, and /metrics on any of them counts all",
    )
    p.add_argument(
        "--reuse-port",
        action="store_true",
        help="bind the port with SO_REUSEPORT, so that other gateway processes can share it",
    )
    p.add_argument(
        "--ssl-certfile",
        help="serve HTTPS with this certificate (PEM, the chain after it); needs --ssl-keyfile",
    )
    p.add_argument("--ssl-keyfile", help="the certificate's private key (PEM, unencrypted)")
    cli.add_redis_arguments(p)
    p.add_argument(
        "--max-queue",
        type=int,
        default=d.max_queue,
        help="requests waiting in the queue beyond which new ones get 429 (low priority at 60%%, normal at 85%%)",
    )
    p.add_argument(
        "--queue-timeout-s",
        type=float,
        default=d.queue_timeout_s,
        help="seconds a request may wait for an engine before it ends with 504",
    )
    p.add_argument(
        "--max-wait-s",
        type=float,
        default=d.max_wait_s,
        help="seconds: caps every priority's wait budget (0: no budgets; the queue is bounded by count only)",
    )
    for prio in ("high", "normal", "low"):
        p.add_argument(
            f"--wait-budget-{prio}-s",
            type=float,
            default=getattr(d, f"wait_budget_{prio}_s"),
            help=f"seconds a {prio}-priority request may wait in the queue: 429 at once when the measured service "
            "rate predicts a longer wait, 504 when an admitted one has waited this long",
        )
    door = p.add_argument_group("limits at the door (per connection)")
    door.add_argument(
        "--max-header-bytes",
        type=int,
        default=d.max_header_bytes,
        help="431 beyond this many bytes of request header fields",
    )
    door.add_argument(
        "--max-header-count",
        type=int,
        default=d.max_header_count,
        help="431 beyond this many request header fields",
    )
    door.add_argument("--max-url-bytes", type=int, default=d.max_url_bytes, help="414 beyond this URL length")
    door.add_argument(
        "--header-timeout-s",
        type=float,
        default=d.header_timeout_s,
        help="seconds a request head may take to arrive (408); a silent connection is closed",
    )
    door.add_argument(
        "--body-timeout-s",
        type=float,
        default=d.body_timeout_s,
        help="seconds a request body may take to arrive once its head has (408)",
    )
    door.add_argument(
        "--keep-alive-timeout-s",
        type=float,
        default=d.keep_alive_timeout_s,
        help="seconds an idle keep-alive connection stays open",
    )
    door.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="open connections beyond which new ones are answered 503 with Retry-After",
    )
    p.add_argument(
        "--redis-max-connections",
        type=int,
        default=d.redis_max_connections,
        help="Redis connection pool size; requests wait for a connection beyond it",
    )
    failures = p.add_argument_group("failing engines")
    failures.add_argument(
        "--breaker-failures",
        type=int,
        default=d.breaker_failures,
        help="failed requests (refused, reset, timed out, 5xx) within --breaker-window-s that "
        "take an engine out of dispatch (its circuit breaker opens)",
    )
    failures.add_argument(
        "--breaker-window-s",
        type=float,
        default=d.breaker_window_s,
        help="seconds over which an engine's failed requests are counted",
    )
    failures.add_argument(
        "--breaker-backoff-s",
        type=float,
        default=d.breaker_backoff_s,
        help="seconds an engine stays out of dispatch after its breaker opens, before a probe of "
        "its health endpoint; doubled for each trip in a row",
    )
    failures.add_argument(
        "--breaker-backoff-max-s",
        type=float,
        default=d.breaker_backoff_max_s,
        help="seconds: the longest back-off",
    )
    failures.add_argument(
        "--redispatch-backoff-s",
        type=float,
        default=d.redispatch_backoff_s,
        help="seconds before a request whose engine failed goes back to the queue (a random "
        "50-100%% of it, doubled for each attempt)",
    )
    failures.add_argument(
        "--redispatch-backoff-max-s",
        type=float,
        default=d.redispatch_backoff_max_s,
        help="seconds: the longest re-dispatch back-off",
    )
    p.add_argument(
        "--drain-grace-s",
        type=float,
        default=d.drain_grace_s,
        help="seconds: on SIGTERM stop admitting, let requests in progress finish for at most this long, then exit",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=d.default_max_tokens,
        help="tokens generated when a request sets no max_tokens (capped by the context left)",
    )
    p.add_argument(
        "--api-key-file",
        help=f"API keys, one per line, or tenants with limits in a *.toml file (see docs/operations.md), added to "
        f"those in ${settings.API_KEYS} (comma-separated); with any, /v1/* needs 'Authorization: Bearer <key>' "
        "(none: open); SIGHUP reloads it",
    )
    p.add_argument("--metrics-require-key", action="store_true", help="/metrics needs an API key too")
    p.add_argument(
        "--no-early-dispatch",
        dest="early_dispatch",
        action="store_false",
        help="send a request to its engine only after its admission (default: at light load, while it runs)",
    )
    p.add_argument(
        "--raw-engine-fields",
        action="store_true",
        help="keep SGLang's fields beyond OpenAI's in answers (metadata, matched_stop, ...); default: removed",
    )
    p.add_argument(
        "--otlp-endpoint",
        default=endpoint_from_env(),
        help="OpenTelemetry: send each request's spans to this OTLP/HTTP collector (http://collector:4318; "
        "default $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT); none: tracing off",
    )
    p.add_argument(
        "--otel-service-name",
        default=service_name_from_env(),
        help="the traces' service.name (default $OTEL_SERVICE_NAME or flying-gateway)",
    )
    logs.add_argument(p)
    return p


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    d = GatewayConfig(model_path="")
    p = parser()
    a = p.parse_args(argv)
    try:
        return dataclasses.replace(
            d,
            model_path=a.model_path,
            served_model_name=a.served_model_name,
            host=a.host,
            port=a.port,
            workers=a.workers,
            reuse_port=a.reuse_port,
            ssl_certfile=a.ssl_certfile,
            ssl_keyfile=a.ssl_keyfile,
            redis_url=cli.redis_url(a),
            key_prefix=a.key_prefix,
            max_queue=a.max_queue,
            queue_timeout_s=a.queue_timeout_s,
            max_wait_s=a.max_wait_s,
            wait_budget_high_s=a.wait_budget_high_s,
            wait_budget_normal_s=a.wait_budget_normal_s,
            wait_budget_low_s=a.wait_budget_low_s,
            redis_max_connections=a.redis_max_connections,
            max_header_bytes=a.max_header_bytes,
            max_header_count=a.max_header_count,
            max_url_bytes=a.max_url_bytes,
            header_timeout_s=a.header_timeout_s,
            body_timeout_s=a.body_timeout_s,
            keep_alive_timeout_s=a.keep_alive_timeout_s,
            max_connections=a.max_connections,
            drain_grace_s=a.drain_grace_s,
            breaker_failures=a.breaker_failures,
            breaker_window_s=a.breaker_window_s,
            breaker_backoff_s=a.breaker_backoff_s,
            breaker_backoff_max_s=a.breaker_backoff_max_s,
            redispatch_backoff_s=a.redispatch_backoff_s,
            redispatch_backoff_max_s=a.redispatch_backoff_max_s,
            default_max_tokens=a.default_max_tokens,
            api_keys=read_keys(settings.api_keys(), None if toml(a.api_key_file) else a.api_key_file),
            api_key_file=a.api_key_file,
            metrics_require_key=a.metrics_require_key,
            log_format=a.log_format,
            raw_engine_fields=a.raw_engine_fields,
            early_dispatch=a.early_dispatch,
            otlp_endpoint=a.otlp_endpoint or None,
            otel_service_name=a.otel_service_name,
        )
    except ValueError as exc:  # a setting out of its range
        p.error(str(exc))
    except OSError as exc:  # the API key file
        p.error(f"--api-key-file {a.api_key_file}: {exc.strerror or exc}")


def toml(path: str | None) -> bool:
    return path is not None and Path(path).suffix == ".toml"


def load_tenants(config: GatewayConfig) -> Tenants:
    """The API keys, reloaded on SIGHUP (requests in progress keep their tenant; a bad file keeps the old keys)."""
    try:
        tenants = Tenants(settings.api_keys(), config.api_key_file)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"flying-gateway: cannot read the API keys: {exc}") from None
    signal.signal(signal.SIGHUP, lambda *_: tenants.reload())
    return tenants


def startable(config: GatewayConfig, redis_wait_s: float = REDIS_WAIT_S) -> None:
    """Exit with why, before anything starts, when the model's directory is missing, the port is taken (unless
    gateways share it: ``reuse_port``) or Redis does not answer a PING within ``redis_wait_s`` (retried meanwhile:
    it may be starting beside the gateway)."""
    path = config.model_path
    if path.startswith(("/", ".", "~")) and not Path(path).expanduser().is_dir():
        raise SystemExit(
            f"flying-gateway: --model-path {path}: no such directory (the model's tokenizer files)"
        )
    if not config.reuse_port and (why := port_taken(config.host, config.port)):
        raise SystemExit(f"flying-gateway: cannot serve on {config.host}:{config.port}: {why}")
    target = redis_conn.parse(config.redis_url)
    client = redis_conn.sync_client(config.redis_url, socket_timeout=2, socket_connect_timeout=2)
    deadline = time.monotonic() + redis_wait_s
    try:
        while True:
            try:
                client.ping()
                return
            except redis.RedisError as exc:
                if time.monotonic() >= deadline:
                    raise SystemExit(
                        f"flying-gateway: Redis at {target.describe()} did not answer for {redis_wait_s:.0f} s: {exc}"
                    ) from None
                log.warning("waiting for Redis at %s: %s", target.describe(), exc)
                time.sleep(1.0)
    finally:
        client.close()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    config = parse_args(argv)
    logs.setup(config.log_format)
    if config.workers > 1:
        if config.port == 0:
            raise SystemExit(
                "flying-gateway: --workers needs a fixed --port (with 0 each worker would get its own)"
            )
        bound(config).close()  # the port is free for the workers
        startable(config)
        sys.exit(Supervisor(worker_command(argv), config.workers, grace_s=config.drain_grace_s).run())
    # The request log writes a line per request: no caller lookup (a walk up the stack) and no thread or process
    # names per record, which neither format prints (logging's documented optimisations).
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    startable(config)
    drain = Drain()
    server_config = uvicorn.Config(
        create_app(config, drain=drain, tenants=load_tenants(config)),
        host=config.host,
        port=config.port,
        ssl_certfile=config.ssl_certfile,
        ssl_keyfile=config.ssl_keyfile,
        log_level="warning",
        log_config=None,  # uvicorn's own lines go through flying.logs' handler (and format)
        access_log=False,
        proxy_headers=False,  # no X-Forwarded-For rewriting of the client's address, which nothing here reads  # the gateway's request log says more (gateway.request_log); none is built per request
        timeout_graceful_shutdown=5,
        http=corked(guarded_protocol(config.connection_limits)),  # a response's head and body in one write
        timeout_keep_alive=config.keep_alive_timeout_s,  # type: ignore[arg-type]  # uvicorn accepts a float
    )
    sockets = [bound(config)] if config.reuse_port else None
    DrainingServer(server_config, drain, config.drain_grace_s).run(sockets=sockets)


def bound(config: GatewayConfig) -> socket.socket:
    """A socket bound to the gateway's host and port with ``SO_REUSEPORT``; exits with why it cannot be."""
    try:
        return reuse_port_socket(config.host, config.port)
    except PortTaken as exc:
        raise SystemExit(f"flying-gateway: {exc}") from None


if __name__ == "__main__":
    main()
