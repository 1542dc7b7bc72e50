"""Backpressure: how many requests the queue may hold for a new request of each priority, by count and by the
wait the measured service capacity predicts, and how long a refused client should wait before retrying.

Low priority is shed first, high last: each class may fill only its share of the queue (``SHARE``), and waits only
its share of ``max_wait_s`` behind the requests ahead of it. The capacity is the router's assignment rate while
requests were waiting, read from the shared ``assigned`` counter over a sliding window, so every gateway sees the
deployment's; until it is known (cold start, light load) only the count bounds the queue.
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
    """The deployment's service capacity: requests dispatched per second while the queue was backlogged, over the
    last ``window_s``, from samples of the monotonic ``assigned`` counter and the queue depth.

    Only intervals that began and ended with requests waiting count: at light load the dispatch rate is the
    arrival rate, not what the engines can serve, and a wait predicted from it would refuse a burst that the
    engines take at once. With less than ``min_span_s`` of backlog in the window the capacity is unknown."""

    def __init__(self, window_s: float = 10.0, min_span_s: float = 2.0) -> None:
        self.window_s = window_s
        self.min_span_s = min_span_s
        self.samples: deque[tuple[float, int, bool]] = deque()

    def sample(self, now: float, count: int, backlogged: bool = True) -> None:
        if self.samples and count < self.samples[-1][1]:  # the counter was reset (Redis lost it): start over
            self.samples.clear()
        self.samples.append((now, count, backlogged))
        while self.samples and now - self.samples[0][0] > self.window_s:
            self.samples.popleft()

    def per_s(self) -> float | None:
        """The capacity, or None while the window holds too little backlogged history to tell."""
        span = served = 0.0
        for (t0, c0, b0), (t1, c1, b1) in zip(self.samples, list(self.samples)[1:]):
            if b0 and b1:
                span, served = span + (t1 - t0), served + (c1 - c0)
        if span < self.min_span_s:
            return None
        return served / span


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
