"""The router's event loop: hold the leadership lease, read queue and engines from Redis, apply the policy's
decisions with atomic assignments. Redis I/O lives here; decisions live in :mod:`router.policy`."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import redis.asyncio as aioredis

from flying.keys import Keys
from flying.queue import RequestQueue, reap_stale_inflight
from flying.workers import live_workers, registered_engines
from router.config import RouterConfig
from router.policy import EngineView, plan

log = logging.getLogger("flying.router")

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) and 1 or 0
"""


class Dispatcher:
    def __init__(self, config: RouterConfig, client: aioredis.Redis) -> None:
        self.config = config
        self.r = client
        self.keys = Keys(config.key_prefix)
        self.queue = RequestQueue(client, self.keys)
        self.router_id = uuid.uuid4().hex[:12]
        self._renew = client.register_script(_RENEW)
        self._live: set[int] = set()
        self._last_reap = 0.0
        self.dispatched = 0

    async def hold_lease(self) -> bool:
        return bool(
            await self._renew(keys=[self.keys.router_lease], args=[self.router_id, self.config.lease_ms])
        )

    async def engine_views(self) -> list[EngineView]:
        beats = await live_workers(self.r, self.keys)
        self._note_liveness({hb.engine for hb in beats})
        beats = [
            hb for hb in beats if hb.mode == "dp"
        ]  # bound engines take no DP work (TP dispatch: issue 4)
        counts = await self.queue.inflight_counts([hb.engine for hb in beats])
        return [
            EngineView(hb.engine, hb.url, counts[hb.engine], hb.free_kv_tokens, hb.max_total_tokens)
            for hb in beats
        ]

    def _note_liveness(self, live: set[int]) -> None:
        for e in sorted(live - self._live):
            log.info("engine %d is live", e)
        for e in sorted(self._live - live):
            log.warning(
                "engine %d lost (heartbeat expired); its gateways re-dispatch or fail its requests", e
            )
        self._live = live

    async def round(self) -> int:
        """One dispatch round; returns how many requests were assigned."""
        waiting = await self.queue.peek(self.config.peek)
        engines = await self.engine_views()
        if not waiting or not engines:
            return 0
        assigned = 0
        for d in plan(waiting, engines, self.config.max_inflight_per_worker):
            assigned += await self.queue.assign(d.request, d.engine, d.url)
        self.dispatched += assigned
        return assigned

    async def maintenance(self) -> None:
        now = time.monotonic()
        if now - self._last_reap < 5:
            return
        self._last_reap = now
        for e in await registered_engines(self.r, self.keys):
            if dropped := await reap_stale_inflight(self.queue, e):
                log.info("engine %d: dropped %d stale inflight entries", e, dropped)

    async def run(self, stop: asyncio.Event) -> None:
        log.info(
            "router %s starting (redis %s, prefix %s)",
            self.router_id,
            self.config.redis_url,
            self.keys.prefix,
        )
        leader = False
        while not stop.is_set():
            if not await self.hold_lease():
                if leader:
                    log.warning("lost the router lease; standing by")
                leader = False
                await asyncio.sleep(self.config.lease_ms / 4000)
                continue
            if not leader:
                log.info("router %s holds the lease; dispatching", self.router_id)
                leader = True
            if await self.round() == 0:
                await self.r.blpop([self.keys.wake], timeout=self.config.poll_s)
            await self.maintenance()
        await self.r.delete(self.keys.router_lease) if leader else None
