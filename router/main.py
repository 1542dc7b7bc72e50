"""``flying-router``: the router process."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import re
import signal

import prometheus_client

from flying import cli, logs, redis_conn, taskdump
from flying.config import add_flags, describe, from_flags
from router.config import MANUAL_OFF, Limits, PolicyConfig, RouterConfig
from router.dispatcher import Dispatcher
from router.metrics import ClusterCollector, scrape_client

# One line per field: what it does and its unit (``--help`` appends the default), from the field.
POLICY_HELP: dict[str, str] = describe(PolicyConfig)
ROUTER_HELP: dict[str, str] = describe(RouterConfig)


def _policy_flags(p: argparse.ArgumentParser) -> None:
    """One flag per PolicyConfig and Limits field (``--max-width 4``, ``--off park``), defaults from the classes."""
    g = p.add_argument_group("policy (see router/policy.py)")
    add_flags(g, PolicyConfig)
    g.add_argument(
        "--manual",
        action="store_true",
        help="no automatic groups: turn off load, priority and long-context groups (binds through flyctl only)",
    )
    add_flags(p.add_argument_group("limits"), Limits)


def parser() -> argparse.ArgumentParser:
    d = RouterConfig()
    p = cli.parser("flying-router", "Dispatch the global Redis queue to engines; bind and release TP groups.")
    cli.add_redis_arguments(p)
    p.add_argument("--poll-s", type=float, default=d.poll_s, help=ROUTER_HELP["poll_s"])
    p.add_argument("--lease-ms", type=int, default=d.lease_ms, help=ROUTER_HELP["lease_ms"])
    p.add_argument("--metrics-port", type=cli.port, default=d.metrics_port, help=ROUTER_HELP["metrics_port"])
    p.add_argument("--metrics-host", default=d.metrics_host, help=ROUTER_HELP["metrics_host"])
    p.add_argument(
        "--breaker-probe-timeout-s",
        type=float,
        default=d.breaker_probe_timeout_s,
        help=ROUTER_HELP["breaker_probe_timeout_s"],
    )
    p.add_argument("--stall-s", type=float, default=d.stall_s, help=ROUTER_HELP["stall_s"])
    logs.add_argument(p)
    _policy_flags(p)
    return p


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    d = RouterConfig()
    p = parser()
    a = p.parse_args(argv)
    try:
        return _config(d, a)
    except ValueError as exc:
        p.error(_in_flags(str(exc), p))  # exits


def _in_flags(message: str, p: argparse.ArgumentParser) -> str:
    """A config check's message with the settings it names as ``p``'s flags (``--max-width``)."""
    names = {a.dest for a in p._actions if a.option_strings}
    return re.sub(
        r"\b[a-z][a-z0-9_]*\b", lambda m: "--" + m[0].replace("_", "-") if m[0] in names else m[0], message
    )


def _config(d: RouterConfig, a: argparse.Namespace) -> RouterConfig:
    policy = from_flags(PolicyConfig, a)
    if a.manual:
        policy = dataclasses.replace(policy, off=policy.off | MANUAL_OFF)
    limits = from_flags(Limits, a)
    return dataclasses.replace(
        d,
        redis_url=cli.redis_url(a),
        key_prefix=a.key_prefix,
        poll_s=a.poll_s,
        lease_ms=a.lease_ms,
        policy=policy,
        limits=limits,
        metrics_port=a.metrics_port,
        metrics_host=a.metrics_host,
        log_format=a.log_format,
        breaker_probe_timeout_s=a.breaker_probe_timeout_s,
        stall_s=a.stall_s,
    )


async def serve(config: RouterConfig) -> None:
    client = redis_conn.async_client(config.redis_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    taskdump.install(loop)
    dispatcher = Dispatcher(config, client)
    if config.metrics_port:
        serve_metrics(dispatcher, config)
    try:
        await dispatcher.run(stop)
    finally:
        await client.aclose()


def serve_metrics(dispatcher: Dispatcher, config: RouterConfig) -> None:
    """Prometheus metrics on their own thread: the router's counters and the cluster's state read at scrape time
    (router.metrics)."""
    registry = dispatcher.metrics.registry
    sync = scrape_client(config.redis_url)
    registry.register(
        ClusterCollector(sync, dispatcher.keys, dispatcher.router_id, leading=lambda: dispatcher.leader)
    )
    try:
        prometheus_client.start_http_server(config.metrics_port, config.metrics_host, registry=registry)
    except OSError as exc:
        where = f"{config.metrics_host}:{config.metrics_port}"
        raise SystemExit(f"flying-router: cannot serve metrics on {where}: {exc.strerror or exc}") from None
    logging.getLogger("flying.router").info(
        "metrics on http://%s:%d/metrics", config.metrics_host, config.metrics_port
    )


def tune_gc() -> None:
    """Fewer, later collections of the older generations: a round allocates thousands of short-lived objects,
    and a full collection over the prefix index and the queue's records in the middle of one is its p99
    (docs/benchmarks.md, "Scale of the control plane"). What was loaded at start is frozen out of them."""
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD[0], GC_THRESHOLD[1], GC_THRESHOLD[2])


GC_THRESHOLD = (20_000, 20, 20)  # objects allocated before a young collection; young / middle ones per older


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    logs.setup(config.log_format)
    tune_gc()
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
