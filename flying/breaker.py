"""Engine circuit breakers: an engine whose requests fail repeatedly leaves dispatch for a back-off period, and
comes back only after a probe of its health endpoint succeeds.

Each engine's breaker is one field of the ``flying:breakers`` hash (JSON :class:`Breaker`), changed only by the
Lua transitions of :class:`Breakers`, so every gateway and the router agree on it:

- ``CLOSED`` (dispatched to): gateways record their requests' failures there (connection refused or reset, a
  stream broken or silent past the read timeout, a 5xx answer); ``failures`` of them within ``window_s`` open it.
- ``OPEN`` (not dispatched to) until ``until``: ``backoff_s``, doubled for each trip that follows a close by
  less than ``backoff_max_s``, at most ``backoff_max_s``. Failures of the requests still running there change
  nothing.
- ``HALF_OPEN``: the back-off is over and one probe is in flight (the router's ``GET <engine>/health``, which
  on SGLang generates one token); still not dispatched to. The probe's success closes the breaker, its failure
  (or ``probe_timeout_s`` without an answer) opens it again for the next, longer back-off.

Times are the callers' wall clocks (``time.time()``): back-offs are seconds, so clocks a few milliseconds apart
do not matter."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec
import redis.asyncio as aioredis

from flying.keys import Keys


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"

    @property
    def level(self) -> int:
        """The metrics' gauge value: 0 closed, 1 half-open, 2 open."""
        return {"closed": 0, "half_open": 1, "open": 2}[self.value]


@dataclass(frozen=True)
class BreakerSettings:
    """When an engine's breaker opens and for how long: ``failures`` failed requests within ``window_s`` open it
    for ``backoff_s`` (doubled for each trip in a row, at most ``backoff_max_s``); a probe that has not answered
    within ``probe_timeout_s`` has failed."""

    failures: int = 5
    window_s: float = 10.0
    backoff_s: float = 2.0
    backoff_max_s: float = 60.0
    probe_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.failures < 1:
            raise ValueError(f"breaker failures must be >= 1, got {self.failures!r}")
        for name in ("window_s", "backoff_s", "probe_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"breaker {name} must be > 0, got {getattr(self, name)!r}")
        if not self.backoff_max_s >= self.backoff_s:
            raise ValueError(
                f"breaker backoff_max_s ({self.backoff_max_s!r}) must be >= backoff_s ({self.backoff_s!r})"
            )


class Breaker(msgspec.Struct, frozen=True):
    """One engine's breaker as stored (the Lua transitions write it)."""

    state: BreakerState = BreakerState.CLOSED
    failures: int = 0  # failures counted in the current window (closed)
    window_start: float = 0.0
    until: float = 0.0  # open: when the probe is due
    trips: int = 0  # trips in a row (the back-off doubles with each)
    closed_at: float = 0.0
    probe_until: float = 0.0  # half-open: when the probe in flight counts as failed
    reason: str = ""  # the last failure recorded

    @property
    def dispatchable(self) -> bool:
        return self.state is BreakerState.CLOSED

    @property
    def last_change(self) -> float:
        """When it last counted a failure, opened, closed or was probed (epoch seconds)."""
        return max(self.window_start, self.until, self.closed_at, self.probe_until)

    def probe_due(self, now: float) -> bool:
        """The back-off is over and no probe is in flight (or the one in flight has timed out)."""
        if self.state is BreakerState.OPEN:
            return now >= self.until
        return self.state is BreakerState.HALF_OPEN and now >= self.probe_until


_NEW = "{state='closed', failures=0, window_start=0, ['until']=0, trips=0, closed_at=0, probe_until=0, reason=''}"

_FAILURE = f"""
-- KEYS: breakers ; ARGV: engine, now, failures, window_s, backoff_s, backoff_max_s, reason
local raw = redis.call('HGET', KEYS[1], ARGV[1])
local b = raw and cjson.decode(raw) or {_NEW}
local now = tonumber(ARGV[2])
if b.state == 'open' then return 'open' end
b.reason = ARGV[7]
if b.state == 'closed' then
  if now - b.window_start > tonumber(ARGV[4]) then b.window_start = now; b.failures = 0 end
  b.failures = b.failures + 1
  if b.failures < tonumber(ARGV[3]) then
    redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(b))
    return 'closed'
  end
  if now - b.closed_at > tonumber(ARGV[6]) then b.trips = 0 end  -- closed long enough: back-off from the start
end
b.trips = b.trips + 1
b.state, b.failures, b.probe_until = 'open', 0, 0
b['until'] = now + math.min(tonumber(ARGV[6]), tonumber(ARGV[5]) * 2 ^ (b.trips - 1))
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(b))
return 'tripped'
"""

_SUCCESS = """
-- KEYS: breakers ; ARGV: engine, now. A half-open breaker's probe succeeded: closed.
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 'closed' end
local b = cjson.decode(raw)
if b.state ~= 'half_open' then return b.state end
b.state, b.failures, b.window_start, b.closed_at, b.probe_until = 'closed', 0, 0, tonumber(ARGV[2]), 0
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(b))
return 'closed'
"""

_PROBE = """
-- KEYS: breakers ; ARGV: engine, now, probe_timeout_s. Claim the one probe (1) if it is due, else 0.
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local b, now = cjson.decode(raw), tonumber(ARGV[2])
local due = (b.state == 'open' and now >= b['until']) or (b.state == 'half_open' and now >= b.probe_until)
if not due then return 0 end
b.state, b.probe_until = 'half_open', now + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(b))
return 1
"""

_decoder = msgspec.json.Decoder(Breaker)


def decode_all(rows: Mapping[bytes | str, bytes | str]) -> dict[int, Breaker]:
    """The ``flying:breakers`` hash (HGETALL) as engine -> :class:`Breaker`."""
    return {int(e): _decoder.decode(raw) for e, raw in rows.items()}


class Breakers:
    """The engines' breakers in Redis: their transitions (each one atomic script) and reads."""

    def __init__(self, client: aioredis.Redis, keys: Keys, settings: BreakerSettings | None = None) -> None:
        self.r, self.keys = client, keys
        self.settings = settings or BreakerSettings()
        self._failure = client.register_script(_FAILURE)
        self._success = client.register_script(_SUCCESS)
        self._probe = client.register_script(_PROBE)

    async def failure(self, engine: int, now: float, reason: str = "") -> bool:
        """Record one failed request (or a failed probe) of ``engine``; True if this opened its breaker."""
        s = self.settings
        args: list[str | int | float] = [
            engine,
            now,
            s.failures,
            s.window_s,
            s.backoff_s,
            s.backoff_max_s,
            reason[:200],
        ]
        return _text(await self._failure(keys=[self.keys.breakers], args=args)) == "tripped"

    async def success(self, engine: int, now: float) -> bool:
        """The probe of a half-open ``engine`` succeeded; True if its breaker is closed now."""
        return _text(await self._success(keys=[self.keys.breakers], args=[engine, now])) == "closed"

    async def claim_probe(self, engine: int, now: float) -> bool:
        """Take the one probe of an engine whose back-off is over: True for the caller that must probe it."""
        args = [engine, now, self.settings.probe_timeout_s]
        return bool(await self._probe(keys=[self.keys.breakers], args=args))

    async def read(self) -> dict[int, Breaker]:
        return decode_all(await self.r.hgetall(self.keys.breakers))

    async def forget(self, engine: int) -> None:
        """Drop an engine's breaker (closed, its history gone)."""
        await self.r.hdel(self.keys.breakers, str(engine))


def _text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x
