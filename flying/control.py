"""Bind/release commands onto the engines' Redis streams, group records, and the engines' switching state.

The router's policy and the operator (``flyctl bind|release``) go through the same two steps: write the group's
record (``flying:groups``), then XADD the command to every member's stream (``flying:cmd:{i}``). A group bound by
hand has reason ``manual``: the router dispatches high-priority and long requests to it but never releases it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import msgspec
import redis
import redis.asyncio as aioredis

from flying.keys import Keys
from flying.messages import PRIORITY_CLASS, Bind, Command, Group, Heartbeat, Release, decode, encode
from flying.queue import CLASS_WEIGHT, text
from flying.workers import live_heartbeat

STREAM_MAXLEN = 1000


def _xadd_all(
    pipe: redis.client.Pipeline | aioredis.client.Pipeline, keys: Keys, members: tuple[int, ...], cmd: Command
) -> None:
    for m in members:
        pipe.xadd(keys.commands(m), {"msg": encode(cmd)}, maxlen=STREAM_MAXLEN, approximate=True)


def send(r: redis.Redis, keys: Keys, members: tuple[int, ...], cmd: Command) -> None:
    """XADD ``cmd`` to every member's command stream (one pipeline; streams keep about the last 1000 entries)."""
    pipe = r.pipeline(transaction=False)
    _xadd_all(pipe, keys, members, cmd)
    pipe.execute()


async def send_async(r: aioredis.Redis, keys: Keys, members: tuple[int, ...], cmd: Command) -> None:
    pipe = r.pipeline(transaction=False)
    _xadd_all(pipe, keys, members, cmd)
    await pipe.execute()


def next_epoch(r: redis.Redis, keys: Keys) -> int:
    return int(r.incr(keys.epoch))


def decode_groups(rows: Mapping[bytes | str, bytes | str]) -> list[Group]:
    """The records of an HGETALL of ``flying:groups``, by epoch."""
    return sorted((decode(v, Group) for v in rows.values()), key=lambda g: g.epoch)


def groups(r: redis.Redis, keys: Keys) -> list[Group]:
    return decode_groups(r.hgetall(keys.groups))


def bind(
    r: redis.Redis,
    keys: Keys,
    members: tuple[int, ...],
    preempt: str = "hard",
    record: bool = True,
    adopt: bool = False,
    sp_threshold: int | None = None,
) -> int:
    """Bind ``members`` by hand; with ``record`` the router sees a ``manual`` group. A group it overlaps is
    replaced when the change is a direct width change: the old group lies inside ``members`` ((0,1) -> (0,1,2,3))
    or contains them with the same leader ((0,1,2,3) -> (0,1); the leader takes the command and sends the
    engines left out back to DP). Any other overlap is refused. ``sp_threshold``: the group's steps of at least
    this many batched tokens run sequence-parallel (0: never; None: the leader's own ``--sp-threshold``)."""
    # (a parked group's members serve DP: they may bind, their parked KV stays where it is)
    inside = (
        [g for g in groups(r, keys) if g.state != "parked" and set(g.members) & set(members)]
        if record
        else []
    )
    if clash := [g.members for g in inside if not _width_change(g.members, members)]:
        raise ValueError(
            f"engines {sorted(set(members) & {m for c in clash for m in c})} are in group(s) {clash}"
        )
    epoch = next_epoch(r, keys)  # (after the checks: a refused bind takes no epoch)
    if record:
        now = time.time()
        g = Group(
            epoch=epoch,
            members=tuple(members),
            reason="manual",
            preempt=preempt,  # type: ignore[arg-type]
            since=now,
            last_used=now,
            adopt=adopt,
        )
        tx = r.pipeline(transaction=True)  # the old record and the new one change together (a width change)
        if inside:
            tx.hdel(keys.groups, *(str(g.epoch) for g in inside))
        tx.hset(keys.groups, str(epoch), encode(g))
        tx.execute()
    cmd = Bind(
        epoch=epoch,
        members=tuple(members),
        preempt=preempt,  # type: ignore[arg-type]
        adopt=adopt,
        sp_threshold=sp_threshold,
    )
    send(r, keys, members, cmd)
    return epoch


def _width_change(old: tuple[int, ...], new: tuple[int, ...]) -> bool:
    return set(old) <= set(new) or (set(new) <= set(old) and old[0] == new[0])


def release(
    r: redis.Redis,
    keys: Keys,
    members: tuple[int, ...],
    epoch: int,
    retract: bool = False,
    scatter: bool = False,
    park: bool = False,
) -> None:
    """Release ``epoch``'s group: once its TP requests have finished, at once with ``retract`` (they continue in
    DP on the leader, recomputed), at once with ``scatter`` (they continue in DP on their owners, KV moved), or
    at once with ``park`` (as scatter, and those no member holds alone stay parked, KV kept, until
    :func:`resume`). Releasing a parked epoch ends its parked requests."""
    cmd = Release(epoch=epoch, retract=retract, scatter=scatter, park=park)
    raw = r.hget(keys.groups, str(epoch))
    if raw is not None:
        g = decode(raw, Group)
        if g.state == "parked":
            r.hdel(keys.groups, str(epoch))
        else:
            g = msgspec.structs.replace(g, state="releasing", since=time.time(), park=park, released=cmd.kind)
            r.hset(keys.groups, str(epoch), encode(g))
    send(r, keys, members, cmd)


def resume(r: redis.Redis, keys: Keys, epoch: int) -> tuple[int, tuple[int, ...]]:
    """Bind the members of parked ``epoch`` again, in the same order, continuing its parked requests; returns
    the new epoch and the members. ValueError if no group of that epoch is parked (or being parked)."""
    raw = r.hget(keys.groups, str(epoch))
    g = decode(raw, Group) if raw is not None else None
    if g is None or g.state != "parked":
        why = "it is still being parked" if g is not None and g.park else "no parked group has that epoch"
        raise ValueError(f"cannot resume epoch {epoch}: {why}")
    if clash := [
        o.members
        for o in groups(r, keys)
        if o.epoch != epoch and o.state != "parked" and set(o.members) & set(g.members)
    ]:
        raise ValueError(f"engines {list(g.members)} are in group(s) {clash}")
    new = next_epoch(r, keys)
    now = time.time()
    record = Group(
        epoch=new, members=g.members, reason="manual", since=now, last_used=now, carries=(*g.carries, epoch)
    )
    pipe = r.pipeline(transaction=True)
    pipe.hdel(keys.groups, str(epoch))
    pipe.hset(keys.groups, str(new), encode(record))
    pipe.execute()
    send(r, keys, g.members, Bind(epoch=new, members=g.members, resume=epoch))
    return new, g.members


def queue_depths(r: redis.Redis, keys: Keys) -> dict[str, tuple[int, float]]:
    """Per priority class: (waiting requests, seconds the oldest has waited; 0 if none)."""
    out = {}
    for name, cls in PRIORITY_CLASS.items():
        lo, hi = cls * CLASS_WEIGHT, (cls + 1) * CLASS_WEIGHT - 1
        n = int(r.zcount(keys.queue, lo, hi))
        first = r.zrangebyscore(keys.queue, lo, hi, start=0, num=1)
        t0 = r.hget(keys.request(text(first[0])), "enqueued_at") if first else None
        out[name] = (n, max(0.0, time.time() - float(t0)) if t0 else 0.0)
    return out


def waiting(r: redis.Redis, keys: Keys, limit: int = 20) -> list[dict[str, str]]:
    """The first ``limit`` waiting requests in dispatch order, as their Redis hashes."""
    if limit <= 0:
        return []
    ids = r.zrange(keys.queue, 0, limit - 1)
    pipe = r.pipeline(transaction=False)
    for rid in ids:
        pipe.hgetall(keys.request(text(rid)))
    return [{k.decode(): v.decode() for k, v in row.items()} for row in pipe.execute() if row]


def status(r: redis.Redis, keys: Keys) -> dict[int, Heartbeat]:
    """Live engines' heartbeats (mode, epoch, group, width, switch timings), by engine index."""
    out = {}
    for e in sorted(int(x) for x in r.smembers(keys.workers)):
        hb = live_heartbeat(r.get(keys.worker(e)), r.get(keys.ready(e)))
        if hb is not None:
            out[e] = hb
    return out
