"""What this engine's steps cost, by mode (DP, or a group's TP or SP step), width and size: the samples the
router fits its cost model to (``router.cost_fit``), carried in every heartbeat as a few cumulative buckets.

A step is timed from the start of its ``ModelRunner.forward`` to the start of the next one, so it includes what the
scheduler does around the forward (a group's plan broadcast and relay, sampling, the next batch's preparation) and,
on a GPU, the device's time without a synchronize; a step after which the engine went idle (the next forward began
more than :data:`IDLE_S` after this one ended) is not counted. On a GPU only every ``cuda_every``-th step is
sampled."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from flying.messages import StepCost

IDLE_S = 0.05  # seconds between a forward's end and the next one's start beyond which the engine was idle


def bucket(tokens: int) -> int:
    """The power-of-two bucket of a step's batched tokens (1, 2-3, 4-7, ...)."""
    return max(tokens, 1).bit_length()


class StepCosts:
    """Cumulative (steps, tokens, milliseconds) per (mode, width, bucket); :meth:`samples` for the heartbeat."""

    def __init__(self, device: str, cuda_every: int = 16) -> None:
        self.device = device
        self.every = cuda_every if device == "cuda" else 1
        self._seen = 0
        # the last sampled step, not yet ended
        self._pending: tuple[str, int, int, float, float] | None = None
        self._sums: dict[tuple[str, int, int], list[float]] = {}

    def timed(self, mode: str, width: int, tokens: int, forward: Callable[[], Any]) -> Any:
        """Run ``forward``; record the step before it if this one followed it at once, and remember this one if it
        is sampled."""
        now = time.perf_counter()
        if self._pending is not None:
            m, w, t, start, end = self._pending
            if now - end <= IDLE_S:
                self.record(m, w, t, (now - start) * 1000)
            self._pending = None
        self._seen += 1
        out = forward()
        if self._seen % self.every == 0:
            self._pending = (mode, width, tokens, now, time.perf_counter())
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
