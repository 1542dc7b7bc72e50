"""The simulation's configuration (:class:`SimConfig`): the cluster, the system under test (:data:`Mode`), the
simulated router's policy (the live router's defaults, :class:`router.config.PolicyConfig`), the cost model, and
the faults to inject."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal

from flying.cost_model import H200_LLAMA70B, CostModel
from router.config import MANUAL_OFF, Limits, PolicyConfig

Mode = Literal["dynamic", "dp", "tp", "shift"]


@dataclass(frozen=True)
class SimConfig:
    engines: int = 8  # in all (nodes x engines per node)
    nodes: int = 1  # bind domains: each node's engines form one communicator pool (groups never span two)
    mode: Mode = "dynamic"
    tp_width: int = 2  # static TP's group width
    shift_threshold: int = 256  # shift: a step batching at most this many tokens runs in full TP (seed 001)
    # the live router's defaults: the simulator runs the policy flying-router runs
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    limits: Limits = field(default_factory=Limits)
    # the simulated GPU workers' --sp-threshold (a Bind may override it): Shift Parallelism's threshold, where its
    # SP and TP steps cost the same in the cost model at width 8 (CPU workers default to 512, set by measurement)
    sp_threshold: int = 256
    cost: CostModel = H200_LLAMA70B
    router_ms: float = 2.0  # a router round: snapshot, decision, assignments
    command_ms: float = 2.0  # XADD -> the engine has read the command
    tick_s: float = 0.05  # the router wakes at least this often
    router_down: tuple[tuple[float, float], ...] = ()  # (from, to): the router is dead (kill -9 and restart)
    ignore_binds: tuple[tuple[int, float, float], ...] = ()  # (engine, from, to): it reads no bind (hung)
    horizon_s: float = 36_000.0  # give up (requests still unfinished count as lost)
    # the engines apply Bind.adopt / Release.scatter (and say so in their heartbeats) ...
    kv_transform: bool = True
    no_kv_transform: tuple[int, ...] = ()  # ... except these (an older worker build)
    # the engines apply Bind.keep (mixed steps: bound, a member runs its own DP requests in the group's steps, and
    # say so in their heartbeats). The live workers do not yet: off by default, a projection when on
    mixed_steps: bool = False
    # the engines apply Release.park / Bind.resume (a long request's group parks it for a burst, KV kept, and
    # resumes it after) and say so in their heartbeats, as the live workers do
    park: bool = True
    # ... and a group with only decode work joins every n-th of its members' own steps meanwhile (prefills: at once)
    mixed_decode_every: int = 4

    def __post_init__(self) -> None:
        if self.mode not in typing.get_args(Mode):
            raise ValueError(f"mode {self.mode!r} is not one of {', '.join(typing.get_args(Mode))}")
        if self.engines < 1 or self.tp_width < 1:
            raise ValueError(f"need engines >= 1 and tp_width >= 1, got {self.engines} and {self.tp_width}")
        if self.nodes < 1 or self.engines % self.nodes:
            raise ValueError(f"{self.engines} engines do not split evenly over {self.nodes} nodes")

    @property
    def per_node(self) -> int:
        """Engines on each node (its pool's size)."""
        return self.engines // self.nodes

    def node_of(self, engine: int) -> int:
        return engine // self.per_node

    def effective_policy(self) -> PolicyConfig:
        """The policy the simulated router runs: static modes make no groups of their own."""
        if self.mode == "dynamic":
            return self.policy
        return dataclasses.replace(self.policy, off=self.policy.off | MANUAL_OFF)

    def effective_limits(self) -> Limits:
        """Static: a static TP engine is offered as much per GPU as a DP engine."""
        if self.mode == "dynamic":
            return self.limits
        return dataclasses.replace(self.limits, tp_inflight_per_engine=self.limits.max_inflight_per_worker)
