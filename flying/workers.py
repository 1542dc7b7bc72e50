"""Reading the worker registry: which engines are live (fresh heartbeat and ready HTTP endpoint)."""

from __future__ import annotations

import redis.asyncio as aioredis

from flying.keys import Keys
from flying.messages import Heartbeat, decode


def live_heartbeat(raw: bytes | str | None, ready: bytes | str | None) -> Heartbeat | None:
    """The heartbeat if the engine is live: heartbeat not expired and its server ready under the same launch."""
    if raw is None or ready is None:
        return None
    hb = decode(raw, Heartbeat)
    return hb if hb.launch_id == (ready.decode() if isinstance(ready, bytes) else ready) else None


async def registered_engines(r: aioredis.Redis, keys: Keys) -> list[int]:
    return sorted(int(x) for x in await r.smembers(keys.workers))


async def live_workers(r: aioredis.Redis, keys: Keys) -> list[Heartbeat]:
    """Heartbeats of engines whose heartbeat has not expired and whose server said it is ready."""
    engines = await registered_engines(r, keys)
    if not engines:
        return []
    beats = await r.mget([keys.worker(e) for e in engines])
    readies = await r.mget([keys.ready(e) for e in engines])
    return [hb for raw, ready in zip(beats, readies) if (hb := live_heartbeat(raw, ready)) is not None]
