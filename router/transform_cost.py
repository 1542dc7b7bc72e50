"""What a KV transformation costs, for the policy (whether adopting beats waiting) and the simulator.

KV transformation (``Bind.adopt``, ``Release.scatter``): a request's KV moves between the members of one
group by head slices. At width ``d`` a member keeps its own ``1/d`` of each of its requests' heads in place and sends
the other ``(d-1)/d`` (adoption); at a scatter a request's owner receives the ``(d-1)/d`` the other members hold. One
transformation costs :func:`kv_transform_ms`: a fixed part plus the bytes of the busiest member's moved head slices
(the larger of what it sends and what it receives) over the link bandwidth, paid as a stall of the group (adopt) or
of the members' first DP step (scatter), since the workers exchange at a step boundary. Calibration:

- bytes: 160 KB per token (Llama-3-70B, FP8 KV: :data:`flying.cost_model.H200_LLAMA70B`), a head slice is ``1/d`` of it;
- bandwidth: H200 NVLink 4 is 450 GB/s per direction per GPU; we take 360 GB/s (80 %, what NCCL's all-to-all and
  send/recv reach on NVLink-4 class nodes) per member, in each direction at once;
- fixed: 4 ms, the upper end of Gyges' (seed 002, section 6.2.1) "basic" KV transformation, 3.15-4 ms for
  4 x TP1 -> TP4 at 90 % KV utilization. That figure cannot be the whole KV crossing the links (on their H20s,
  90 % of a Qwen2.5-32B engine's KV is about 18 GB; its three quarters need more than 15 ms at 900 GB/s, and their
  own un-pipelined move takes 522 ms, section 3): it is what their layer-by-layer exchange adds to the step it
  overlaps. So we charge it as the fixed part (metadata exchange, allocator work, the handshake) and add the bytes
  term in full; ``transform_overlap`` hides a share of the bytes term (Gyges: 86 % less with overlap) for what-ifs.
  Gyges' 4 x TP1 -> TP4 at 90 % on this model: 315 K tokens x 160 KB x 3/4 = 37.8 GB per member, 105 ms + 4 ms
  (19 ms with their overlap); the paper workload's light-load adoptions move a few GB (5-20 ms).
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
