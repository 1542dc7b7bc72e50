"""Backpressure: how many requests the queue may hold for a new request of each priority, by count and by the
wait the recent service rate predicts, and how long a refused client should wait before retrying.

Low priority is shed first, high last: each class may fill only its share of the queue (``SHARE``), and waits only
its share of ``max_wait_s`` behind the requests ahead of it. The service rate is the router's assignment rate,
read from the shared ``assigned`` counter over a sliding window, so every gateway sees the deployment's rate.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from flying.messages import Priority

SHARE: dict[str, float] = {"high": 1.0, "normal": 0.85, "low": 0.6}


@dataclass(frozen=True)
class Limits:
    """For one admission: refuse when the queue holds ``max_depth`` requests, or ``max_ahead`` of this
    priority or higher (0: no bound by wait)."""

    max_depth: int
    max_ahead: int


class ServiceRate:
    """Requests served per second over the last ``window_s``, from samples of a monotonic counter."""

    def __init__(self, window_s: float = 10.0, min_span_s: float = 2.0) -> None:
        self.window_s = window_s
        self.min_span_s = min_span_s
        self.samples: deque[tuple[float, int]] = deque()

    def sample(self, now: float, count: int) -> None:
        if self.samples and count < self.samples[-1][1]:  # the counter was reset (Redis lost it): start over
            self.samples.clear()
        self.samples.append((now, count))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()

    def per_s(self) -> float | None:
        """The rate, or None while the window holds too little history to tell."""
        if len(self.samples) < 2:
            return None
        (t0, c0), (t1, c1) = self.samples[0], self.samples[-1]
        if t1 - t0 < self.min_span_s:
            return None
        return (c1 - c0) / (t1 - t0)


class Backpressure:
    def __init__(self, max_queue: int, max_wait_s: float, rate: ServiceRate | None = None) -> None:
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s
        self.rate = rate or ServiceRate()

    def limits(self, priority: Priority) -> Limits:
        share = SHARE[priority]
        depth = max(1, int(self.max_queue * share))
        rate = self.rate.per_s()
        if not rate or self.max_wait_s <= 0:  # no measured service yet (cold start or stalled): count only
            return Limits(depth, 0)
        return Limits(depth, max(1, int(rate * self.max_wait_s * share)))

    def retry_after_s(self, excess: int) -> int:
        """Seconds until ``excess`` requests have been served at the recent rate (1..60; 1 when unknown)."""
        rate = self.rate.per_s()
        if not rate:
            return 1
        return min(60, max(1, math.ceil(excess / rate)))
