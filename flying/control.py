"""Bind/release commands onto the engines' Redis streams, and the engines' switching state from their heartbeats.

The operator's and the tests' control API (``flyctl bind|release|status``); the router's policy (issue 4) sends
the same commands.
"""

from __future__ import annotations

import redis

from flying.keys import Keys
from flying.messages import Bind, Command, Heartbeat, Release, encode
from flying.workers import live_heartbeat


def send(r: redis.Redis, keys: Keys, members: tuple[int, ...], cmd: Command) -> None:
    """XADD ``cmd`` to every member's command stream (one pipeline; streams keep the last 1000 entries)."""
    pipe = r.pipeline(transaction=False)
    for m in members:
        pipe.xadd(keys.commands(m), {"msg": encode(cmd)}, maxlen=1000, approximate=True)
    pipe.execute()


def next_epoch(r: redis.Redis, keys: Keys) -> int:
    return int(r.incr(keys.epoch))


def bind(r: redis.Redis, keys: Keys, members: tuple[int, ...], preempt: str = "hard") -> int:
    epoch = next_epoch(r, keys)
    send(r, keys, members, Bind(epoch=epoch, members=tuple(members), preempt=preempt))  # type: ignore[arg-type]
    return epoch


def release(r: redis.Redis, keys: Keys, members: tuple[int, ...], epoch: int) -> None:
    send(r, keys, members, Release(epoch=epoch))


def status(r: redis.Redis, keys: Keys) -> dict[int, Heartbeat]:
    """Live engines' heartbeats (mode, epoch, group, width, switch timings), by engine index."""
    out = {}
    for e in sorted(int(x) for x in r.smembers(keys.workers)):
        hb = live_heartbeat(r.get(keys.worker(e)), r.get(keys.ready(e)))
        if hb is not None:
            out[e] = hb
    return out
