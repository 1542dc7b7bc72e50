"""A client's abort of a request its owner does not run: the group's leader runs adopted requests of other members
as copies (worker_ext.adoption), while the owner, a follower, executes step plans and does not read its tokenizer.

The follower reads its tokenizer's input between the leader's messages (keeping it for its loop's next iteration)
and, for each abort naming a request it owns, ends its own request at once (the client has left) and posts the
request id on the pool's store. The leader reads the store at its step boundaries (every ``POLL_S``) and aborts
its copy there, freeing the group's KV, as SGLang aborts any request.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from worker_ext.sglang_patches import prefix_cache
from worker_ext.sglang_patches import requests as rq

if TYPE_CHECKING:
    from worker_ext.binding import Binding, Epoch

log = logging.getLogger("flying.aborts")
POLL_S = 0.05  # how often a leader looks for members' aborts


def _key(e: Epoch) -> str:
    return f"flying/abort/{e.epoch}"


def forward(b: Binding, e: Epoch) -> None:
    """Follower, between the leader's messages."""
    store = b.pool.store
    rids = rq.receive_while_following(b.s)
    if not rids or store is None:
        return
    mine = [r for r in b.owned if any(r.startswith(a) for a in rids)]
    if not mine:
        return
    ended = [b.owned.pop(r) for r in mine]
    for req in ended:
        prefix_cache.let_go(b.s, req)
    rq.end_aborted(b.s, ended)
    try:
        for rid in mine:
            i = store.add(f"{_key(e)}/n", 1)
            store.set(f"{_key(e)}/{i}", rid)
    except (RuntimeError, OSError) as exc:  # the store is engine 0's: the group is failing anyway
        log.warning("engine %d: could not post aborts %s: %s", b.engine, mine, exc)
        return
    log.info("engine %d: client aborted %s; the leader aborts its copy", b.engine, mine)


def apply(b: Binding, e: Epoch) -> None:
    """Leader, at a step boundary: abort the copies members' clients left."""
    store = b.pool.store
    if store is None or not b.owners or time.monotonic() - b.aborts_polled < POLL_S:
        return  # (only copies can be aborted by another member)
    b.aborts_polled = time.monotonic()
    try:
        n = store.add(f"{_key(e)}/n", 0)
        rids = [store.get(f"{_key(e)}/{i}").decode() for i in range(b.aborts_seen + 1, n + 1)]
    except (RuntimeError, OSError) as exc:
        log.warning("engine %d: could not read members' aborts: %s", b.engine, exc)
        return
    b.aborts_seen = n
    for rid in rids:
        rq.abort(b.s, rid)
        log.info("engine %d: aborted %s for its owner", b.engine, rid)
