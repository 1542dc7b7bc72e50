"""``flying-gateway``: the OpenAI-style HTTP gateway process."""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import time
from pathlib import Path

import redis
import uvicorn

from flying import cli, logs, redis_conn, settings
from flying.config import add_flags, from_flags
from flying.procs import port_taken
from gateway.app import create_app
from gateway.auth import read_keys
from gateway.config import GatewayConfig
from gateway.drain import Drain, DrainingServer
from gateway.http.connections import guarded_protocol
from gateway.http.cork import corked
from gateway.http.workers import PortTaken, Supervisor, reuse_port_socket, worker_command
from gateway.tenants import Tenants

log = logging.getLogger("flying.gateway")
REDIS_WAIT_S = 30.0  # at start, how long Redis may take to answer (it may be starting beside the gateway)


def parser() -> argparse.ArgumentParser:
    p = cli.parser("flying-gateway", "OpenAI-style API over the flying-serving queue.")
    add_flags(p, GatewayConfig)
    return p


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    p = parser()
    a = p.parse_args(argv)
    try:
        return from_flags(
            GatewayConfig,
            a,
            redis_url=cli.redis_url(a),
            key_prefix=a.key_prefix,
            api_keys=read_keys(settings.api_keys(), None if toml(a.api_key_file) else a.api_key_file),
            otlp_endpoint=a.otlp_endpoint or None,
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
