"""A tenant's ``max_concurrent`` across every gateway of the deployment: each gateway counts its requests in
progress per tenant in Redis (``flying:tenant:{name}:inflight``, one field per gateway), and a request enters only
while the sum over the live gateways is below the limit. The counts of a gateway whose liveness key has expired
(it died) are dropped by the next request that looks. Each gateway also keeps its own count (:class:`Tenants`):
the limit holds on one gateway even while Redis is away."""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis

from flying.cancel import reraise_if_cancelled
from flying.keys import Keys

log = logging.getLogger("flying.gateway")

_ENTER = """
-- KEYS: the tenant's inflight hash ; ARGV: gateway id, max_concurrent, gateway liveness key prefix
local total = 0
local rows = redis.call('HGETALL', KEYS[1])
for i = 1, #rows, 2 do
  local gw, n = rows[i], tonumber(rows[i + 1])
  if gw == ARGV[1] or redis.call('EXISTS', ARGV[3] .. gw) == 1 then
    total = total + n
  else
    redis.call('HDEL', KEYS[1], gw)
  end
end
if total >= tonumber(ARGV[2]) then return 0 end
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
return 1
"""

_LEAVE = """
-- KEYS: the tenant's inflight hash ; ARGV: gateway id
if redis.call('HINCRBY', KEYS[1], ARGV[1], -1) <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""


class TenantSlots:
    """This gateway's (``gateway_id``) side of the tenants' shared concurrency counts."""

    def __init__(self, client: aioredis.Redis, keys: Keys, gateway_id: str) -> None:
        self.keys, self.gateway_id, self._client = keys, gateway_id, client
        self._enter = client.register_script(_ENTER)
        self._leave = client.register_script(_LEAVE)
        self._leaving: set[asyncio.Task] = set()

    async def enter(self, tenant: str, limit: int) -> bool:
        """Count one request of ``tenant`` in progress here, unless the deployment holds ``limit`` of them
        already (False, not counted). Redis away: True (this gateway's own count still bounds it)."""
        args: list[str | int] = [self.gateway_id, limit, self.keys.gateway("")]
        try:
            return bool(await self._enter(keys=[self.keys.tenant_inflight(tenant)], args=args))
        except aioredis.RedisError as exc:
            reraise_if_cancelled()
            log.warning("tenant %s: max_concurrent held on this gateway only (redis: %r)", tenant, exc)
            return True

    def refused(self, tenant: str, limit: str) -> None:
        """A request of ``tenant`` refused at the door by its ``limit`` (``max_concurrent``, ``max_priority``):
        counted in its Redis counters as ``refused_<limit>``, beside the buckets' refusals (in the background)."""
        task = asyncio.ensure_future(self._count_refusal(tenant, limit))
        self._leaving.add(task)
        task.add_done_callback(self._leaving.discard)

    async def _count_refusal(self, tenant: str, limit: str) -> None:
        try:
            await self._client.hincrby(self.keys.tenant(tenant), f"refused_{limit}", 1)
            await self._client.sadd(self.keys.tenants, tenant)
        except aioredis.RedisError as exc:
            log.warning("tenant %s: a refusal not counted (redis: %r)", tenant, exc)

    def leave(self, tenant: str) -> None:
        """The request ended: its count goes (in the background; a request that ends does not wait for it)."""
        task = asyncio.ensure_future(self._leave_one(tenant))
        self._leaving.add(task)
        task.add_done_callback(self._leaving.discard)

    async def _leave_one(self, tenant: str) -> None:
        try:
            await self._leave(keys=[self.keys.tenant_inflight(tenant)], args=[self.gateway_id])
        except aioredis.RedisError as exc:
            log.warning("tenant %s: end of a request not counted (redis: %r)", tenant, exc)
