"""A client's abort of a request its owner does not run: the group's leader runs adopted requests of other members
as copies (worker_ext.ownership), while the owner, a follower, executes step plans and does not read its tokenizer.

The follower reads its tokenizer's input between the leader's messages (keeping it for its loop's next iteration)
and, for each abort naming a request it owns, ends its own request at once (the client has left) and posts the
request id on the pool's store. The leader reads the store at its step boundaries (every ``POLL_S``) and aborts
its copy there, freeing the group's KV, as SGLang aborts any request.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from worker_ext.ownership import Ownership
from worker_ext.sglang_patches.surface import SchedulerSurface

if TYPE_CHECKING:
    from worker_ext.comm_pool import CommPool

log = logging.getLogger("flying.aborts")
POLL_S = 0.05  # how often a leader looks for members' aborts


class AbortRelay:
    """Members' client aborts, relayed to the leader over the pool's rendezvous store (``pool.store``: a
    torch.distributed Store, None while unconnected; it is replaced when engine 0 restarts)."""

    def __init__(self, engine: SchedulerSurface, index: int, pool: CommPool) -> None:
        self.engine, self.index, self.pool = engine, index, pool
        self._seen = 0  # leader: the members' aborts of this epoch applied so far
        self._polled = 0.0

    def start_epoch(self) -> None:
        self._seen = 0

    @staticmethod
    def _key(epoch: int) -> str:
        return f"flying/abort/{epoch}"

    def forward(self, epoch: int, ownership: Ownership) -> None:
        """Follower, between the leader's messages."""
        rids, store = self.engine.receive_aborts(), self.pool.store
        if not rids or store is None:
            return
        mine = ownership.end_aborted(rids)
        if not mine:
            return
        try:
            for rid in mine:
                i = store.add(f"{self._key(epoch)}/n", 1)
                store.set(f"{self._key(epoch)}/{i}", rid)
        except (RuntimeError, OSError) as exc:  # the store is engine 0's: the group is failing anyway
            log.warning("engine %d: could not post aborts %s: %s", self.index, mine, exc)
            return
        log.info("engine %d: client aborted %s; the leader aborts its copy", self.index, mine)

    def apply(self, epoch: int, ownership: Ownership) -> None:
        """Leader, at a step boundary: abort the copies members' clients left."""
        store = self.pool.store
        if store is None or not ownership.has_copies or time.monotonic() - self._polled < POLL_S:
            return  # (only copies can be aborted by another member)
        self._polled = time.monotonic()
        key = self._key(epoch)
        try:
            n = store.add(f"{key}/n", 0)
            rids = [store.get(f"{key}/{i}").decode() for i in range(self._seen + 1, n + 1)]
        except (RuntimeError, OSError) as exc:
            log.warning("engine %d: could not read members' aborts: %s", self.index, exc)
            return
        self._seen = n
        for rid in rids:
            self.engine.abort(rid)
            log.info("engine %d: aborted %s for its owner", self.index, rid)
