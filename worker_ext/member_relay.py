"""What reaches a follower's own endpoint while it follows its group, relayed to the group's leader.

A follower executes step plans and does not run its scheduler loop, so its tokenizer's input waits. Between the
leader's messages it reads that input (keeping what it cannot act on for its loop's next iteration) and relays
over the pool's store:

- its clients' **aborts** of requests it owns (adopted, or new ones below): it ends its own request at once and
  posts the id; the leader aborts its copy there, freeing the group's KV, as SGLang aborts any request;
- its **new requests** (a router may send TP work to any member, so ownership is spread): SGLang's own intake
  validates each, the follower keeps it (it streams from here) and posts its state; the leader runs it as a copy
  this member owns, prefilled at the group's width, and sends its output back with the next message.

The leader reads the store at its step boundaries, every ``POLL_S``, before deciding on a release, so a request
it has taken is live and the group stays bound until it ends; a request posted after the leader's last read stays
the follower's, which runs it in DP once the group is released (nothing is lost).
"""

from __future__ import annotations

import base64
import logging
import pickle
import time
from typing import TYPE_CHECKING

import msgspec

from flying.messages import split_engine_rid
from worker_ext.epoch import Epoch
from worker_ext.ownership import Ownership
from worker_ext.sglang_patches.requests import ReqState
from worker_ext.sglang_patches.surface import RelayEngine

if TYPE_CHECKING:
    from worker_ext.comm_pool import CommPool

log = logging.getLogger("flying.member_relay")
POLL_S = 0.05  # how often a leader reads what its members posted


class Posted(msgspec.Struct, frozen=True):
    """One entry of an epoch's relay log: a member's client abort (``aborted``) or a new request (``state``)."""

    rank: int
    aborted: str = ""
    state: ReqState | None = None


class MemberRelay:
    """Members' aborts and new requests, relayed to the leader over the pool's rendezvous store (``pool.store``:
    a torch.distributed Store, None while unconnected; it is replaced when engine 0 restarts)."""

    def __init__(self, engine: RelayEngine, index: int, pool: CommPool) -> None:
        self.engine, self.index, self.pool = engine, index, pool
        self._seen = 0  # leader: entries of this epoch's log applied so far
        self._polled = 0.0

    def start_epoch(self) -> None:
        self._seen = 0

    @staticmethod
    def _key(epoch: int) -> str:
        return f"flying/member/{epoch}"

    def forward(self, e: Epoch, ownership: Ownership) -> None:
        """Follower, between the leader's messages."""
        got = self.engine.receive()
        mine = ownership.end_aborted(got.aborted) if got.aborted else []
        ownership.add_owned(got.new)
        posts = [Posted(e.rank, aborted=rid) for rid in mine]
        posts += [Posted(e.rank, state=self.engine.state_of(req)) for req in got.new]
        store = self.pool.store
        if not posts or store is None:
            return
        try:
            for post in posts:
                i = store.add(f"{self._key(e.epoch)}/n", 1)
                store.set(f"{self._key(e.epoch)}/{i}", base64.b64encode(pickle.dumps(post)).decode())
        except (RuntimeError, OSError) as exc:  # the store is engine 0's: the group is failing anyway
            log.warning("engine %d: could not post to the leader: %s", self.index, exc)
            return
        if mine:
            log.info(
                "engine %d: client aborted %s; the leader aborts its copy",
                self.index,
                mine,
                extra={"request_ids": [split_engine_rid(rid)[0] for rid in mine]},
            )
        if got.new:
            log.info("engine %d: %d new requests go to the group's leader", self.index, len(got.new))

    def apply(self, e: Epoch, ownership: Ownership) -> None:
        """Leader, at a step boundary: abort the copies members' clients left, take members' new requests."""
        store = self.pool.store
        if store is None or time.monotonic() - self._polled < POLL_S:
            return
        self._polled = time.monotonic()
        key = self._key(e.epoch)
        try:
            n = store.add(f"{key}/n", 0)
            posts = [
                pickle.loads(base64.b64decode(store.get(f"{key}/{i}"))) for i in range(self._seen + 1, n + 1)
            ]
        except (RuntimeError, OSError) as exc:
            log.warning("engine %d: could not read what the members posted: %s", self.index, exc)
            return
        self._seen = n
        new = []
        for post in posts:
            if post.state is not None:
                req = self.engine.req_from_state(post.state)
                ownership.add_copy(req, post.rank)
                new.append(req)
            else:
                self.engine.abort(post.aborted)
                log.info(
                    "engine %d: aborted %s for its owner",
                    self.index,
                    post.aborted,
                    extra={"request_id": split_engine_rid(post.aborted)[0]},
                )
        if new:
            self.engine.queue_back(new)
            log.info("engine %d: runs %d requests of its members", self.index, len(new))
