"""``flying-router``: the router process."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal

import redis.asyncio as aioredis

from flying import settings
from router.config import RouterConfig
from router.dispatcher import Dispatcher


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    d = RouterConfig()
    p = argparse.ArgumentParser(
        prog="flying-router", description="Dispatch the global Redis queue to engines."
    )
    p.add_argument("--redis-url", default=settings.redis_url())
    p.add_argument("--key-prefix", default=settings.key_prefix())
    p.add_argument("--max-inflight-per-worker", type=int, default=d.max_inflight_per_worker)
    p.add_argument("--poll-s", type=float, default=d.poll_s)
    p.add_argument("--lease-ms", type=int, default=d.lease_ms)
    a = p.parse_args(argv)
    return dataclasses.replace(
        d,
        redis_url=a.redis_url,
        key_prefix=a.key_prefix,
        max_inflight_per_worker=a.max_inflight_per_worker,
        poll_s=a.poll_s,
        lease_ms=a.lease_ms,
    )


async def serve(config: RouterConfig) -> None:
    client = aioredis.Redis.from_url(config.redis_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await Dispatcher(config, client).run(stop)
    finally:
        await client.aclose()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
