"""What this engine's forwards cost, by mode (DP, or a group's TP or SP step), width and size: the samples the
router fits its cost model to (``router.cost_fit``), carried in every heartbeat as a few cumulative buckets.

A forward is timed around ``ModelRunner.forward``; on a GPU the timer waits for the device, so only every
``cuda_every``-th forward is timed (a synchronize per step would cost the scheduler its overlap)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from flying.messages import StepCost


def bucket(tokens: int) -> int:
    """The power-of-two bucket of a step's batched tokens (1, 2-3, 4-7, ...)."""
    return max(tokens, 1).bit_length()


class StepCosts:
    """Cumulative (steps, tokens, milliseconds) per (mode, width, bucket); :meth:`samples` for the heartbeat."""

    def __init__(self, device: str, cuda_every: int = 16) -> None:
        self.device = device
        self.every = cuda_every if device == "cuda" else 1
        self._seen = 0
        self._sums: dict[tuple[str, int, int], list[float]] = {}

    def timed(self, mode: str, width: int, tokens: int, forward: Callable[[], Any]) -> Any:
        """Run ``forward`` and, if this step is sampled, record what it cost."""
        self._seen += 1
        if self._seen % self.every:
            return forward()
        start = time.perf_counter()
        out = forward()
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
        self.record(mode, width, tokens, (time.perf_counter() - start) * 1000)
        return out

    def record(self, mode: str, width: int, tokens: int, ms: float) -> None:
        s = self._sums.setdefault((mode, width, bucket(tokens)), [0, 0.0, 0.0])
        s[0] += 1
        s[1] += tokens
        s[2] += ms

    def samples(self) -> tuple[StepCost, ...]:
        return tuple(
            StepCost(mode, width, int(n), round(tok / n, 1), round(ms / n, 3))
            for (mode, width, _), (n, tok, ms) in sorted(self._sums.items())
        )
