"""Every process's Redis connections, made in one place: a plain ``redis://`` (``rediss://``, ``unix://``) URL, or a
Redis Sentinel set that names the primary, as ``redis+sentinel://[user:password@]host:port,host:port/master/db``.

With Sentinel, clients ask the sentinels for the primary before each new connection and follow a failover: a call
whose connection is lost or refused, or that a demoted primary answers ``READONLY``, is retried with backoff on a
connection to the primary the sentinels name, for up to about ``FAILOVER_WINDOW_S`` (longer than a failover with
the timings of ``docs/operations.md``). A call that was sent when its connection broke may have run; the queue's
scripts are written so that running one twice is harmless (see ``flying.queue``). With a plain URL clients behave
as before: a lost Redis is an error at once (the gateway answers 503), and a restarted one is reconnected to.

The URL's query may set the replica wait of the queue's writes (``flying.queue``): ``?wait=N&wait_ms=T`` makes
every admission, assignment, requeue and finish wait (``WAIT N T``) until ``N`` replicas hold it, or ``T`` ms.
A Sentinel URL waits for one replica for at most 100 ms unless told otherwise (``?wait=0`` turns it off).
"""

from __future__ import annotations

import logging
import time
import urllib.parse
import weakref
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as asentinel
import redis.sentinel as ssentinel
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import ConnectionError, ReadOnlyError, TimeoutError
from redis.retry import Retry

from flying.autopipeline import AutoPipeline

log = logging.getLogger("flying.redis")
C = TypeVar("C", aioredis.Redis, redis.Redis)

SCHEME = "redis+sentinel"
DEFAULT_MASTER = "mymaster"
BACKOFF = dict(cap=0.1, base=0.025)  # seconds: 50 ms, then every 100 ms (each retry asks the sentinels)
PLAIN_SCHEMES = ("redis", "rediss", "unix")  # what redis-py's from_url reads
FAILOVER_RETRIES = 55  # about 5.5 s of retries with BACKOFF
FAILOVER_WINDOW_S = 5.5
SENTINEL_TIMEOUT_S = 0.5  # a sentinel that does not answer in this long is skipped
RETRIED = [ConnectionError, TimeoutError, ReadOnlyError]


class RedisUrlError(ValueError):
    """A Redis URL or Sentinel option that cannot be used; the message names it."""


@dataclass(frozen=True)
class ReplicaWait:
    """``WAIT replicas timeout_ms`` after a write that must outlive a failover (0 replicas: no wait)."""

    replicas: int = 0
    timeout_ms: int = 100

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.timeout_ms < 1:
            raise RedisUrlError(
                f"wait={self.replicas} wait_ms={self.timeout_ms}: need wait >= 0, wait_ms >= 1"
            )


@dataclass(frozen=True)
class RedisTarget:
    """Where Redis is: a plain URL, or sentinels and the master's name (with the database and credentials)."""

    url: str = ""  # plain: the URL as redis-py reads it
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str = DEFAULT_MASTER
    db: int = 0
    username: str | None = None
    password: str | None = None
    wait: ReplicaWait = ReplicaWait()

    @property
    def sentinel(self) -> bool:
        return bool(self.sentinels)

    def describe(self) -> str:
        """For logs: the address without credentials."""
        if not self.sentinel:
            return urllib.parse.urlsplit(self.url)._replace(netloc=_hostport(self.url)).geturl()
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinels)
        return f"{SCHEME}://{hosts}/{self.master}/{self.db}"


def parse(url: str) -> RedisTarget:
    """A Redis URL: ``redis://``, ``rediss://``, ``unix://`` or ``redis+sentinel://``; raises RedisUrlError."""
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query))
    if parts.scheme != SCHEME:
        if parts.scheme not in PLAIN_SCHEMES:
            raise RedisUrlError(
                f"{url!r} is no Redis URL (redis://host:port/db, rediss://..., unix:///path or {SCHEME}://...)"
            )
        ours: dict[str, str] = {k: query.pop(k) for k in ("wait", "wait_ms") if k in query}
        plain = parts._replace(query=urllib.parse.urlencode(query)).geturl()
        return RedisTarget(url=plain, wait=_wait(ours, default=0))
    auth, _, hosts = parts.netloc.rpartition("@")
    user, _, password = auth.partition(":")
    path = [x for x in parts.path.split("/") if x]
    if len(path) > 2:
        raise RedisUrlError(f"{url!r}: the path is /master/db, got {parts.path!r}")
    return RedisTarget(
        sentinels=sentinel_hosts(hosts),
        master=path[0] if path else DEFAULT_MASTER,
        db=_int(path[1], "db", url) if len(path) > 1 else 0,
        username=urllib.parse.unquote(user) or None,
        password=urllib.parse.unquote(password) or None,
        wait=_wait(query, default=1),
    )


def sentinel_hosts(text: str) -> tuple[tuple[str, int], ...]:
    """``host:port,host:port`` (port 26379 when left out) as pairs; raises RedisUrlError."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "26379")
        out.append((host.strip("[]"), _int(port, "sentinel port", text)))
    if not out:
        raise RedisUrlError(f"no sentinel in {text!r} (host:port,host:port)")
    return tuple(out)


def with_sentinel(url: str, sentinels: str, master: str = DEFAULT_MASTER) -> str:
    """The ``redis+sentinel://`` URL for ``sentinels`` (``host:port,...``) and ``master``, keeping the database and
    credentials of ``url`` (a plain URL); ``url`` itself when ``sentinels`` is empty."""
    if not sentinels:
        return url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == SCHEME:
        raise RedisUrlError("give sentinels either in the URL or as --redis-sentinel, not both")
    hosts = ",".join(f"{h}:{p}" for h, p in sentinel_hosts(sentinels))
    auth = parts.netloc.rpartition("@")[0]
    db = parts.path.strip("/") or "0"
    return urllib.parse.urlunsplit(
        (SCHEME, f"{auth}@{hosts}" if auth else hosts, f"/{master}/{db}", parts.query, "")
    )


def async_client(url: str, **kwargs: Any) -> aioredis.Redis:
    """A redis.asyncio client for ``url``; ``kwargs`` as redis-py's (``socket_timeout``, ``client_name``...)."""
    target = parse(url)
    if not target.sentinel:
        return _noting(target, aioredis.Redis.from_url(target.url, **kwargs))
    kw = _master_kwargs(target, kwargs, AsyncRetry, FollowingConnection)
    return _noting(target, cast(aioredis.Redis, _async_sentinel(target).master_for(target.master, **kw)))


def waiting_pool_client(url: str, max_connections: int, client_name: str) -> aioredis.Redis:
    """A bounded pool that makes callers wait for a connection rather than fail (the gateway's): the number of
    connections does not grow with the number of requests, and a burst queues for a moment instead of getting
    503s."""
    return async_pool_client(
        url,
        max_connections=max_connections,
        # wait for a connection as long as it takes (connecting to a dead Redis fails fast)
        timeout=None,
        client_name=client_name,
        health_check_interval=10,
        # a pooled connection that died with a Redis restart is replaced, not reported as an outage (behind
        # Sentinel, this module retries for as long as a failover takes)
        retry=AsyncRetry(ExponentialBackoff(cap=0.5, base=0.02), 3),
        retry_on_error=[aioredis.ConnectionError, aioredis.TimeoutError],
    )


def async_pool_client(url: str, max_connections: int, **kwargs: Any) -> aioredis.Redis:
    """A redis.asyncio client over a bounded pool whose callers wait for a free connection (the gateway's)."""
    target = parse(url)
    if not target.sentinel:
        pool = aioredis.BlockingConnectionPool.from_url(target.url, max_connections=max_connections, **kwargs)
        return _noting(target, aioredis.Redis(connection_pool=pool))
    kw = _master_kwargs(target, kwargs, AsyncRetry, FollowingConnection)
    client = _async_sentinel(target).master_for(
        target.master, connection_pool_class=BlockingSentinelPool, max_connections=max_connections, **kw
    )
    return _noting(target, cast(aioredis.Redis, client))


def sync_client(url: str, **kwargs: Any) -> redis.Redis:
    """A synchronous client for ``url`` (flyctl, heartbeats, metrics collectors)."""
    target = parse(url)
    if not target.sentinel:
        return _noting(target, redis.Redis.from_url(target.url, **kwargs))
    sentinel: Any = _untyped(ssentinel.Sentinel)(list(target.sentinels), **_sentinel_kwargs(Retry))
    kw = _master_kwargs(target, kwargs, Retry, SyncFollowingConnection)
    return _noting(target, cast(redis.Redis, sentinel.master_for(target.master, **kw)))


def autopipeline(client: aioredis.Redis) -> AutoPipeline | None:
    """An auto-pipelined connection to the same Redis as ``client`` (the gateway's per-request scripts); with
    Sentinel it asks the client's sentinels for the primary at each (re)connection, and waits through a failover.
    None for TLS, which it does not speak: those calls go through the client's pool."""
    pool = client.connection_pool
    if issubclass(pool.connection_class, aioredis.SSLConnection):
        return None
    if isinstance(pool, asentinel.SentinelConnectionPool):
        return AutoPipeline.like(
            pool.connection_kwargs, locate=pool.get_master_address, reconnect_s=FAILOVER_WINDOW_S
        )
    return AutoPipeline.like(pool.connection_kwargs)


_TARGETS: weakref.WeakKeyDictionary[Any, RedisTarget] = weakref.WeakKeyDictionary()


def target_of(client: aioredis.Redis | redis.Redis) -> RedisTarget:
    """Where ``client`` (one this module made) connects, with its replica wait; for another client, a plain
    target without a wait."""
    return _TARGETS.get(client, RedisTarget())


def _noting(target: RedisTarget, client: C) -> C:
    _TARGETS[client] = target
    return client


class BlockingSentinelPool(asentinel.SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """A Sentinel-managed pool whose callers wait for a free connection rather than open more."""


class FollowingConnection(asentinel.SentinelManagedConnection):
    """A Sentinel-managed connection that asks for the primary at every (re)connection: redis-py's asks only when
    the pool hands out a new connection, so a command retried on a dropped one connects to the old address."""

    async def _connect(self) -> None:
        self.host, self.port = await self.connection_pool.get_master_address()
        await _untyped(super()._connect)()


class SyncFollowingConnection(ssentinel.SentinelManagedConnection):
    """``FollowingConnection`` for the synchronous client."""

    def _connect(self) -> Any:
        self.host, self.port = self.connection_pool.get_master_address()
        return _untyped(super()._connect)()


class WaitGate:
    """Skips the replica wait for a while once a wait times out (no replica answers): a write then costs the wait
    once per ``RETRY_S``, not every time, while the replica is away."""

    RETRY_S = 5.0

    def __init__(self, wait: ReplicaWait) -> None:
        self.wait = wait
        self._skip_until = 0.0

    def wanted(self) -> bool:
        return self.wait.replicas > 0 and time.monotonic() >= self._skip_until

    def saw(self, acked: int) -> None:
        if acked >= self.wait.replicas:
            return
        if self._skip_until == 0.0 or time.monotonic() > self._skip_until + self.RETRY_S:
            log.warning(
                "%d of %d replicas acknowledged within %d ms: writes go unconfirmed (retried every %.0f s)",
                acked,
                self.wait.replicas,
                self.wait.timeout_ms,
                self.RETRY_S,
            )
        self._skip_until = time.monotonic() + self.RETRY_S


def _async_sentinel(target: RedisTarget) -> asentinel.Sentinel:
    return cast(
        asentinel.Sentinel,
        _untyped(asentinel.Sentinel)(list(target.sentinels), **_sentinel_kwargs(AsyncRetry)),
    )


def _sentinel_kwargs(retry_class: type) -> dict[str, Any]:
    """How a client talks to the sentinels themselves: one try each, within SENTINEL_TIMEOUT_S (the master's
    client retries the whole lookup, FAILOVER_RETRIES times; redis-py's own default retries nested inside those
    made an unreachable set of sentinels hang for minutes)."""
    to_sentinels = {"socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": SENTINEL_TIMEOUT_S}
    return {
        "socket_timeout": SENTINEL_TIMEOUT_S,  # (the master's too, unless its client sets its own)
        "sentinel_kwargs": {**to_sentinels, "retry": retry_class(NoBackoff(), 0)},
    }


def explain(exc: redis.RedisError) -> str:
    """``exc`` as one line for a person (redis-py's sentinel errors carry the whole client's repr)."""
    if isinstance(exc, ssentinel.MasterNotFoundError | asentinel.MasterNotFoundError):
        return "no sentinel answered with the primary (none reachable, or none monitors that master name)"
    return str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__


def _untyped(f: Any) -> Any:
    """``f`` as Any: redis-py's Sentinel classes have no annotations."""
    return f


def _master_kwargs(
    target: RedisTarget, kwargs: dict[str, Any], retry_class: type, connection_class: type
) -> dict[str, Any]:
    if "ssl" in kwargs or "connection_class" in kwargs:
        raise RedisUrlError("TLS to Redis behind Sentinel is not supported")
    kw = dict(kwargs, connection_class=connection_class)
    kw.update(db=target.db, username=target.username, password=target.password)
    # through a failover, whoever asks
    kw["retry"] = retry_class(ExponentialBackoff(**BACKOFF), FAILOVER_RETRIES)
    kw["retry_on_error"] = list({*kw.get("retry_on_error", []), *RETRIED})
    return kw


def _wait(query: dict[str, str], default: int) -> ReplicaWait:
    unknown = set(query) - {"wait", "wait_ms"}
    if unknown:
        raise RedisUrlError(f"unknown Redis URL option(s) {sorted(unknown)} (known: wait, wait_ms)")
    return ReplicaWait(
        replicas=_int(query.get("wait", str(default)), "wait", str(query)),
        timeout_ms=_int(query.get("wait_ms", "100"), "wait_ms", str(query)),
    )


def _int(text: str, what: str, where: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise RedisUrlError(f"{what} {text!r} in {where!r} is not an integer") from None


def _hostport(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc.rpartition("@")[2]


__all__ = [
    "DEFAULT_MASTER",
    "RedisTarget",
    "RedisUrlError",
    "ReplicaWait",
    "WaitGate",
    "async_client",
    "async_pool_client",
    "autopipeline",
    "parse",
    "sync_client",
    "target_of",
    "with_sentinel",
]
