"""Who streams each TP request of a bound group.

A request streams from the engine whose endpoint it arrived on, its *owner*. The leader's scheduler runs every TP
request; for a request another member owns it runs a copy and diverts its output: the leader's output path does
not send it to its own detokenizer but puts the new tokens (and log-probs, finish reason) in an outbox that the
next message to the members carries (``Emitted``); the owner appends them to its own request (``owned``) and
streams them from there. Sampling happens on the leader only, so every member's client sees the tokens the leader
sampled, seeded sampling included.
"""

from __future__ import annotations

from worker_ext.sglang_patches.requests import Emitted
from worker_ext.sglang_patches.surface import OwnershipEngine, Req


class Ownership:
    def __init__(self, engine: OwnershipEngine) -> None:
        self.engine = engine
        self._owners: dict[str, int] = {}  # leader: rank of the member that streams each copied request
        self._sent: dict[str, tuple[int, int]] = {}  # leader: output ids, log-probs already emitted per copy
        self._outbox: list[Emitted] = []  # leader: output for other members, sent with the next message
        self._owned: dict[str, Req] = {}  # follower: its own requests the leader runs

    # --- leader ---------------------------------------------------------------------------------------------

    def add_copy(self, req: Req, owner: int) -> None:
        """The leader runs ``req`` for the member of rank ``owner``, which streams what it has so far."""
        self._owners[req.rid] = owner
        self._sent[req.rid] = self.engine.progress(req)

    def owner_of(self, rid: str) -> int:
        return self._owners.get(rid, 0)

    def copies(self) -> set[str]:
        return set(self._owners)

    @property
    def has_copies(self) -> bool:
        return bool(self._owners)

    def divert(self, req: Req) -> bool:
        """Leader's output filter: a copied request's new output goes to the outbox, not to this detokenizer."""
        if req.rid not in self._owners:
            return False
        em = self.engine.emitted_since(req, self._sent[req.rid])
        if em.output_ids or em.finished_reason is not None:
            self._outbox.append(em)
        self._sent[req.rid] = self.engine.progress(req)
        if self.engine.is_finished(req):
            del self._owners[req.rid], self._sent[req.rid]
        return True

    def end(self, req: Req) -> bool:
        """Leader's abort filter: the scheduler ends a copied request outside its output stream (SGLang aborts
        the last request a full KV pool cannot decode, say): its owner gets the end and tells its client."""
        if req.rid not in self._owners:
            return False
        self._outbox.append(self.engine.emitted_since(req, self._sent.pop(req.rid), ending=True))
        del self._owners[req.rid]
        return True

    def send(self, em: Emitted) -> None:
        """Leader: ``em`` goes to its owner with the next message (an end the output path does not see)."""
        self._outbox.append(em)

    @property
    def has_outbox(self) -> bool:
        return bool(self._outbox)

    def take_outbox(self) -> list[Emitted]:
        out, self._outbox = self._outbox, []
        return out

    def take_copies(self, rids: set[str]) -> dict[str, tuple[int, tuple[int, int]]]:
        """Leader: hand over whom ``rids`` are run for and what was sent of them (parked)."""
        out = {rid: (self._owners.pop(rid), self._sent.pop(rid)) for rid in list(self._owners) if rid in rids}
        return out

    def put_copies(self, copies: dict[str, tuple[int, tuple[int, int]]]) -> None:
        """Leader: take back copies handed over by :meth:`take_copies` (resumed)."""
        for rid, (owner, sent) in copies.items():
            self._owners[rid], self._sent[rid] = owner, sent

    def forget_copies(self) -> None:
        """The epoch ends: no copies, nothing left to send."""
        self._owners.clear()
        self._sent.clear()
        self._outbox = []

    # --- follower -------------------------------------------------------------------------------------------

    def hold(self, reqs: list[Req]) -> None:
        """A follower's own requests, now run by the leader."""
        self._owned = {r.rid: r for r in reqs}

    def add_owned(self, reqs: list[Req]) -> None:
        """More of the follower's own requests for the leader to run (new ones, arrived while it follows)."""
        self._owned.update((r.rid, r) for r in reqs)

    def owned(self) -> dict[str, Req]:
        return dict(self._owned)

    def deliver(self, emitted: list[Emitted]) -> None:
        """Follower: append the leader's output to its own requests and stream it to their clients."""
        reqs = []
        for em in emitted:
            req = self._owned.get(em.rid)
            if req is None:
                continue  # not this member's
            self.engine.apply_emitted(req, em)
            reqs.append(req)
            if self.engine.is_finished(req):
                del self._owned[em.rid]
                self.engine.let_go(req)
        self.engine.stream(reqs)

    def end_aborted(self, aborted: list[str]) -> list[str]:
        """Follower: its own requests whose client aborted (an abort names a request id or its prefix) end here at
        once; returns their ids."""
        mine = [r for r in self._owned if any(r.startswith(a) for a in aborted)]
        ended = [self._owned.pop(r) for r in mine]
        for req in ended:
            self.engine.let_go(req)
        if ended:
            self.engine.end_aborted(ended)
        return mine

    def take_unstarted(self) -> list[Req]:
        """Follower, leaving its group: its own requests the leader never took (no output yet, unfinished)."""
        left = [
            r
            for r in self._owned.values()
            if not self.engine.is_finished(r) and not self.engine.progress(r)[0]
        ]
        for r in left:
            del self._owned[r.rid]
        return left

    def take_owned_of(self, rids: set[str]) -> dict[str, Req]:
        """Follower: hand over its own requests among ``rids`` (parked)."""
        return {rid: self._owned.pop(rid) for rid in list(self._owned) if rid in rids}

    def take_owned(self) -> dict[str, Req]:
        owned, self._owned = self._owned, {}
        return owned
