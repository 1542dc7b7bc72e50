"""What a bind does with the members' DP work before they bind, besides hard preemption (pausing it with its KV)
and adoption (worker_ext.adoption): sequential (admit no new DP work, bind once every member's running work has
drained) and soft (the leader starts the group's requests in DP meanwhile). Members meet on a drain barrier on
the pool's store, checked at step boundaries, never blocking a scheduler.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from flying.messages import Bind
from worker_ext import sglang_patches

if TYPE_CHECKING:
    from worker_ext.binding import Binding

log = logging.getLogger("flying.preemption")


def cancel_pending(b: Binding) -> None:
    """The router rolled the bind back before this engine applied it: let held DP work in again."""
    assert b.pending is not None
    log.info("engine %d: bind %d rolled back before it was applied", b.engine, b.pending.epoch)
    b.last_epoch = max(b.last_epoch, b.pending.epoch)
    b.pending, b.soft_dp_rids = None, None
    if b.held:
        sglang_patches.unhold_waiting(b.s, b.held)
        b.held = []
    b.on_change()


def all_drained(b: Binding, cmd: Bind) -> bool:
    """Sequential preemption: True once every member has finished its running DP work. Each member counts itself
    on the pool's store when drained and enters the bind only when all have, so a member that drains first waits
    in its own loop (an idle loop polls at least every second) instead of in the bind handshake, whose group
    timeout a slow member's drain could exceed."""
    if sglang_patches.has_running_dp_work(b.s) or not sglang_patches.at_clean_step_boundary(b.s):
        return False
    return barrier(b, cmd, "seq", need=len(cmd.members))


def soft_ready(b: Binding, cmd: Bind) -> bool:
    """Soft preemption. The DP work present when the command arrived drains (nothing new is admitted for it);
    requests arriving after it are the group's and the leader starts them at once, in DP mode. Members signal
    "drained" on the pool's store; the leader binds once it and every member are drained (re-prefilling its
    started TP requests at the new width), then lets the members in with a "go". Nobody blocks: each checks the
    store at its step boundaries."""
    leader = cmd.members[0] == b.engine
    if b.soft_dp_rids is None:
        b.soft_dp_rids = sglang_patches.unfinished_running_rids(b.s)
        b.held += sglang_patches.hold_waiting(b.s)
    if not leader:
        b.held += sglang_patches.hold_waiting(b.s)  # a member takes no new work while it drains
    if b.soft_dp_rids & sglang_patches.unfinished_running_rids(b.s):
        return False
    if not sglang_patches.at_clean_step_boundary(b.s):
        return False
    if not leader:
        return barrier(b, cmd, "soft", go="wait")
    return barrier(b, cmd, "soft", count=False, need=len(cmd.members) - 1, go="set")


def barrier(b: Binding, cmd: Bind, kind: str, count: bool = True, need: int = 0, go: str = "") -> bool:
    """A drain barrier on the pool's store, checked at step boundaries (never blocking): count this engine
    drained for ``cmd`` (once, if ``count``); ready once ``need`` members have, then set the "go" key
    (``go="set"``), or ready once that key is set (``go="wait"``). False while the store is unreachable (engine 0
    restarting: the router rolls the bind back); True without a pool (the bind then refuses it)."""
    store, key = b.pool.store, f"flying/{kind}/{cmd.epoch}"
    if store is None or not b.pool.ready.is_set():
        return True
    try:
        if count and b.drained_for != cmd.epoch:
            store.add(f"{key}/drained", 1)
            b.drained_for = cmd.epoch
        if go == "wait":
            return store.check([f"{key}/go"])
        if store.add(f"{key}/drained", 0) < need:
            return False
        if go == "set":
            store.set(f"{key}/go", "1")
        return True
    except Exception as exc:  # noqa: BLE001
        log.warning("engine %d: %s bind %d: %s", b.engine, kind, cmd.epoch, exc)
        return False
