"""The router's event loop: hold the leadership lease, read a snapshot (queue, engines, group records, regime) from
Redis, run the pure policy (:mod:`router.policy`) and apply its decisions: group records first, then bind/release
commands, then atomic assignments. A router killed at any point leaves Redis consistent: a group record exists
before its commands are sent (an unsent bind is rolled back when nobody acknowledges it), and each assignment is
one atomic script."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import msgspec
import redis.asyncio as aioredis

from flying import control
from flying.keys import Keys
from flying.messages import Group, RouterState, decode, encode
from flying.queue import RequestQueue, reap_stale_inflight
from flying.workers import live_workers, registered_engines
from router.config import RouterConfig
from router.policy import Decision, EngineView, GroupLoad, Snapshot, decide

log = logging.getLogger("flying.router")

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

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
        self._release = client.register_script(_RELEASE)
        self.leader = False
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
        counts = await self.queue.inflight_counts([hb.engine for hb in beats])
        return [
            EngineView(
                hb.engine,
                hb.url,
                counts[hb.engine],
                hb.free_kv_tokens,
                hb.max_total_tokens,
                mode=hb.mode,
                epoch=hb.epoch,
                pending=hb.pending,
                num_engines=hb.num_engines,
                beat_ts=hb.ts,
                kv_transform=hb.kv_transform,
            )
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

    async def snapshot(self) -> Snapshot:
        waiting = await self.queue.peek(self.config.peek)
        queued = await self.queue.depth()
        engines = await self.engine_views()
        groups = await read_groups(self.r, self.keys)
        loads = await self.queue.group_loads([(g.epoch, g.leader) for g in groups if g.state != "releasing"])
        admitted = int(await self.r.hget(self.keys.stats, "admitted") or 0)
        raw = await self.r.get(self.keys.router_state)
        state = (
            decode(raw, RouterState)
            if raw
            else RouterState(busy=True, calm_since=0.0, changed_at=time.time())
        )
        return Snapshot(
            now=time.time(),
            waiting=waiting,
            queued=queued,
            engines=engines,
            groups=groups,
            tp_load={ep: GroupLoad(*load) for ep, load in loads.items()},
            state=state,
            admitted=admitted,
        )

    async def apply(self, d: Decision) -> int:
        """Records, then commands, then assignments; returns how many requests were assigned."""
        k = self.keys
        binds = [msgspec.structs.replace(g, epoch=int(await self.r.incr(k.epoch))) for g in d.binds]
        pipe = self.r.pipeline(transaction=True)
        for g in [*d.put.values(), *binds]:
            pipe.hset(k.groups, str(g.epoch), encode(g))
        if d.drop:
            pipe.hdel(k.groups, *map(str, d.drop))
        pipe.set(k.router_state, encode(d.state))
        await pipe.execute()
        for note in d.notes:
            log.info("%s", note)
        for members, cmd in [*d.commands, *map(d.bind_command, binds)]:
            await control.send_async(self.r, k, members, cmd)
        assigned = 0
        for x in d.dispatches:
            assigned += await self.queue.assign(x.request, x.engine, x.url, epoch=x.epoch)
        self.dispatched += assigned
        return assigned

    async def round(self) -> int:
        """One policy round; returns how many requests were assigned (or groups changed)."""
        d = decide(await self.snapshot(), self.config.policy)
        changed = len(d.binds) + len(d.commands) + len(d.drop)
        return await self.apply(d) + changed

    async def maintenance(self) -> None:
        now = time.monotonic()
        if now - self._last_reap < 5:
            return
        self._last_reap = now
        for e in await registered_engines(self.r, self.keys):
            if dropped := await reap_stale_inflight(self.queue, e):
                log.info("engine %d: dropped %d stale inflight entries", e, dropped)

    async def run(self, stop: asyncio.Event) -> None:
        """Dispatch while holding the lease, until ``stop``. Redis errors (an outage, a restart) are ridden out:
        retry with backoff, then take the lease again and resume from what Redis holds."""
        log.info(
            "router %s starting (redis %s, prefix %s)",
            self.router_id,
            self.config.redis_url,
            self.keys.prefix,
        )
        self.leader, backoff, down_since = False, 0.1, None
        while not stop.is_set():
            try:
                await self.step()
            except aioredis.RedisError as exc:
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning("redis unavailable (%r); retrying with backoff", exc)
                self.leader = False
                await _sleep_or_stop(stop, backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            if down_since is not None:
                log.warning("redis is back after %.1f s; resuming", time.monotonic() - down_since)
                down_since, backoff = None, 0.1
        if self.leader:
            with contextlib.suppress(aioredis.RedisError):
                await self.release_lease()

    async def step(self) -> None:
        """Renew (or wait for) the lease; as leader, one policy round, then block on the wake list."""
        if not await self.hold_lease():
            if self.leader:
                log.warning("lost the router lease; standing by")
            self.leader = False
            await asyncio.sleep(self.config.lease_ms / 4000)
            return
        if not self.leader:
            groups = await read_groups(self.r, self.keys)
            log.info(
                "router %s holds the lease; dispatching (%d group records resumed)",
                self.router_id,
                len(groups),
            )
            self.leader = True
        if await self.round() == 0:
            await self.r.blpop([self.keys.wake], timeout=self.config.poll_s)
        await self.maintenance()

    async def release_lease(self) -> None:
        """Hand the lease over at once (a standby takes it at its next try instead of after it expires)."""
        await self._release(keys=[self.keys.router_lease], args=[self.router_id])


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def read_groups(r: aioredis.Redis, keys: Keys) -> list[Group]:
    return control.decode_groups(await r.hgetall(keys.groups))
