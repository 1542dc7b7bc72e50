"""Tenants: who an API key belongs to and what it may use. Keys come from ``FLYING_API_KEYS`` (comma-separated)
and ``--api-key-file``: a plain list (one key a line, no limits) or, for a file named ``*.toml``, tenants with
limits::

    over_priority = "lower"          # a higher X-Priority than a tenant may use: "lower" it, or "refuse" (403);
                                     # a tenant may set its own

    [[tenant]]
    name = "team-a"
    key = "sk-team-a-1"              # or key_sha256 = "<hex digest>", so the file need not hold the key
    max_priority = "normal"          # optional: the highest priority it may use
    requests_per_s = 5               # optional: token buckets shared by every gateway through Redis
    tokens_per_min = 60000           # prompt + max_tokens of each request admitted
    max_concurrent = 10              # optional: requests in progress on one gateway

Keys are held only as SHA-256 digests and compared in constant time; a plain key without a tenant is named
``key-<first 8 hex of its digest>``. :meth:`Tenants.reload` re-reads the file (on SIGHUP): requests in progress
keep the tenant they started with; a file that does not parse leaves the keys as they were.

A tenant's ``max_concurrent`` across every gateway of the deployment: each gateway counts its requests in
progress per tenant in Redis (``flying:tenant:{name}:inflight``, one field per gateway), and a request enters only
while the sum over the live gateways is below the limit. The counts of a gateway whose liveness key has expired
(it died) are dropped by the next request that looks. Each gateway also keeps its own count (:class:`Tenants`):
the limit holds on one gateway even while Redis is away. (:class:`TenantSlots`)"""

from __future__ import annotations

import contextvars
import enum
import hashlib
import hmac
import logging
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis
from starlette.requests import Request

from flying.cancel import reraise_if_cancelled
from flying.keys import Keys
from flying.messages import PRIORITY_CLASS, Priority
from flying.queue import Charge
from gateway.api import schemas
from gateway.api.errors import APIError, InvalidRequest
from gateway.background import Background
from gateway.metrics import GatewayMetrics
from gateway.request_log import info as request_info

log = logging.getLogger("flying.gateway")


class OverPriority(enum.Enum):
    LOWER = "lower"
    REFUSE = "refuse"


class PriorityNotAllowed(APIError):
    status = 403
    type = "permission_error"
    code = "priority_not_allowed"


_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class Tenant:
    name: str
    max_priority: Priority | None = None
    requests_per_s: float | None = None
    tokens_per_min: float | None = None
    max_concurrent: int | None = None
    over_priority: OverPriority = OverPriority.LOWER  # what a request above max_priority gets

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tenant needs a name")
        if not _NAME.fullmatch(self.name):  # (it is part of Redis keys: flying:tenant:<name>:...)
            raise ValueError(f"tenant name {self.name!r}: use letters, digits, '.', '_' and '-' only")
        if self.max_priority is not None and self.max_priority not in PRIORITY_CLASS:
            raise ValueError(
                f"tenant {self.name}: max_priority must be high, normal or low, got {self.max_priority!r}"
            )
        for limit in ("requests_per_s", "tokens_per_min", "max_concurrent"):
            value = getattr(self, limit)
            if value is not None and not value > 0:
                raise ValueError(f"tenant {self.name}: {limit} must be > 0, got {value!r}")

    def priority(self, asked: Priority, param: str = "X-Priority") -> Priority:
        """The priority this tenant's request runs at: ``asked``, or its highest if ``asked`` is above it (raises
        PriorityNotAllowed naming ``param``, where the priority came from, when its ``over_priority`` is
        REFUSE)."""
        top = self.lowered(asked)
        if top == asked:
            return asked
        if self.over_priority is OverPriority.REFUSE:
            raise PriorityNotAllowed(
                f"this API key may use priority {top} at most; the request asks for {asked}",
                param=param,
            )
        return top

    def lowered(self, asked: Priority) -> Priority:
        """``asked``, or this tenant's highest priority if ``asked`` is above it."""
        top = self.max_priority
        return asked if top is None or PRIORITY_CLASS[asked] >= PRIORITY_CLASS[top] else top

    def charge(self, tokens: int) -> Charge:
        """What admitting a request of ``tokens`` takes from this tenant's buckets (limits 0: none), and the name
        its place in the queue is shared fairly under."""
        return Charge(self.name, self.requests_per_s or 0.0, self.tokens_per_min or 0.0, tokens)


current: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar("tenant", default=None)
"""The tenant of the request being served (set by :class:`gateway.auth.RequireKey`; None: no keys configured)."""


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def plain_tenant(d: bytes) -> Tenant:
    return Tenant(f"key-{d.hex()[:8]}")


@dataclass(frozen=True)
class KeyBook:
    """One parse of the keys: their digests and the tenant of each."""

    entries: tuple[tuple[bytes, Tenant], ...] = ()

    def find(self, key: str) -> Tenant | None:
        d, found = digest(key), None
        for known, tenant in self.entries:  # every digest compared: no early exit
            if hmac.compare_digest(d, known):
                found = tenant
        return found


def read_book(env_value: str | None, path: str | None) -> KeyBook:
    """The keys from the environment variable's value and the file (a plain list, or TOML tenants for
    ``*.toml``). Raises ValueError naming what is wrong."""
    plain = [k.strip() for k in (env_value or "").split(",")]
    entries: list[tuple[bytes, Tenant]] = []
    if path and Path(path).suffix == ".toml":
        entries = _read_toml(Path(path))
    elif path:
        plain += [line.split("#", 1)[0].strip() for line in Path(path).read_text().splitlines()]
    for key in dict.fromkeys(k for k in plain if k):
        entries.append((d := digest(key), plain_tenant(d)))
    return KeyBook(tuple(entries))


def _read_toml(path: Path) -> list[tuple[bytes, Tenant]]:
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: {exc}") from None
    over = _over(path, doc.get("over_priority", "lower"))
    entries = []  # a tenant may have several keys: they share its limits
    for i, row in enumerate(doc.get("tenant", [])):
        row = dict(row)
        key, hexed = row.pop("key", None), row.pop("key_sha256", None)
        if (key is None) == (hexed is None):
            raise ValueError(f"{path}: tenant {i + 1} needs exactly one of key, key_sha256")
        row["over_priority"] = _over(path, row.get("over_priority", over))
        try:
            tenant = Tenant(**row)
            d = digest(key) if key is not None else bytes.fromhex(hexed)
        except TypeError as exc:
            raise ValueError(f"{path}: tenant {i + 1}: {exc}") from None
        if len(d) != 32:
            raise ValueError(f"{path}: tenant {tenant.name}: key_sha256 must be 64 hex digits")
        entries.append((d, tenant))
    return entries


def _over(path: Path, value: object) -> OverPriority:
    if isinstance(value, OverPriority):
        return value
    try:
        return OverPriority(value)
    except ValueError:
        raise ValueError(f"{path}: over_priority must be lower or refuse, got {value!r}") from None


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
        self._background = Background()

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
        self._background.spawn(self._count_refusal(tenant, limit))

    async def _count_refusal(self, tenant: str, limit: str) -> None:
        try:
            await self._client.hincrby(self.keys.tenant(tenant), f"refused_{limit}", 1)
            await self._client.sadd(self.keys.tenants, tenant)
        except aioredis.RedisError as exc:
            log.warning("tenant %s: a refusal not counted (redis: %r)", tenant, exc)

    def leave(self, tenant: str) -> None:
        """The request ended: its count goes (in the background; a request that ends does not wait for it)."""
        self._background.spawn(self._leave_one(tenant))

    async def settle(self) -> None:
        """Wait for the counts sent in the background so far."""
        await self._background.settle()

    async def _leave_one(self, tenant: str) -> None:
        try:
            await self._leave(keys=[self.keys.tenant_inflight(tenant)], args=[self.gateway_id])
        except aioredis.RedisError as exc:
            log.warning("tenant %s: end of a request not counted (redis: %r)", tenant, exc)


class Tenants:
    """The gateway's keys, reloadable: :attr:`book` is replaced whole, so a reader sees one parse or the next."""

    def __init__(self, env_value: str | None = None, path: str | None = None) -> None:
        self.env_value, self.path = env_value, path
        self.book = read_book(env_value, path)
        self.in_progress: dict[str, int] = {}  # requests in progress by tenant name (this gateway)
        self.slots: TenantSlots | None = None  # the counts shared by every gateway (once Redis is there)

    @classmethod
    def of(cls, keys: tuple[str, ...]) -> Tenants:
        """Plain keys, no file."""
        return cls(",".join(keys))

    @property
    def open(self) -> bool:
        """No keys: every request is served, without a tenant."""
        return not self.book.entries

    def reload(self) -> bool:
        """Re-read the keys; on an error keep the old ones and log why. True when reloaded."""
        try:
            self.book = read_book(self.env_value, self.path)
        except (OSError, ValueError) as exc:
            log.error("API keys not reloaded (the previous ones stay): %s", exc)
            return False
        log.info("API keys reloaded: %d keys", len(self.book.entries))
        return True

    def share(self, slots: TenantSlots) -> None:
        """Count ``max_concurrent`` across the gateways through ``slots`` from now on (Redis is there)."""
        self.slots = slots

    def refused(self, name: str, limit: str) -> None:
        """A request of tenant ``name`` refused at the door by its ``limit``: counted in Redis once it is there."""
        if self.slots is not None:
            self.slots.refused(name, limit)

    def enter(self, tenant: Tenant) -> bool:
        """Count a request of ``tenant`` in progress; False (not counted) when it is at its ``max_concurrent``."""
        n = self.in_progress.get(tenant.name, 0)
        if tenant.max_concurrent is not None and n >= tenant.max_concurrent:
            return False
        self.in_progress[tenant.name] = n + 1
        return True

    def leave(self, tenant: Tenant) -> None:
        n = self.in_progress.get(tenant.name, 0) - 1
        if n > 0:
            self.in_progress[tenant.name] = n
        else:
            self.in_progress.pop(tenant.name, None)


def prioritise(request: Request, req, seen: dict[str, str]) -> Priority:
    """The request's priority (X-Priority, else its ``priority``, else its ``service_tier``), lowered to its
    tenant's highest if it asks for more (the request log line then names the one asked for too), or refused (403)
    for a tenant that refuses instead; a request that asks for none runs at the default or its tenant's highest,
    whichever is lower. Noted for the metrics and the request log."""
    headers = request.headers.getlist("x-priority")
    if len(set(headers)) > 1:
        raise InvalidRequest(
            f"send one X-Priority header; got {len(headers)}: {', '.join(headers)}", param="X-Priority"
        )
    header = headers[0] if headers else None
    asked = schemas.resolve_priority(header, req.priority, req.service_tier)
    info, priority = request_info(request.scope), asked
    tenant = current.get()
    if tenant is not None:
        metrics: GatewayMetrics = request.app.state.gateway.metrics
        source = schemas.priority_param(header, req.priority, req.service_tier)
        explicit = source is not None
        if source is not None and tenant.over_priority is OverPriority.REFUSE:
            try:
                tenant.priority(asked, source)
            except PriorityNotAllowed:
                metrics.tenant_rejected.labels(tenant.name, "max_priority").inc()
                request.app.state.tenants.refused(tenant.name, "max_priority")
                raise
        priority = tenant.lowered(asked)
        if priority != asked and explicit:
            info.requested_priority = asked
            metrics.child(metrics.tenant_lowered, tenant.name, asked, priority).inc()
    seen["priority"] = info.priority = priority
    return priority
