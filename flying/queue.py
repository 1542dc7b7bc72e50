"""The global request queue and request records in Redis. Every state change is one atomic Lua script.

Request life in Redis: ``admit`` (queued, in the ZSET) -> ``assign`` (removed from the ZSET, added to the engine's
inflight SET, the owning gateway told on its channel) -> ``finish`` (done/failed) or ``requeue`` (back in the ZSET
at its original position, e.g. after its worker died before answering). Because each transition is atomic, a router
killed at any point neither loses nor duplicates a request: a request is either still queued or assigned.

Behind Redis Sentinel (``flying.redis_conn``) the gateway's scripts are sent again when their connection is lost
(up to the failover window): finish and requeue are no-ops the second time, and an admission that finds its own
record (``DuplicateId`` on a retry) had landed the first time. When the client's URL sets a replica wait, every
state change (admit, assign, requeue, finish) waits for that many replicas (``WAIT``, bounded; skipped for a
while once it times out), so a failover right after it does not lose it.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError

from flying import redis_conn
from flying.autopipeline import AutoPipeline
from flying.keys import Keys
from flying.messages import (
    PRIORITY_CLASS,
    Assignment,
    QueuedRequest,
    encode,
    engine_rid,
    engine_rids,
    from_hash,
    to_hash,
)

CLASS_WEIGHT = 1e12  # score = class * CLASS_WEIGHT + seq: exact in a double for 10^12 arrivals per class
FINISHED_TTL_S = 3600

_ADMIT = """
-- KEYS: queue, seq, request hash, wake, stats, fast-path targets, tenant counters, tenant request bucket, tenant
-- token bucket, tenant names, virtual clocks ; ARGV: id, class, max_queue, max_ahead, kv tokens, now, inflight key prefix, has a
-- flags (1: it has a prefix chain, 2: leader-only), tenant name ('' none), its requests/s (0 none), its tokens/min (0 none), the request's
-- tokens, the engine the gateway sent it to already (-1 none: see below), then field/value pairs.
-- A tenant's limits are token buckets (HASH t = tokens left, ts = when; Redis's clock): requests/s holds a
-- second's worth (at least 1), tokens/min a minute's; a request takes 1 and its tokens (at most a full bucket).
-- Over one: {-4, limit (1 requests/s, 2 tokens/min), ms until it would fit}, nothing taken.
-- Refusals return {code, n}: {-1, depth} the queue is full; {-3, ahead} max_ahead requests of this class or
-- higher already wait (the estimated wait is too long). Queued: the arrival sequence. Fast path (the queue is
-- empty, a target the router published has a free slot and KV for it, is not an affinity target while the
-- request has a prefix chain, and is a bound group's member if the request is of high priority): assigned at
-- once to the least loaded such target, returns {seq, engine, url, epoch} (the reply is the gateway's assignment: nothing is published).
-- Early dispatch (ARGV[13] an engine): the gateway sent the request to that engine while this script ran; it
-- is assigned there by the fast path if that engine is a fast-path target for it now, else {-5} and nothing
-- is written (the gateway takes it back and admits it again, without).
local function takes(t)  -- the request's KV fits the target, an affinity target takes it only without a prefix
  -- chain (ARGV[8] bit 1), a follower only when it is not leader-only (bit 2), a high-priority request only a
  -- bound group's member (where the round would place it too; a DP engine: the round may bind it a group)
  local flags = tonumber(ARGV[8])
  return tonumber(ARGV[5]) <= t.max_kv and not (t.affinity and flags %% 2 == 1)
    and not (t.follower and flags >= 2) and (tonumber(ARGV[2]) > 0 or (t.epoch or 0) > 0)
end
local function held(t)
  return redis.call('SCARD', ARGV[7] .. t.engine)
end
local function fast_targets(depth)
  local raw = depth == 0 and redis.call('GET', KEYS[6])
  return raw and cjson.decode(raw) or {}
end
local depth = redis.call('ZCARD', KEYS[1])
local sent = tonumber(ARGV[13])
local early = nil
if sent >= 0 then
  if redis.call('EXISTS', KEYS[3]) == 1 then return -2 end  -- (a retry whose first run landed)
  for _, t in ipairs(fast_targets(depth)) do
    if t.engine == sent and takes(t) and held(t) < t.cap then early = t end
  end
  if not early then return {-5} end
end
if tonumber(ARGV[3]) > 0 and depth >= tonumber(ARGV[3]) then return {-1, depth} end
-- Fair sharing inside a class (start-time fair queuing): a tenant's request starts at the later of the class's
-- virtual clock (the position of the last request assigned in it, kept by the assign script) and its tenant's
-- previous request's finish (start + 1), so a tenant that floods the class queues behind its own requests, not
-- others'. Without a tenant the position is the arrival sequence.
local pos = tonumber(redis.call('GET', KEYS[2]) or 0) + 1
if ARGV[9] ~= '' then
  local base = tonumber(ARGV[2]) * %d
  local v = redis.call('HGET', KEYS[11], ARGV[2])
  if not v then  -- nothing assigned in the class yet: its head's position, else the next arrival's
    local head = redis.call('ZRANGEBYSCORE', KEYS[1], string.format('%%.0f', base),
      '(' .. string.format('%%.0f', base + %d), 'WITHSCORES', 'LIMIT', 0, 1)
    v = head[2] and tonumber(head[2]) - base or pos
  end
  pos = math.max(tonumber(v), tonumber(redis.call('HGET', KEYS[7], 'finish:' .. ARGV[2]) or 0))
end
if tonumber(ARGV[4]) > 0 then  -- the requests ahead of this one: higher classes, and its class before its position
  local ahead = redis.call('ZCOUNT', KEYS[1], '-inf', '(' .. string.format('%%.0f', tonumber(ARGV[2]) * %d + pos))
  if ahead >= tonumber(ARGV[4]) then return {-3, ahead} end
end
if redis.call('EXISTS', KEYS[3]) == 1 then return -2 end
if ARGV[9] ~= '' then
  local clock = redis.call('TIME')
  local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
  local rps, tpm = tonumber(ARGV[10]), tonumber(ARGV[11])
  local specs = {{KEYS[8], rps, math.max(1, rps), 1}, {KEYS[9], tpm / 60, tpm, tonumber(ARGV[12])}}
  local left = {}
  for i, b in ipairs(specs) do
    if b[2] > 0 then
      local row = redis.call('HMGET', b[1], 't', 'ts')
      local t = math.min(b[3], (tonumber(row[1]) or b[3]) + math.max(0, now - (tonumber(row[2]) or now)) * b[2])
      local cost = math.min(b[4], b[3])
      if t < cost then
        redis.call('HINCRBY', KEYS[7], i == 1 and 'refused_requests_per_s' or 'refused_tokens_per_min', 1)
        return {-4, i, math.ceil((cost - t) / b[2] * 1000)}
      end
      left[i] = t - cost
    end
  end
  for i, b in ipairs(specs) do
    if left[i] then
      redis.call('HSET', b[1], 't', left[i], 'ts', now)
      redis.call('PEXPIRE', b[1], math.ceil(b[3] / b[2] * 1000) + 1000)
    end
  end
  redis.call('HINCRBY', KEYS[7], 'requests', 1)
  redis.call('HINCRBY', KEYS[7], 'tokens', tonumber(ARGV[12]))
  redis.call('SADD', KEYS[10], ARGV[9])
end
local seq = redis.call('INCR', KEYS[2])
if ARGV[9] ~= '' then redis.call('HSET', KEYS[7], 'finish:' .. ARGV[2], pos + 1) end
redis.call('HSET', KEYS[3], unpack(ARGV, 15))
redis.call('HINCRBY', KEYS[5], 'admitted', 1)
redis.call('HINCRBY', KEYS[5], 'admitted_prompt_tokens', ARGV[14])
redis.call('HINCRBY', KEYS[5], 'admitted_output_tokens', tonumber(ARGV[5]) - tonumber(ARGV[14]))
redis.call('HINCRBY', KEYS[5], ({'admitted_high', 'admitted_normal', 'admitted_low'})[tonumber(ARGV[2]) + 1], 1)
do
  local best, best_n = early, 0
  if not best then
    for _, t in ipairs(fast_targets(depth)) do
      local n = held(t)
      if n < t.cap and takes(t) and (best == nil or n < best_n) then best, best_n = t, n end
    end
  end
  if best then
    local epoch = best.epoch or 0
    redis.call('HSET', KEYS[3], 'seq', seq, 'state', 'assigned', 'engine', best.engine, 'url', best.url,
      'assigned_at', ARGV[6], 'queue_ms', '0', 'epoch', epoch)
    redis.call('SADD', ARGV[7] .. best.engine, ARGV[1])
    redis.call('HINCRBY', KEYS[5], 'assigned', 1)
    redis.call('HINCRBY', KEYS[5], 'fast', 1)
    return {seq, best.engine, best.url, epoch}
  end
end
redis.call('HSET', KEYS[3], 'seq', seq, 'state', 'queued', 'pos', pos)
redis.call('ZADD', KEYS[1], tonumber(ARGV[2]) * %d + pos, ARGV[1])
redis.call('LPUSH', KEYS[4], 1)
redis.call('LTRIM', KEYS[4], 0, 0)
return seq
""" % (int(CLASS_WEIGHT), int(CLASS_WEIGHT), int(CLASS_WEIGHT), int(CLASS_WEIGHT))

_ASSIGN = """
-- KEYS: queue, request hash, inflight set, stats, virtual clocks ; ARGV: id, engine, now, queue_ms, channel,
-- message, url, epoch. The class's virtual clock moves up to the assigned request's position (fair sharing).
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
local class = math.floor(tonumber(score) / %d)
local pos = tonumber(score) - class * %d
if pos > tonumber(redis.call('HGET', KEYS[5], class) or -1) then redis.call('HSET', KEYS[5], class, pos) end
redis.call('HSET', KEYS[2], 'state', 'assigned', 'engine', ARGV[2], 'url', ARGV[7], 'assigned_at', ARGV[3], 'queue_ms', ARGV[4], 'epoch', ARGV[8])
redis.call('SADD', KEYS[3], ARGV[1])
redis.call('HINCRBY', KEYS[4], 'assigned', 1)
redis.call('PUBLISH', ARGV[5], ARGV[6])
return 1
""" % (int(CLASS_WEIGHT), int(CLASS_WEIGHT))

_REQUEUE = """
-- KEYS: queue, request hash, inflight set, wake, stats ; ARGV: id, class, reason, engine, counted (1; 0: parked,
-- 2: a follower refused it, leader-only from now on)
local seq = redis.call('HGET', KEYS[2], 'pos') or redis.call('HGET', KEYS[2], 'seq')
if not seq or redis.call('HGET', KEYS[2], 'state') ~= 'assigned' then return 0 end
redis.call('SREM', KEYS[3], ARGV[1])
redis.call('HSET', KEYS[2], 'state', 'queued', 'requeue_reason', ARGV[3])
if ARGV[5] == '1' then redis.call('HSET', KEYS[2], 'failed_on', ARGV[4])
else redis.call('HINCRBY', KEYS[2], 'parked_attempts', 1) end
if ARGV[5] == '2' then redis.call('HSET', KEYS[2], 'leader_only', 'True') end
redis.call('HDEL', KEYS[2], 'engine', 'url', 'assigned_at', 'epoch')
redis.call('HINCRBY', KEYS[2], 'attempts', 1)
redis.call('ZADD', KEYS[1], tonumber(ARGV[2]) * %d + tonumber(seq), ARGV[1])
redis.call('LPUSH', KEYS[4], 1)
redis.call('LTRIM', KEYS[4], 0, 0)
redis.call('HINCRBY', KEYS[5], 'requeued', 1)
return 1
""" % int(CLASS_WEIGHT)

_FINISH = """
-- KEYS: queue, request hash, wake, stats ; ARGV: id, state, now, error, ttl, inflight key prefix. The inflight set
-- is the one of the engine the record names (an assignment that raced a cancel is cleared too). The router is
-- woken only while requests wait (with none, a free slot changes nothing it would do before its next poll; a
-- wake per finished request would cost it a round per request at high rates).
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
local was = redis.call('HGET', KEYS[2], 'state')
if was == 'done' or was == 'failed' or was == 'cancelled' then return 0 end  -- ended before (and counted)
redis.call('ZREM', KEYS[1], ARGV[1])
local engine = redis.call('HGET', KEYS[2], 'engine')
if engine then redis.call('SREM', ARGV[6] .. engine, ARGV[1]) end
redis.call('HSET', KEYS[2], 'state', ARGV[2], 'finished_at', ARGV[3], 'error', ARGV[4])
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[5]))
if redis.call('ZCARD', KEYS[1]) > 0 then  -- a slot is free for a waiting request: wake the router
  redis.call('LPUSH', KEYS[3], 1)
  redis.call('LTRIM', KEYS[3], 0, 0)
end
local counter = ARGV[2] == 'done' and 'completed' or ARGV[2]
redis.call('HINCRBY', KEYS[4], counter, 1)
return 1
"""


_STATES = """
-- KEYS: request hashes ; ARGV: none. One round trip for a gateway's waiting requests: returns {i, 'missing'} for
-- a record that does not exist and {i, 'assigned', engine, url, queue_ms} for an assigned one (i: 1-based index
-- into KEYS); queued and finished requests are left out, so the reply stays small.
local out = {}
for i, key in ipairs(KEYS) do
  local row = redis.call('HMGET', key, 'state', 'engine', 'url', 'queue_ms')
  if not row[1] then
    out[#out + 1] = {i, 'missing'}
  elseif row[1] == 'assigned' then
    out[#out + 1] = {i, 'assigned', row[2] or '', row[3] or '', row[4] or '0'}
  end
end
return out
"""


class DuplicateId(Exception):
    """A request record with this id exists already (in flight, or finished within ``FINISHED_TTL_S``)."""


class EarlyDeclined(Exception):
    """The admission did not take a request the gateway had sent to an engine early: that engine is not a fast-path
    target for it now (the queue is not empty, the engine is full, or the router no longer lists it). Nothing was
    written."""


class QueueFull(Exception):
    """The global queue holds ``max_queue`` requests already (``reason`` "depth"), or ``max_ahead`` requests of
    the same or higher priority (``reason`` "wait"); ``count`` is that number."""

    def __init__(self, message: str, reason: str = "depth", count: int = 0) -> None:
        super().__init__(message)
        self.reason = reason
        self.count = count


class TenantLimited(Exception):
    """A tenant's token bucket is short: ``limit`` names it, ``retry_after_s`` says when the request would fit."""

    def __init__(self, limit: TenantLimit, retry_after_s: float) -> None:
        super().__init__(f"over its {limit.value} limit; fits in {retry_after_s:.1f} s")
        self.limit = limit
        self.retry_after_s = retry_after_s


class TenantLimit(enum.Enum):
    REQUESTS_PER_S = "requests_per_s"
    TOKENS_PER_MIN = "tokens_per_min"


@dataclass(frozen=True)
class Charge:
    """What admitting a request takes from its tenant's buckets (limits 0: none)."""

    tenant: str
    requests_per_s: float = 0.0
    tokens_per_min: float = 0.0
    tokens: int = 0


class RequestQueue:
    """Async facade over the queue scripts; used by the gateway (admit/finish/requeue) and router (assign). With
    ``pipe`` (the gateway's), the per-request scripts (admit, finish, requeue) go through that auto-pipelined
    connection instead of redis-py's pool."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        pipe: AutoPipeline | None = None,
        on_finish: Callable[[str, str, str], None] | None = None,
    ) -> None:
        self.r = client
        self.keys = keys
        self.pipe = pipe
        self.on_finish = on_finish  # told of each request this queue ends: (id, state, error)
        self._scripts = {src: client.register_script(src) for src in (_ADMIT, _REQUEUE, _FINISH)}
        self._assign = client.register_script(_ASSIGN)
        self._states = client.register_script(_STATES)
        target = redis_conn.target_of(client)
        self.wait, self.gate = target.wait, redis_conn.WaitGate(target.wait)
        self.retry_s = redis_conn.FAILOVER_WINDOW_S if target.sentinel else 0.0

    async def admit(
        self,
        req: QueuedRequest,
        max_queue: int = 0,
        max_ahead: int = 0,
        charge: Charge | None = None,
        sent_to: int | None = None,
    ) -> Assignment | None:
        """Insert ``req``. Raises QueueFull when the queue is at ``max_queue``, or when ``max_ahead`` requests of
        its priority class or higher wait already (0: no such bound), and TenantLimited when ``charge`` does not fit
        its tenant's buckets (then nothing is taken). Returns None (queued: the router assigns it) or, on the fast
        path (the queue empty and a target the router published free), its assignment. ``sent_to``: the engine the
        gateway already sent it to (early dispatch): assigned there by the fast path, else EarlyDeclined and
        nothing written."""
        k = self.keys
        fields = [x for kv in to_hash(req).items() for x in kv if kv[0] != "seq"]
        c = charge or Charge("")
        out, retried = await self._run(
            _ADMIT,
            keys=[
                k.queue,
                k.seq,
                k.request(req.id),
                k.wake,
                k.stats,
                k.fast_path,
                k.tenant(c.tenant),
                k.tenant_bucket(c.tenant, "requests"),
                k.tenant_bucket(c.tenant, "tokens"),
                k.tenants,
                k.vclock,
            ],
            args=[
                req.id,
                PRIORITY_CLASS[req.priority],
                max_queue,
                max_ahead,
                req.kv_tokens,
                time.time(),
                k.inflight_prefix,
                (1 if req.prefix else 0) + (2 if req.leader_only else 0),
                c.tenant,
                c.requests_per_s,
                c.tokens_per_min,
                c.tokens,
                -1 if sent_to is None else sent_to,
                req.prompt_tokens,
                *fields,
            ],
        )
        if isinstance(out, list) and int(out[0]) == -5:
            raise EarlyDeclined(f"engine {sent_to} is not a fast-path target for request {req.id} now")
        if isinstance(out, list) and len(out) == 3:
            limit = TenantLimit.REQUESTS_PER_S if int(out[1]) == 1 else TenantLimit.TOKENS_PER_MIN
            raise TenantLimited(limit, int(out[2]) / 1000)
        if isinstance(out, list) and len(out) == 2:
            code, n = int(out[0]), int(out[1])
            if code == -1:
                raise QueueFull(f"queue holds {n} requests (limit {max_queue})", "depth", n)
            raise QueueFull(f"{n} requests of this priority or higher wait (limit {max_ahead})", "wait", n)
        if out == -2 and retried:  # the first try landed before its connection broke
            return None  # queued, or assigned on the fast path (the gateway's reconciliation finds that)
        if out == -2:
            raise DuplicateId(f"a record with id {req.id} exists already")
        if isinstance(out, list):
            return Assignment(id=req.id, engine=int(out[1]), url=text(out[2]), queue_ms=0.0)
        return None

    async def _run(self, source: str, keys: list[str], args: list[Any]) -> tuple[Any, bool]:
        """The script's reply, and whether it was sent again after a lost connection (only behind Sentinel)."""
        deadline, retried = time.monotonic() + self.retry_s, False
        while True:
            try:
                return await self._run_once(source, keys, args), retried
            except ConnectionError:
                if time.monotonic() >= deadline:
                    raise
                retried = True
                await asyncio.sleep(0.05)

    async def _run_once(self, source: str, keys: list[str], args: list[Any]) -> Any:
        wait = (self.wait.replicas, self.wait.timeout_ms) if self.gate.wanted() else None
        if self.pipe is not None and wait:
            out, acked = await self.pipe.script(source, keys, args, wait=wait)
        elif self.pipe is not None:
            return await self.pipe.script(source, keys, args)
        elif wait:  # one pipeline: the WAIT goes on the connection that wrote
            pipe = self.r.pipeline(transaction=False)
            await self._scripts[source](keys=keys, args=args, client=pipe)
            pipe.execute_command("WAIT", *wait)
            out, acked = await pipe.execute()
        else:
            return await self._scripts[source](keys=keys, args=args)
        self.gate.saw(int(acked))
        return out

    async def assign(
        self, req: QueuedRequest, engine: int, url: str, now: float | None = None, epoch: int = 0
    ) -> bool:
        """Atomically move ``req`` from the queue to ``engine`` (a TP group's leader when ``epoch`` is set);
        False if it was no longer queued."""
        return await self.assign_many([(req, engine, url, epoch)], now) == 1

    async def assign_many(
        self, moves: Sequence[tuple[QueuedRequest, int, str, int]], now: float | None = None
    ) -> int:
        """``assign`` for many (request, engine, url, epoch) in one pipelined round trip (each move still one
        atomic script); returns how many were still queued and moved."""
        if not moves:
            return 0
        now, k = time.time() if now is None else now, self.keys
        wait = self.gate.wanted()
        pipe = self.r.pipeline(transaction=False)
        for req, engine, url, epoch in moves:
            queue_ms = max(0.0, (now - req.enqueued_at) * 1000)
            msg = encode(Assignment(id=req.id, engine=engine, url=url, queue_ms=queue_ms))
            await self._assign(
                keys=[k.queue, k.request(req.id), k.inflight(engine), k.stats, k.vclock],
                args=[
                    req.id,
                    engine,
                    now,
                    f"{queue_ms:.3f}",
                    k.gateway_channel(req.gateway),
                    msg,
                    url,
                    epoch,
                ],
                client=pipe,
            )
        if wait:  # the round's assignments on a replica before the next round reads them
            pipe.execute_command("WAIT", self.wait.replicas, self.wait.timeout_ms)
        done = await pipe.execute()
        if wait:
            self.gate.saw(int(done.pop()))
        return sum(bool(x) for x in done)

    async def requeue(
        self, req: QueuedRequest, engine: int, reason: str, counted: bool = True, leader_only: bool = False
    ) -> bool:
        """Put an assigned request back at its original place in the queue (its worker could not take it); the
        router sends it elsewhere than ``engine`` while another engine is live. Its ``attempts`` go up by one;
        ``counted`` False (nothing failed: its group was parked) also its ``parked_attempts``, which the gateway's
        ``max_attempts`` leaves out, and ``engine`` is not recorded as where it failed; ``leader_only`` (a
        follower refused it: a grammar the gateway did not foresee) is uncounted too and sets the record's
        ``leader_only``."""
        k = self.keys
        mode = 2 if leader_only else int(counted)
        done, _ = await self._run(
            _REQUEUE,
            keys=[k.queue, k.request(req.id), k.inflight(engine), k.wake, k.stats],
            args=[req.id, PRIORITY_CLASS[req.priority], reason, engine, mode],
        )
        return bool(done)

    async def mark_suspect(self, rid: str) -> int:
        """An engine died holding ``rid``: count it in the record's ``suspect`` and list the id in
        ``flying:suspects``; returns the count."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hincrby(self.keys.request(rid), "suspect", 1)
        pipe.sadd(self.keys.suspects, rid)
        n, _ = await pipe.execute()
        return int(n)

    async def finish(self, rid: str, state: str, error: str = "") -> bool:
        """Mark a request done/failed/cancelled, drop it from the queue and from the inflight set of the engine its
        record names, let its record expire."""
        if self.on_finish is not None:
            self.on_finish(rid, state, error)
        keys, args = self._finish_call(rid, state, error)
        done, _ = await self._run(_FINISH, keys, args)
        return bool(done)

    def finish_nowait(self, rid: str, state: str, error: str = "") -> asyncio.Future[Any] | None:
        """``finish`` sent on the auto-pipelined connection at the end of this event-loop turn (after the answer
        its caller writes in the same step), without a coroutine: the reply's future; None when it cannot go that
        way (no pipe, no open connection yet, or a replica wait wanted): then await ``finish``."""
        if self.pipe is None or self.gate.wanted():
            return None
        if self.on_finish is not None:
            self.on_finish(rid, state, error)
        keys, args = self._finish_call(rid, state, error)
        return self.pipe.script_nowait(_FINISH, keys, args)

    def _finish_call(self, rid: str, state: str, error: str) -> tuple[list[str], list[Any]]:
        assert state in ("done", "failed", "cancelled"), state
        k = self.keys
        return [k.queue, k.request(rid), k.wake, k.stats], [
            rid,
            state,
            time.time(),
            error,
            FINISHED_TTL_S,
            k.inflight_prefix,
        ]

    async def peek(self, limit: int) -> list[QueuedRequest]:
        """The first ``limit`` waiting requests in dispatch order (priority class, then arrival)."""
        ids = await self.r.zrange(self.keys.queue, 0, limit - 1)
        if not ids:
            return []
        pipe = self.r.pipeline(transaction=False)
        for rid in ids:
            pipe.hgetall(self.keys.request(text(rid)))
        rows = await pipe.execute()
        return [from_hash(decode_row(row), QueuedRequest) for row in rows if row]

    async def assigned_or_missing(self, rids: Sequence[str]) -> tuple[list[Assignment], list[str]]:
        """For many waiting requests in one round trip: the assignments recorded for those assigned, and the ids
        whose record does not exist (Redis lost it, or it was never admitted)."""
        if not rids:
            return [], []
        rows = await self._states(keys=[self.keys.request(rid) for rid in rids])
        assigned, missing = [], []
        for row in rows:
            rid = rids[int(row[0]) - 1]
            if text(row[1]) == "missing":
                missing.append(rid)
            elif row[3]:
                assigned.append(
                    Assignment(id=rid, engine=int(row[2]), url=text(row[3]), queue_ms=float(row[4]))
                )
        return assigned, missing

    async def get(self, rid: str) -> dict[str, str]:
        return decode_row(await self.r.hgetall(self.keys.request(rid)))

    async def depth(self) -> int:
        return int(await self.r.zcard(self.keys.queue))


def text(x: object) -> str:
    """A Redis reply value as str."""
    return x.decode() if isinstance(x, bytes) else str(x)


def decode_row(row: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    """A Redis hash reply as str -> str."""
    return {text(k): text(v) for k, v in row.items()}


async def reap_stale_inflight(q: RequestQueue, engine: int) -> int:
    """Drop ids from an engine's inflight set whose request is no longer assigned to it (e.g. its gateway died
    and the record expired). Returns how many were dropped."""
    members = [text(m) for m in await q.r.smembers(q.keys.inflight(engine))]
    if not members:
        return 0
    pipe = q.r.pipeline(transaction=False)
    for rid in members:
        pipe.hmget(q.keys.request(rid), ["state", "engine"])
    rows = await pipe.execute()
    stale = [
        rid
        for rid, (state, eng) in zip(members, rows)
        if text(state or b"") != "assigned" or text(eng or b"") != str(engine)
    ]
    if stale:
        await q.r.srem(q.keys.inflight(engine), *stale)
    return len(stale)


async def orphans(
    q: RequestQueue, engines: Sequence[int]
) -> dict[str, list[tuple[str, int | None, str, list[str]]]]:
    """Waiting and assigned requests by gateway id, for the gateways whose liveness key is gone: gateway ->
    [(request id, engine or None while queued, engine url, the SGLang rids of its current attempt)]."""
    k = q.keys
    pipe = q.r.pipeline(transaction=False)
    pipe.zrange(k.queue, 0, -1)
    for e in engines:
        pipe.smembers(k.inflight(e))
    rows = await pipe.execute()
    held: list[tuple[str, int | None]] = [(text(rid), None) for rid in rows[0]]
    held += [(text(rid), e) for e, members in zip(engines, rows[1:]) for rid in members]
    if not held:
        return {}
    pipe = q.r.pipeline(transaction=False)
    for rid, _ in held:
        pipe.hmget(k.request(rid), ["gateway", "url", "n", "attempts"])
    records = await pipe.execute()
    by_gateway: dict[str, list[tuple[str, int | None, str, list[str]]]] = {}
    for (rid, engine), (gw, url, n, attempts) in zip(held, records):
        if gw:
            rids = engine_rids(engine_rid(rid, int(attempts or 0)), int(n or 1))
            by_gateway.setdefault(text(gw), []).append((rid, engine, text(url or b""), rids))
    names = list(by_gateway)
    pipe = q.r.pipeline(transaction=False)
    for gw in names:
        pipe.exists(k.gateway(gw))
    alive = await pipe.execute()
    return {gw: by_gateway[gw] for gw, up in zip(names, alive) if not up}
