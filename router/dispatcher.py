"""The router's event loop: hold the leadership lease, read a snapshot (queue, engines, group records, regime) from
Redis, run the pure policy (:mod:`router.policy`) and apply its decisions: group records first, then bind/release
commands, then atomic assignments. A router killed at any point leaves Redis consistent: a group record exists
before its commands are sent (an unsent bind is rolled back when nobody acknowledges it), and each assignment is
one atomic script."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid

import httpx
import msgspec
import redis.asyncio as aioredis

from flying import control
from flying.breaker import Breakers, BreakerSettings
from flying.cancel import reraise_if_cancelled
from flying.cost_model import CostModel
from flying.keys import Keys
from flying.messages import (
    Group,
    Heartbeat,
    QueuedRequest,
    RouterState,
    decode,
    encode,
    from_hash,
)
from flying.queue import RequestQueue, decode_row, orphans, reap_stale_inflight, text
from flying.workers import live_heartbeat, registered_engines
from router.breakers import FORGET_S, RouterBreakers
from router.config import RouterConfig
from router.cost_fit import CostFit, Fitter
from router.decision import Decision, Dispatch, plan
from router.engine_view import EngineView
from router.metrics import RouterMetrics
from router.parking import counts_toward
from router.policy import GroupLoad, Snapshot, decide
from router.prefix_index import PrefixIndex
from router.probe import Prober
from router.reuse import Reuse
from router.watchdog import MOVES, Change, Progress, Watchdog

log = logging.getLogger("flying.router")
# a gateway's liveness key gone this long: its requests are ended (a Redis restart is shorter)
GATEWAY_GRACE_S = 5.0

DECISION_LOG_LEN = 1000  # entries of flying:router:decisions kept (about; a bind or release is one or two)
ROUND_RETRY_S = 1.0  # seconds before a round that raised an unexpected error is tried again

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
        self._gateways_gone: dict[str, float] = {}  # gateway id -> when its liveness key was first seen gone
        self._http: httpx.AsyncClient | None = None  # for aborting a lost gateway's requests on their engines
        self._renewed_at = -1e9
        self._state_written = b""
        self._fast_written, self._fast_at = b"", 0.0  # the fast-path targets last published, and when
        self.dispatched = 0
        self.prefixes = PrefixIndex()  # what each engine's prefix cache probably holds (cache-aware dispatch)
        self.reuse = Reuse()  # how much of the dispatched prompts repeats (the planner's DP hit share)
        self.metrics = RouterMetrics()
        probe = BreakerSettings(probe_timeout_s=config.breaker_probe_timeout_s)
        self.breakers = RouterBreakers(Breakers(client, self.keys, probe))  # engines left out while failing
        self.watchdog = Watchdog(config.stall_s)
        self.costs = Fitter()  # the cost model fitted to the engines' step costs (router.cost_fit)
        # measures a group's steps on an idle node where the fit has none (router.probe)
        self.prober = Prober()

    async def hold_lease(self) -> bool:
        """Take or renew the lease; a leader renews once per quarter lease, not every round (a round at light
        load is a request's hop: it should cost as few round trips as possible)."""
        now = time.monotonic()
        if self.leader and now - self._renewed_at < self.config.lease_ms / 4000:
            return True
        held = bool(
            await self._renew(keys=[self.keys.router_lease], args=[self.router_id, self.config.lease_ms])
        )
        if held:
            self._renewed_at = now
        return held

    def _note_liveness(self, live: set[int]) -> None:
        for e in sorted(live - self._live):
            log.info("engine %d is live", e)
        for e in sorted(self._live - live):
            log.warning(
                "engine %d lost (heartbeat expired); its gateways re-dispatch or fail its requests", e
            )
        self._live = live

    async def snapshot(self) -> Snapshot:
        """Everything the policy reads, in two pipelined round trips (three while groups hold requests): the
        router's round costs a few Redis round trips, not one per key, so the hop a request pays stays short."""
        k, r = self.keys, self.r
        pipe = r.pipeline(transaction=False)
        pipe.zrange(k.queue, 0, self.config.peek - 1)
        pipe.zcard(k.queue)
        pipe.smembers(k.workers)
        pipe.hgetall(k.groups)
        pipe.hmget(k.stats, ["admitted", "admitted_prompt_tokens", "admitted_output_tokens", "admitted_high"])
        pipe.get(k.router_state)
        pipe.hgetall(k.breakers)
        pipe.smembers(k.suspects)
        ids, queued, registered, group_rows, counters, raw_state, breakers, suspects = await pipe.execute()
        admitted, prompt_tokens, output_tokens, high = (int(x or 0) for x in counters)
        ids, engines = [text(x) for x in ids], sorted(int(x) for x in registered)
        groups = control.decode_groups(group_rows)
        counted = [g for g in groups if g.state != "releasing"]
        pipe = r.pipeline(transaction=False)
        for rid in ids:
            pipe.hgetall(k.request(rid))
        for e in engines:
            pipe.get(k.worker(e))
            pipe.get(k.ready(e))
            pipe.scard(k.inflight(e))
        for g in counted:
            for m in g.members:
                pipe.smembers(k.inflight(m))
        suspects = sorted(text(x) for x in suspects)
        for rid in suspects:
            pipe.hmget(k.request(rid), ["state", "engine"])
        rows = await pipe.execute()
        n = len(rows) - len(suspects)
        rows, where = rows[:n], rows[n:]
        requests, rows = rows[: len(ids)], rows[len(ids) :]
        waiting = [from_hash(decode_row(row), QueuedRequest) for row in requests if row]
        beats, counts = [], {}
        for i, e in enumerate(engines):
            hb = live_heartbeat(rows[3 * i], rows[3 * i + 1])
            if hb is not None:
                beats.append(hb)
                counts[e] = int(rows[3 * i + 2])
        sets = iter(rows[3 * len(engines) :])  # one per member of each counted group, in order
        held = [sorted({text(x) for m in g.members for x in next(sets)}) for g in counted]
        self._note_liveness({hb.engine for hb in beats})
        state = (
            decode(raw_state, RouterState) if raw_state else RouterState(busy=True, changed_at=time.time())
        )
        views = [EngineView.from_heartbeat(hb, counts[hb.engine]) for hb in beats]
        devices = [hb.device for hb in beats]
        cost = await self._fit_costs(beats, devices)
        self.reuse.sync(views)
        if forgotten := self.prefixes.sync(views):
            log.info("engines %s: prefix cache index forgotten (restarted or gone)", forgotten)
        parked = {v.engine: v.parked for v in views}  # (before the breakers: an open one still holds its KV)
        views = self.breakers.dispatchable(views, breakers)
        return Snapshot(
            now=time.time(),
            waiting=waiting,
            queued=int(queued),
            engines=views,
            groups=groups,
            tp_load=await self._group_loads(counted, held, {hb.engine: hb.max_total_tokens for hb in beats}),
            state=state,
            admitted=admitted,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            admitted_high=high,
            cost=cost,
            sp_threshold=sp_threshold(self.config.policy.sp_threshold, beats),
            limits=self.config.limits,
            prefixes=self.prefixes,
            reuse=self.reuse.counters,
            held=parked,
            suspect_holders=await self._suspect_holders(suspects, where),
        )

    async def _suspect_holders(self, suspects: list[str], where: list[list]) -> frozenset[int]:
        """The engines running a suspect request (``where``: each one's record's state and engine); the ids of
        those that ended, or whose record expired, leave ``flying:suspects``."""
        holders, ended = set(), []
        for rid, (state, engine) in zip(suspects, where):
            state = text(state) if state is not None else None
            if state == "assigned" and engine is not None:
                holders.add(int(engine))
            elif state != "queued":
                ended.append(rid)
        if ended:
            await self.r.srem(self.keys.suspects, *ended)
        return frozenset(holders)

    async def _fit_costs(self, beats: list[Heartbeat], devices: list[str]) -> CostModel:
        """Refit the cost model to the live engines' step costs (every few seconds while they change); a new fit
        is stored in Redis, where a restarted or standby router finds it."""
        samples = [c for hb in beats for c in hb.step_costs]
        if (new := self.costs.update(time.monotonic(), samples, devices)) is not None:
            await self.r.set(self.keys.cost_model, encode(new))
            self.metrics.observe_fit(new)
            curves = ", ".join(
                f"{c.mode}{c.width} {c.ms:.1f} ms + {c.ms_per_token:.4f}/token" for c in new.curves
            )
            log.info("cost model refitted (%s prior): %s", new.prior, curves or "no curve yet")
        return self.costs.model(devices)

    async def load_costs(self) -> None:
        """Start from the fit a previous router stored (none: the prior)."""
        raw = await self.r.get(self.keys.cost_model)
        if raw:
            try:
                self.costs = Fitter(decode(raw, CostFit))
            except msgspec.DecodeError as exc:
                log.warning("%s unreadable (%s): fitting anew", self.keys.cost_model, exc)

    async def _group_loads(
        self, groups: list[Group], held: list[list[str]], kv: dict[int, int]
    ) -> dict[int, GroupLoad]:
        """Per group: its TP requests (assigned to any of its members in its epoch, or parked in an epoch it is or
        carries: :func:`router.parking.counts_toward`, by its leader's KV in ``kv``, as the leader picks them;
        unfinished: each member owns those sent to it), their KV tokens and the largest one's, from one pipelined
        read of the requests in the members' inflight sets (``held``: per group, their ids)."""
        pipe = self.r.pipeline(transaction=False)
        for rids in held:
            for rid in rids:
                pipe.hmget(self.keys.request(rid), ["epoch", "prompt_tokens", "max_tokens"])
        rows = iter(await pipe.execute() if any(held) else [])
        out = {}
        widest = max(kv.values(), default=0)
        for g, rids in zip(groups, held):
            one, n, tokens, top = kv.get(g.leader, widest), 0, 0, 0
            for _ in rids:
                ep, p, m = next(rows)
                size = int(p or 0) + int(m or 0)
                if ep is not None and counts_toward(g, int(ep), size, one):
                    n, tokens, top = n + 1, tokens + size, max(top, size)
            out[g.epoch] = GroupLoad(n, tokens, top)
        return out

    async def apply(self, d: Decision) -> int:
        """Records (with the round's decision-log entries), then commands, then assignments
        (:func:`router.decision.plan`); returns how many requests were assigned."""
        k = self.keys
        p = plan(d, [int(await self.r.incr(k.epoch)) for _ in d.binds])
        state = encode(p.state)
        if p.records or p.drop or p.events or state != self._state_written:
            pipe = self.r.pipeline(transaction=True)
            for g in p.records:
                pipe.hset(k.groups, str(g.epoch), encode(g))
            if p.drop:
                pipe.hdel(k.groups, *map(str, p.drop))
            pipe.set(k.router_state, state)
            for entry in p.log(time.time()):
                pipe.xadd(k.decisions, {"event": encode(entry)}, maxlen=DECISION_LOG_LEN, approximate=True)
            await pipe.execute()
            self._state_written = state
        for note in p.events:
            log.info("%s", note)
        for members, cmd in p.sends:
            await control.send_async(self.r, k, members, cmd)
        moves = [(x.request, x.engine, x.url, x.epoch) for x in p.dispatches]
        assigned = await self.queue.assign_many(moves)
        p.record_dispatches(self.prefixes, self.reuse)
        self.dispatched += assigned
        if moves:
            _log_dispatches(p.dispatches, assigned)
        await self.publish_fast(d.fast)
        return assigned

    async def publish_fast(self, targets: list) -> None:
        """The fast-path targets for the gateways' admission script (PX 1 s: they vanish with the router); written
        when they change and at least every 0.3 s, deleted when there are none."""
        raw, now = encode(targets), time.monotonic()
        if raw == self._fast_written and now - self._fast_at < 0.3:
            return
        if targets:
            await self.r.set(self.keys.fast_path, raw, px=1000)
        elif self._fast_written != b"[]":
            await self.r.delete(self.keys.fast_path)
        self._fast_written, self._fast_at = raw, now

    async def round(self) -> int:
        """One policy round; returns how many requests were assigned (or groups changed)."""
        snap, policy = await self.snapshot(), self.config.policy
        if probe := self.prober.widths(snap, self.costs.fit, policy.max_width, policy.on("load")):
            snap = dataclasses.replace(snap, probe=probe)
        d = decide(snap, policy)
        changed = len(d.binds) + len(d.commands) + len(d.drop)
        assigned = await self.apply(d)
        self.prober.fire(snap.engines, snap.sp_threshold)
        self.metrics.observe(list(snap.groups), d, assigned)
        return assigned + changed

    async def maintenance(self) -> None:
        """Every 2 s: drop inflight entries whose request is no longer assigned there, and end the requests of
        gateways that died (their liveness key gone for ``GATEWAY_GRACE_S``): they have no client any more, so
        they leave the queue, and the engines running them are told to abort."""
        now = time.monotonic()
        if now - self._last_reap < 2:
            return
        self._last_reap = now
        engines = await registered_engines(self.r, self.keys)
        for e in engines:
            if dropped := await reap_stale_inflight(self.queue, e):
                log.info("engine %d: dropped %d stale inflight entries", e, dropped)
        await self.watch(engines, now)
        if gone := await self.breakers.drop_stale(self._live, time.time()):
            log.info("engines %s: breakers dropped (not live for %.0f s)", gone, FORGET_S)
        lost = await orphans(self.queue, engines)
        self._gateways_gone = {gw: self._gateways_gone.get(gw, now) for gw in lost}
        for gw, held in lost.items():
            if now - self._gateways_gone[gw] < GATEWAY_GRACE_S:
                continue
            for rid, engine, url, rids in held:
                await self.queue.finish(rid, "cancelled", f"gateway {gw} lost")
                if engine is not None and url:
                    for one in rids:
                        await self._abort(url, one)
            log.warning(
                "gateway %s lost: ended its %d requests (%d were running)",
                gw,
                len(held),
                sum(e is not None for _, e, _, _ in held),
            )

    async def watch(self, engines: list[int], now: float) -> None:
        """One reading for the stall watchdog (:mod:`router.watchdog`); a stall is logged with the group records
        and the engines' switching state, so the log says where the requests are held."""
        k = self.keys
        pipe = self.r.pipeline(transaction=False)
        pipe.zcard(k.queue)
        pipe.hmget(k.stats, list(MOVES))
        for e in engines:
            pipe.scard(k.inflight(e))
            pipe.get(k.worker(e))
            pipe.get(k.ready(e))
        queued, moves, *rows = await pipe.execute()
        inflight = {e: int(rows[3 * i]) for i, e in enumerate(engines)}
        beats = [live_heartbeat(rows[3 * i + 1], rows[3 * i + 2]) for i in range(len(engines))]
        kv = tuple(hb.free_kv_tokens for hb in beats if hb is not None)
        p = Progress(int(queued), inflight, sum(int(x or 0) for x in moves), kv)
        event = self.watchdog.observe(now, p)
        self.metrics.stalled.set(1 if self.watchdog.stalled else 0)
        if event is None:
            return
        if event.change is Change.STALLED:
            self.metrics.stalls.inc()
            log.warning("%s; %s", event, await self._held_where(beats))
        else:
            log.warning("%s", event)

    async def _held_where(self, beats: list[Heartbeat | None]) -> str:
        """The group records and each live engine's switching state and load, in one line."""
        records = [
            f"epoch {g.epoch} {g.members} {g.reason} {g.state}{' adopt' if g.adopt else ' keep' if g.keep else ''}"
            for g in await read_groups(self.r, self.keys)
        ]
        states = [
            f"{hb.engine}: {hb.mode} epoch {hb.epoch} pending {hb.pending} running {hb.running} "
            f"waiting {hb.waiting} paused {hb.paused}"
            for hb in beats
            if hb is not None
        ]
        return f"groups [{'; '.join(records)}], engines [{'; '.join(states) or 'none live'}]"

    async def _abort(self, url: str, rid: str) -> None:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=2)
        with contextlib.suppress(httpx.HTTPError):
            await self._http.post(f"{url}/abort_request", json={"rid": rid})

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
                reraise_if_cancelled()
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning("redis unavailable (%r); retrying with backoff", exc)
                self.leader = False
                await _sleep_or_stop(stop, backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            except Exception:
                # a bug in one round (a state the policy did not foresee) is logged, not fatal: every router
                # reads the same state, so a crash would take the standby down with the leader
                reraise_if_cancelled()
                log.exception("router round failed; retrying in %.1f s", ROUND_RETRY_S)
                self.metrics.round_errors.inc()
                await _sleep_or_stop(stop, ROUND_RETRY_S)
                continue
            if down_since is not None:
                log.warning("redis is back after %.1f s; resuming", time.monotonic() - down_since)
                down_since, backoff = None, 0.1
        leading = self.leader
        if leading:
            with contextlib.suppress(aioredis.RedisError):
                await self.release_lease()
        log.info("router %s stopped%s", self.router_id, "; lease released" if leading else "")
        await self.close()

    async def close(self) -> None:
        await self.breakers.close()
        await self.prober.close()
        if self._http is not None:
            await self._http.aclose()
            self._http = None

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
            self.leader, self._state_written = True, b""  # write the regime again: Redis may have lost it
            await self.load_costs()
        if await self.round() == 0:
            await self.r.blpop([self.keys.wake], timeout=self.config.poll_s)
        await self.maintenance()

    async def release_lease(self) -> None:
        """Hand the lease over at once (a standby takes it at its next try instead of after it expires)."""
        await self._release(keys=[self.keys.router_lease], args=[self.router_id])


def sp_threshold(policy: int | None, beats: list[Heartbeat]) -> int:
    """The SP threshold the planner predicts with: the policy's (sent in every bind), else the engines' own (the
    most common), else the default."""
    if policy is not None:
        return policy
    reported = [hb.sp_threshold for hb in beats if hb.sp_threshold]
    return max(set(reported), key=reported.count) if reported else Snapshot.sp_threshold


def _log_dispatches(dispatches: list[Dispatch], assigned: int) -> None:
    """One INFO line per round that dispatched: ``id->engine`` (``id->engine@epoch`` for a TP group)."""
    ids = [x.request.id for x in dispatches]
    moves = " ".join(f"{x.request.id}->{x.engine}" + (f"@{x.epoch}" if x.epoch else "") for x in dispatches)
    log.info("dispatched %d of %d: %s", assigned, len(dispatches), moves, extra={"request_ids": ids})


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def read_groups(r: aioredis.Redis, keys: Keys) -> list[Group]:
    return control.decode_groups(await r.hgetall(keys.groups))
