"""What the policy knows about one live engine: :class:`EngineView`, built from the engine's heartbeat."""

from __future__ import annotations

from dataclasses import dataclass

from flying.messages import Heartbeat


@dataclass(frozen=True)
class EngineView:
    """What the policy knows about one live engine (from its heartbeat and its inflight set)."""

    engine: int
    url: str
    inflight: int  # assigned by the router and not finished (DP, and the TP requests of its group it owns)
    free_kv_tokens: int
    max_total_tokens: int
    mode: str = "dp"
    epoch: int = 0  # the epoch it is bound in (0: none)
    pending: int = 0  # a bind it has read and not applied yet
    num_engines: int = 1  # engines its communicator pool spans (1: cannot bind)
    beat_ts: float = 0.0
    kv_transform: bool = False  # it applies Bind.adopt / Release.scatter
    mixed_steps: bool = False  # it applies Bind.keep (runs its DP requests in the group's steps)
    launch_id: str = ""  # its server's launch (a restart forgets its prefix cache)
    node: str = ""  # the node it runs on: groups bind engines of one node only
    pool_first: int = 0  # the first engine of its node's pool (spanning num_engines engines)
    paused: int = 0  # DP requests a bind set aside on it (resumed at the release)
    park: bool = False  # it applies Release.park / Bind.resume
    parked: tuple[int, ...] = ()  # epochs whose requests are parked on it
    group: tuple[int, ...] = ()  # the members of the epoch it is bound in (the first: its leader)
    pool_ready: bool = True  # its communicator pool is built (a restarted engine's takes a while: no binds)
    running: int = 0  # sequences in its running batch (its heartbeat's; bound: the group's, on the leader)
    waiting: int = 0  # requests not yet prefilled, waiting in its scheduler (likewise)
    context_len: int = 0  # the longest request it takes, prompt and output (0: not reported)

    @property
    def dp_room(self) -> int:
        """The most KV a DP request sent here may need: the engine's KV, or, while it holds parked requests (their
        head slices stay until a resume), its free KV (conservatively: its running DP requests free theirs)."""
        return min(self.max_total_tokens, self.free_kv_tokens) if self.parked else self.max_total_tokens

    @property
    def node_key(self) -> str:
        """Its node's key in the router's state (``RouterState.widths``): the node's name, or its pool's first
        engine where nodes have no names."""
        return self.node or str(self.pool_first)

    @property
    def pool(self) -> tuple[str, int, int]:
        """Its node's communicator pool: (node, first engine, engines); engines of one pool may bind together."""
        return (self.node, self.pool_first, self.num_engines)

    @classmethod
    def from_heartbeat(cls, hb: Heartbeat, inflight: int) -> EngineView:
        """The view of an engine whose heartbeat is ``hb`` and that holds ``inflight`` assigned requests (the
        router: the size of its inflight set; the simulator: what its engine model holds)."""
        return cls(
            hb.engine,
            hb.url,
            inflight,
            hb.free_kv_tokens,
            hb.max_total_tokens,
            mode=hb.mode,
            epoch=hb.epoch,
            pending=hb.pending,
            num_engines=hb.num_engines,
            beat_ts=hb.ts,
            kv_transform=hb.kv_transform,
            mixed_steps=hb.mixed_steps,
            launch_id=hb.launch_id,
            node=hb.node,
            pool_first=hb.pool_first,
            paused=hb.paused,
            park=hb.park,
            parked=hb.parked,
            group=hb.group,
            pool_ready=hb.pool_ready,
            running=hb.running,
            waiting=hb.waiting,
            context_len=hb.context_len,
        )
