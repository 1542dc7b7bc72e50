"""What a gateway knows of the cluster: the live engines (their heartbeats), whether a router holds the lease,
since when no engine has been live, whether the router pools KV for long requests, and from these the largest
request the deployment can hold and why it cannot serve (if it cannot). :meth:`ClusterView.observe` refreshes it
once per monitor tick, in one round trip that also renews this gateway's liveness key."""

from __future__ import annotations

import asyncio
import time
from typing import NamedTuple

import msgspec
import redis.asyncio as aioredis

from flying.groups import pool_sets
from flying.keys import Keys
from flying.messages import PRIORITY_CLASS, FastTarget, Heartbeat, RouterState, decode
from flying.workers import live_workers
from gateway.config import GatewayConfig

# the liveness key's TTL; refreshed every monitor_s (the router reaps a dead gateway's work)
GATEWAY_TTL_MS = 3000
# engines seen live this recently may be re-announcing (a Redis failover dropped their keys)
LIVENESS_GAP_S = 3.0
PRIORITIES = sorted(PRIORITY_CLASS, key=PRIORITY_CLASS.__getitem__)  # high first


class Tick(NamedTuple):
    """One observation's counts beyond the view itself (for the service rate)."""

    now: float  # time.monotonic() when it was read
    assigned: int  # the deployment's ``assigned`` counter
    depth: int  # requests waiting in the global queue
    admitted: tuple[int, ...] = (0, 0, 0)  # the ``admitted_<priority>`` counters, high first
    completed: int = 0  # the deployment's ``completed`` counter (requests served to their end)
    engine_waiting: int = 0  # requests the live engines hold in their own waiting queues (heartbeats)
    engine_held: int = 0  # requests assigned to the live engines and not ended (their inflight sets)
    engine_running: int = 0  # requests the live engines run now (heartbeats)


def _fast_targets(raw: bytes | None) -> list[FastTarget]:
    """The router's fast-path targets as published (none if absent or unreadable: then nothing goes early)."""
    try:
        return msgspec.json.decode(raw, type=list[FastTarget]) if raw else []
    except msgspec.DecodeError:
        return []


class ClusterView:
    """The cluster as this gateway sees it. The engines' heartbeats are read at most every ``max_age_s`` and
    concurrent callers share one read; the router's lease and the engines' absence are tracked per
    :meth:`observe` (through :meth:`update`, which tests drive directly)."""

    def __init__(self, client: aioredis.Redis, keys: Keys, config: GatewayConfig) -> None:
        self.r = client
        self.keys = keys
        self.gateway_id = config.gateway_id
        self.no_router_grace_s = config.no_router_grace_s
        self._workers: tuple[float, list[Heartbeat]] = (-1e9, [])
        self._refresh: asyncio.Future[list[Heartbeat]] | None = None  # the one read in flight
        self.last_live = -1e9  # when a read last found a live engine
        self.no_workers_since: float | None = None
        # the first observation that found no router holding the lease, since the last one that found one (None:
        # one held it at the last observation); observations, not the clock, so a monitor delayed by a busy
        # event loop does not read as a missing router
        self.lease_missing_since: float | None = None
        self.pooled_context = True  # the router binds groups for long requests (from its published state)
        # how long the router holds a long request of normal priority for calm (from its published state too)
        self.long_wait_s = 0.0
        # at the last observation: the router's fast-path targets, the queue's depth, each live engine's inflight
        self.fast: list[FastTarget] = []
        self.depth = 0
        self.held: dict[int, int] = {}
        self.observed_at = -1e9

    async def workers(self, max_age_s: float = 0.25) -> list[Heartbeat]:
        """The live engines, as read at most ``max_age_s`` ago; concurrent callers share one refresh."""
        ts, beats = self._workers
        if time.monotonic() - ts <= max_age_s:
            return beats
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._read_workers())
        return await asyncio.shield(self._refresh)

    async def _read_workers(self) -> list[Heartbeat]:
        beats = await live_workers(self.r, self.keys)
        if beats:
            self.last_live = time.monotonic()
        raw = await self.r.get(self.keys.router_state)
        state = decode(raw, RouterState) if raw else RouterState()
        self.pooled_context, self.long_wait_s = state.long_context, state.long_wait_s
        self._workers = (time.monotonic(), beats)
        return beats

    async def workers_again(self, within_s: float = 2.0) -> list[Heartbeat]:
        """The live engines, read again every 0.1 s for up to ``within_s`` while none is, if some were live within
        ``LIVENESS_GAP_S``: a Redis failover longer than their ready keys' TTL drops them until they write them
        again (a moment after the new primary answers), and a request then should wait, not get a 503."""
        deadline = time.monotonic() + within_s
        beats = await self.workers(max_age_s=0)
        while (
            not beats and time.monotonic() - self.last_live < LIVENESS_GAP_S and time.monotonic() < deadline
        ):
            await asyncio.sleep(0.1)
            beats = await self.workers(max_age_s=0)
        return beats

    async def announce(self) -> None:
        """Set this gateway's liveness key (start-up; :meth:`observe` renews it)."""
        await self.r.set(self.keys.gateway(self.gateway_id), self.gateway_id, px=GATEWAY_TTL_MS)

    async def observe(self) -> Tick:
        """Re-read the engines, renew the liveness key, and read the router's lease, the ``assigned``,
        ``completed`` and per-class ``admitted`` counters, the queue's depth, the router's fast-path targets and
        the live engines' inflight sets' sizes (one pipeline)."""
        beats = await self.workers(max_age_s=0)
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self.keys.gateway(self.gateway_id), self.gateway_id, px=GATEWAY_TTL_MS)
        pipe.hmget(self.keys.stats, ["assigned", "completed", *(f"admitted_{p}" for p in PRIORITIES)])
        pipe.exists(self.keys.router_lease)
        pipe.zcard(self.keys.queue)
        pipe.get(self.keys.fast_path)
        for hb in beats:
            pipe.scard(self.keys.inflight(hb.engine))
        _, (assigned, completed, *admitted), lease, depth, fast, *held = await pipe.execute()
        now = time.monotonic()
        self.update(now, live=bool(beats), lease=bool(lease))
        self.fast = _fast_targets(fast)
        self.depth, self.held, self.observed_at = depth, {hb.engine: n for hb, n in zip(beats, held)}, now
        admitted_n = tuple(int(a or 0) for a in admitted)
        waiting, running = sum(hb.waiting for hb in beats), sum(hb.running for hb in beats)
        return Tick(
            now, int(assigned or 0), depth, admitted_n, int(completed or 0), waiting, sum(held), running
        )

    def update(self, now: float, live: bool, lease: bool) -> None:
        """Note what one observation at ``now`` saw: some engine ``live``, a router holding the ``lease``."""
        if lease:
            self.lease_missing_since = None
        elif self.lease_missing_since is None:
            self.lease_missing_since = now
        if live:
            self.no_workers_since = None
        elif self.no_workers_since is None:
            self.no_workers_since = now

    def no_workers_for(self, now: float) -> float:
        """How long no engine has been live, as of ``now`` (0 while one is)."""
        return 0.0 if self.no_workers_since is None else now - self.no_workers_since

    def router_missing(self) -> bool:
        """Observations have found no router holding the lease for ``no_router_grace_s``: nothing would dispatch
        a new request."""
        return self._lease_missing_for() > self.no_router_grace_s

    def _lease_missing_for(self) -> float:
        since = self.lease_missing_since
        return 0.0 if since is None else time.monotonic() - since

    def degraded(self) -> list[str]:
        """Why this deployment cannot serve new requests now (empty: it can)."""
        why = []
        if self.no_workers_since is not None:
            why.append("no live engine")
        if self.router_missing():
            why.append(f"no router has held the lease for {self._lease_missing_for():.0f} s")
        return why

    def limit(self, beats: list[Heartbeat]) -> int:
        """:meth:`context_limit` as the router places long requests now."""
        return self.context_limit(beats, self.pooled_context)

    @staticmethod
    def context_limit(beats: list[Heartbeat], pooled: bool = True) -> int:
        """Largest prompt+output the deployment can hold: one engine's context length, capped by the KV of the
        widest group whose members are all live (one engine's KV when engines cannot bind)."""
        live = {hb.engine for hb in beats}
        per_engine = min(hb.max_total_tokens for hb in beats)
        pools = {(hb.pool_first, hb.num_engines) for hb in beats}  # every node's pool (a group stays in one)
        sets = [ms for first, n in pools for ms in pool_sets(first, n)] if pooled else []
        widest = max((len(ms) for ms in sets if set(ms) <= live), default=1)
        kv = max(max(hb.max_total_tokens for hb in beats), widest * per_engine)
        return min(max(hb.context_len for hb in beats), kv)
