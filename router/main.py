"""``flying-router``: the router process."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import typing

import prometheus_client
import redis
import redis.asyncio as aioredis

from flying import cli, logs, taskdump
from router.config import RouterConfig
from router.dispatcher import Dispatcher
from router.metrics import ClusterCollector
from router.policy import PolicyConfig

# One line per PolicyConfig field: what it does and its unit (``--help`` appends the default).
POLICY_HELP: dict[str, str] = {
    "load_adaptation": "bind engines into light_width groups under light load (TP latency); DP when busy",
    "priority": "bind a priority_width group for a high-priority request",
    "long_context": "bind a group whose pooled KV holds a request one engine's KV cannot",
    "light_width": "engines per group formed under light load (a power of two)",
    "priority_width": "engines per group bound for a high-priority request (a power of two)",
    "priority_preempt": "how a priority bind takes busy engines: hard pauses their DP work, sequential drains it",
    "long_preempt": "how a long-context bind takes busy engines (hard only where their free KV holds it)",
    "max_inflight_per_worker": "requests one DP engine is handed before the rest wait in Redis",
    "spread_s": "seconds: DP dispatch also counts requests an engine was sent within about this long",
    "tp_inflight_per_engine": "a group of width w takes w times this many TP requests at once",
    "regime": "what judges light and busy load: queued + inflight requests, or the admission rate",
    "light_load": "light: queued + inflight at most this share of the groups' capacity (for calm_s)",
    "calm_s": "seconds of light load before load groups form",
    "busy_load": "busy: queued + inflight above this share of the groups' capacity",
    "light_rate": "rate regime: light at most this many admissions per second per engine",
    "busy_rate": "rate regime: busy above this many admissions per second per engine",
    "rate_tau_s": "seconds: time constant of the admission rate's exponential average",
    "busy_wait_s": "seconds: busy once a normal request has waited this long in the queue",
    "keep_s": "seconds: a priority or long-context group without TP work for this long is released",
    "long_max_share": "long-context groups hold at most this share of the engines (one always allowed)",
    "long_wait_s": "seconds: under busy load a long request waits up to this long before binding",
    "max_defer_s": "seconds: a bind pauses DP work at most this long (then released, retracting)",
    "ack_timeout_s": "seconds: members must acknowledge a bind within this, else it is rolled back",
    "bind_timeout_s": "seconds: members must complete a bind within this (a sequential bind drains first)",
    "suspect_s": "seconds: a member that failed a bind is not picked for another one for this long",
    "kv_transform": "move KV between DP and TP layouts (bind by adoption, release by scatter) where engines can",
    "adopt_max_ms": "milliseconds: adopt only if the estimated KV transformation stalls the group at most this",
    "adopt_max_inflight": "adopt only if each member holds at most this many DP requests",
    "kv_bytes_per_token": "bytes of KV per token, for the transformation estimate (Llama-3-70B with FP8 KV)",
    "kv_link_gbps": "GB/s per member and direction, for the transformation estimate",
    "kv_transform_fixed_ms": "milliseconds: fixed cost per KV transformation, for the estimate",
    "dispatch": "DP dispatch: cache-aware follows the prompt's prefix to the engine that probably caches it "
    "(least loaded when none holds cache_threshold of it, or loads are out of balance); least-loaded ignores it",
    "cache_threshold": "cache-aware: share (0-1) of the prompt's prefix blocks the best engine must hold",
    "balance_abs_threshold": "cache-aware: requests; loads out of balance when max - min exceeds this ...",
    "balance_rel_threshold": "... and max exceeds this times min (then least loaded)",
}


def _policy_flags(p: argparse.ArgumentParser) -> None:
    """One flag per PolicyConfig field (``--light-width 4``, ``--no-load-adaptation``), defaults from the class."""
    g = p.add_argument_group("policy (see router/policy.py)")
    hints = typing.get_type_hints(PolicyConfig)
    for f in dataclasses.fields(PolicyConfig):
        flag, kind, text = "--" + f.name.replace("_", "-"), hints[f.name], POLICY_HELP[f.name]
        if kind is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=text)
        elif typing.get_origin(kind) is typing.Literal:
            g.add_argument(flag, choices=typing.get_args(kind), default=f.default, help=text)
        else:
            g.add_argument(flag, type=kind, default=f.default, help=text)
    g.add_argument(
        "--manual",
        action="store_true",
        help="no automatic groups: turn off load adaptation, priority and long-context binds (flyctl only)",
    )


def parser() -> argparse.ArgumentParser:
    d = RouterConfig()
    p = cli.parser("flying-router", "Dispatch the global Redis queue to engines; bind and release TP groups.")
    cli.add_redis_arguments(p)
    p.add_argument(
        "--poll-s",
        type=float,
        default=d.poll_s,
        help="seconds: longest sleep between rounds when nothing wakes it",
    )
    p.add_argument(
        "--lease-ms",
        type=int,
        default=d.lease_ms,
        help="milliseconds: leadership lease; a standby router takes over this long after a crash",
    )
    p.add_argument(
        "--metrics-port", type=int, default=d.metrics_port, help="port of the Prometheus metrics (0: off)"
    )
    p.add_argument("--metrics-host", default=d.metrics_host, help="address of the Prometheus metrics")
    logs.add_argument(p)
    _policy_flags(p)
    return p


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    d = RouterConfig()
    p = parser()
    a = p.parse_args(argv)
    policy = PolicyConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(PolicyConfig)})
    if a.manual:
        policy = dataclasses.replace(policy, load_adaptation=False, priority=False, long_context=False)
    return dataclasses.replace(
        d,
        redis_url=a.redis_url,
        key_prefix=a.key_prefix,
        poll_s=a.poll_s,
        lease_ms=a.lease_ms,
        policy=policy,
        metrics_port=a.metrics_port,
        metrics_host=a.metrics_host,
        log_format=a.log_format,
    )


async def serve(config: RouterConfig) -> None:
    client = aioredis.Redis.from_url(config.redis_url)
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
    sync = redis.Redis.from_url(config.redis_url, socket_timeout=2)
    registry.register(ClusterCollector(sync, dispatcher.keys, dispatcher.router_id))
    prometheus_client.start_http_server(config.metrics_port, config.metrics_host, registry=registry)
    logging.getLogger("flying.router").info(
        "metrics on http://%s:%d/metrics", config.metrics_host, config.metrics_port
    )


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    logs.setup(config.log_format)
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
