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
keep the tenant they started with; a file that does not parse leaves the keys as they were."""

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

from flying.messages import PRIORITY_CLASS, Priority
from flying.queue import Charge
from gateway.errors import APIError
from gateway.tenant_slots import TenantSlots

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


class Tenants:
    """The gateway's keys, reloadable: :attr:`book` is replaced whole, so a reader sees one parse or the next."""

    def __init__(self, env_value: str | None = None, path: str | None = None) -> None:
        self.env_value, self.path = env_value, path
        self.book = read_book(env_value, path)
        self.in_progress: dict[str, int] = {}  # requests in progress by tenant name (this gateway)
        self.slots: TenantSlots | None = None  # the counts shared by every gateway (set once Redis is there)

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
