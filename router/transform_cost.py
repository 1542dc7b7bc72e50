"""What a KV transformation costs, for the policy (whether adopting beats waiting) and the simulator.

A transformation (``Bind.adopt``, ``Release.scatter``) moves requests' KV between the members of one group by head
slices: at width ``d`` a member keeps its own ``1/d`` of each head and sends the other ``(d-1)/d`` (adoption); a
scatter brings a request's slices back to its owner. It costs :func:`flying.cost_model.kv_transform_ms`: a fixed
part plus the busiest member's moved bytes over the link, paid as a stall of the group (adopt) or of the members'
first DP step (scatter). The calibration (bytes per token, link bandwidth, the fixed part from Gyges) is in
docs/benchmarks.md, "Cost model calibration and sensitivity".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from flying.cost_model import CostModel
from router.config import PolicyConfig
from router.engine_view import EngineView

# milliseconds: a busy block is adopted into a group only if the estimated KV transformation stalls the group at most
# this (a block too costly to adopt whole binds narrower groups, whose SP prefill is slower until they widen)
ADOPT_MAX_MS = 200.0


def adopt_moves(tokens: list[float]) -> list[tuple[float, float]]:
    """Adoption at width ``d = len(tokens)``: member m holds ``tokens[m]`` KV tokens of DP requests; it keeps 1/d of
    each in place, sends (d-1)/d and receives 1/d of every other member's."""
    d, total = len(tokens), sum(tokens)
    return [(t * (d - 1) / d, (total - t) / d) for t in tokens]


def scatter_moves(owned: list[float]) -> list[tuple[float, float]]:
    """Scatter at width ``d``: member m owns requests of ``owned[m]`` KV tokens; it receives the (d-1)/d of them the
    others hold and sends its 1/d of every other member's."""
    return [(r, s) for s, r in adopt_moves(owned)]


class TransformCost:
    """One policy round's view of KV transformation: whether a group's members may adopt or scatter, and what an
    adoption would stall the group. ``dp_kv``: KV of the DP requests the round has sent each engine so far (the
    caller's dict, read live)."""

    def __init__(
        self, cfg: PolicyConfig, cost: CostModel, live: Mapping[int, EngineView], dp_kv: Mapping[int, int]
    ) -> None:
        self.cfg, self.cost, self.live, self.dp_kv = cfg, cost, live, dp_kv

    def possible(self, members: Sequence[int]) -> bool:
        """Adopt/scatter only where it is on and every member's heartbeat says it applies them."""
        return self.cfg.on("kv-transform") and all(
            m in self.live and self.live[m].kv_transform for m in members
        )

    def used_kv(self, m: int) -> int:
        """KV tokens engine ``m``'s DP requests hold (heartbeat), those this round sends it included."""
        e = self.live[m]
        return max(0, e.max_total_tokens - e.free_kv_tokens) + self.dp_kv[m]

    def adopt_ms(self, members: Sequence[int]) -> float:
        """Estimated stall of an adoption: every member's DP KV moves (d-1)/d of its head slices."""
        return self.cost.transform_ms(adopt_moves([self.used_kv(m) for m in members]))

    def may_adopt(self, members: Sequence[int]) -> bool:
        """Adoption beats draining or pausing the members' DP work when its stall is at most :data:`ADOPT_MAX_MS`
        (a few decode steps); a larger one (members full of KV) drains or pauses as without it. (Whether each member
        has room for the slices it would receive is the workers' check: where one has not, they bind hard and
        report the paused work, which the round releases after ``max_defer_s``.)"""
        return self.possible(members) and self.adopt_ms(members) <= ADOPT_MAX_MS
