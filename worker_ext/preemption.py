"""A bind this engine has received but not entered yet, and what it does with the engine's DP work meanwhile.

Hard (and adopting) binds are entered at the next clean step boundary. Sequential: admit no new DP work, bind once
every member's running work has drained. Soft: the leader starts the group's requests in DP meanwhile. Members meet
on a drain barrier on the pool's store, checked at step boundaries, never blocking a scheduler.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from flying.messages import Bind
from worker_ext.sglang_patches.surface import PreemptionEngine, Req

if TYPE_CHECKING:
    from worker_ext.comm_pool import CommPool

log = logging.getLogger("flying.preemption")


class PendingBind:
    """Owns the pending bind command and the DP requests held back for it (``pool``: the engine's CommPool, read
    for its store and readiness)."""

    def __init__(self, engine: PreemptionEngine, index: int, pool: CommPool) -> None:
        self.engine, self.index, self.pool = engine, index, pool
        self.cmd: Bind | None = None
        self._held: list[Req] = []  # DP requests held back while a sequential or soft bind waits
        self._soft_dp_rids: set[str] | None = None  # soft bind: the DP work that must drain first
        self._drained_for = 0  # the epoch this engine has counted itself drained for

    @property
    def epoch(self) -> int:
        return self.cmd.epoch if self.cmd is not None else 0

    @property
    def held(self) -> int:
        return len(self._held)

    def accept(self, cmd: Bind) -> None:
        self.cmd = cmd

    def cancel(self) -> int:
        """The router rolled the bind back before this engine applied it: let held DP work in again. Returns the
        epoch rolled back."""
        if self.cmd is None:
            raise RuntimeError("no pending bind to cancel")
        epoch = self.cmd.epoch
        log.info("engine %d: bind %d rolled back before it was applied", self.index, epoch)
        self.cmd, self._soft_dp_rids = None, None
        self.let_held_in()
        return epoch

    def take_ready(self) -> Bind | None:
        """At a step boundary, unbound: the pending bind if it can be entered now (it is no longer pending then);
        meanwhile a sequential or soft bind holds new DP work back."""
        cmd = self.cmd
        if cmd is None:
            return None
        if cmd.preempt == "soft":
            ready = self._soft_ready(cmd)
        elif cmd.preempt == "sequential" and not self._all_drained(cmd):
            self._held += self.engine.hold_waiting()  # admit no new DP work; bind once every member drained
            ready = False
        else:
            ready = self.engine.at_clean_step_boundary()
        if not ready:
            return None
        self.cmd, self._soft_dp_rids = None, None
        return cmd

    def peek_held(self) -> list[Req]:
        return list(self._held)

    def take_held(self) -> list[Req]:
        """The held-back DP requests, to the bind (it pauses or adopts them)."""
        held, self._held = self._held, []
        return held

    def let_held_in(self) -> None:
        """A refused or rolled-back bind: the held DP requests go back to the waiting queue's front."""
        if self._held:
            self.engine.queue_front(self._held)
            self._held = []

    def _all_drained(self, cmd: Bind) -> bool:
        """Sequential preemption: True once every member has finished its running DP work. Each member counts itself
        on the pool's store when drained and enters the bind only when all have, so a member that drains first waits
        in its own loop (an idle loop polls at least every second) instead of in the bind handshake, whose group
        timeout a slow member's drain could exceed."""
        if self.engine.has_running_dp_work() or not self.engine.at_clean_step_boundary():
            return False
        return self._barrier(cmd, "seq", need=len(cmd.members))

    def _soft_ready(self, cmd: Bind) -> bool:
        """Soft preemption. The DP work present when the command arrived drains (nothing new is admitted for it);
        requests arriving after it are the group's and the leader starts them at once, in DP mode. Members signal
        "drained" on the pool's store; the leader binds once it and every member are drained (re-prefilling its
        started TP requests at the new width), then lets the members in with a "go". Nobody blocks: each checks the
        store at its step boundaries."""
        leader = cmd.members[0] == self.index
        if self._soft_dp_rids is None:
            self._soft_dp_rids = self.engine.unfinished_running_rids()
            self._held += self.engine.hold_waiting()
        if not leader:
            self._held += self.engine.hold_waiting()  # a member takes no new work while it drains
        if self._soft_dp_rids & self.engine.unfinished_running_rids():
            return False
        if not self.engine.at_clean_step_boundary():
            return False
        if not leader:
            return self._barrier(cmd, "soft", go="wait")
        return self._barrier(cmd, "soft", count=False, need=len(cmd.members) - 1, go="set")

    def _barrier(self, cmd: Bind, kind: str, count: bool = True, need: int = 0, go: str = "") -> bool:
        """A drain barrier on the pool's store, checked at step boundaries (never blocking): count this engine
        drained for ``cmd`` (once, if ``count``); ready once ``need`` members have, then set the "go" key
        (``go="set"``), or ready once that key is set (``go="wait"``). False while the store is unreachable (engine 0
        restarting: the router rolls the bind back); True without a pool (the bind then refuses it)."""
        store, key = self.pool.store, f"flying/{kind}/{cmd.epoch}"
        if store is None or not self.pool.ready.is_set():
            return True
        try:
            if count and self._drained_for != cmd.epoch:
                store.add(f"{key}/drained", 1)
                self._drained_for = cmd.epoch
            if go == "wait":
                return bool(store.check([f"{key}/go"]))
            if store.add(f"{key}/drained", 0) < need:
                return False
            if go == "set":
                store.set(f"{key}/go", "1")
            return True
        except Exception as exc:  # noqa: BLE001
            log.warning("engine %d: %s bind %d: %s", self.index, kind, cmd.epoch, exc)
            return False
