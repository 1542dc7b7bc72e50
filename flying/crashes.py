"""Engines' crash reports: when SGLang's scheduler raises, the worker writes which requests were in the batch it was
running (``CrashReport`` in ``flying:crash:{i}``) before its server goes down, so the gateway that sees the
engine's connection break reads it first. A request the crashing batch held alone caused the crash: it is ended at
once instead of re-dispatched (one engine lost to it, not two); one the engine held outside that batch did not.
Without a report (an engine killed outright) the gateway falls back on counting the engines that died holding a
request (``flying:suspects``)."""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable

import msgspec
import redis
import redis.asyncio as aioredis

from flying.keys import Keys
from flying.messages import CrashReport, decode, encode, split_engine_rid

log = logging.getLogger(__name__)
# a gateway reads a report within seconds of the crash; kept longer for operators (redis-cli get flying:crash:<i>)
REPORT_TTL_S = 600


class Blame(enum.Enum):
    """What an engine's crash report says of one request it held."""

    # the crashing batch was this request alone (its choices): it crashed the engine
    CAUSE = "cause"
    # in the crashing batch with other requests: any of them may be the cause
    SHARED = "shared"
    # held by the engine outside the crashing batch: not the cause
    CLEARED = "cleared"
    # no report, a report that does not name it, or a crash outside any batch
    UNKNOWN = "unknown"


def _requests(rids: Iterable[str]) -> set[tuple[str, int | None]]:
    """SGLang rids -> the (request id, attempt) they run (a request's ``n`` choices are one request)."""
    return {split_engine_rid(rid) for rid in rids}


def blame(report: CrashReport | None, rids: Iterable[str]) -> Blame:
    """What ``report`` says of the request the engine ran under ``rids`` (one attempt: its choices' rids)."""
    mine = _requests(rids)
    if report is None or not report.batch or not mine:
        return Blame.UNKNOWN
    batch = _requests(report.batch)
    if batch & mine:
        return Blame.CAUSE if batch <= mine else Blame.SHARED
    return Blame.CLEARED if _requests(report.held) & mine else Blame.UNKNOWN


def write(client: redis.Redis, keys: Keys, report: CrashReport) -> None:
    """Store ``report`` (the worker, from the crashing scheduler: synchronous, before its server goes down)."""
    client.set(keys.crash(report.engine), encode(report), ex=REPORT_TTL_S)


async def read(client: aioredis.Redis, keys: Keys, engine: int) -> CrashReport | None:
    """Engine ``engine``'s last crash report (None: none within ``REPORT_TTL_S``, or unreadable)."""
    raw = await client.get(keys.crash(engine))
    if raw is None:
        return None
    try:
        return decode(raw, CrashReport)
    except msgspec.DecodeError as exc:
        log.warning("%s unreadable: %s", keys.crash(engine), exc)
        return None
