"""Backpressure: how many requests the queue may hold for a new request of each priority, by count and by the
wait the measured service capacity predicts against the class's wait budget, and how long a refused client
should wait before retrying.

By count, low priority is shed first, high last: each class may fill only its share of the queue (``SHARE``). By
wait, a request is admitted only while its predicted wait fits its class's budget. The wait is predicted from the
work ahead of it (the requests of its class or higher that wait in the queue, and, for normal and low priority,
the requests the engines hold beyond what they run: an engine is handed up to the router's
``max_inflight_per_worker`` requests, more than it runs at once) and the service left to its class: the capacity
less the arrival rate of the classes above it (they overtake it). The engines' backlog is what their heartbeats
report waiting; once that is any, the larger of it and what their inflight sets hold beyond what they run (a
request handed to an engine is in its set before the engine reports it), plus the requests this gateway handed to
them since it last looked.

The capacity is the rate at which requests are served to their end while the deployment is saturated (requests
wait in the queue or in an engine), read from the shared ``completed`` counter over a sliding window, and the
arrival rates from the shared per-priority ``admitted_<priority>`` counters, so every gateway sees the
deployment's. While requests wait but too little of that backlog has been seen to measure it (the onset of an
overload, or engines that serve nothing), the capacity is taken low: what the window saw served, over the whole
window, and no more, so an overload of engines too slow to measure is refused within ``min_span_s`` of its
onset rather than after the first measurement (engines that keep up measure their capacity in that time).
A gateway that has not yet watched a whole window (just started, or Redis lost the counters) cannot tell engines
that stalled from engines that have not had time to finish anything, so until it has, and with nothing waiting
(light load), only the count bounds the queue.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from flying.messages import PRIORITY_CLASS, Priority
from gateway.cluster_view import Tick

SHARE: dict[str, float] = {"high": 1.0, "normal": 0.85, "low": 0.6}


def queue_room(max_queue: int, priority: str) -> int:
    """How many requests may wait before one of ``priority`` is refused: its share of ``max_queue``."""
    return max(1, int(max_queue * SHARE[priority]))


@dataclass(frozen=True)
class Limits:
    """For one admission: refuse when the queue holds ``max_depth`` requests, or ``max_ahead`` of this
    priority or higher (0: no bound by wait)."""

    max_depth: int
    max_ahead: int
    full: bool = False  # the engines' own backlog alone is past the budget: refused whatever the queue holds


class ServiceRate:
    """The deployment's capacity: requests completed per second over the last ``window_s``, counted only while
    requests waited (at light load completions follow arrivals, not capacity). Unknown with under ``min_span_s``
    of backlog or ``min_served`` completions in the window."""

    def __init__(self, window_s: float = 10.0, min_span_s: float = 0.5, min_served: int = 3) -> None:
        self.window_s = window_s
        self.min_span_s = min_span_s
        self.min_served = min_served
        self.samples: deque[tuple[float, int, bool]] = deque()
        self.since: float | None = None  # the first sample since start-up or the counter's last reset
        self.backlog_since: float | None = None  # the first sample of the current backlog (None: no backlog)

    def sample(self, now: float, count: int, backlogged: bool = True) -> None:
        if self.samples and count < self.samples[-1][1]:  # the counter was reset (Redis lost it): start over
            self.samples.clear()
            self.since = None
        if self.since is None:
            self.since = now
        if not backlogged:
            self.backlog_since = None
        elif self.backlog_since is None:
            self.backlog_since = now
        self.samples.append((now, count, backlogged))
        while self.samples and now - self.samples[0][0] > self.window_s:
            self.samples.popleft()

    def lower_bound_per_s(self) -> float | None:
        """A capacity the deployment surely has, for a backlog too new to measure: all completions in the window
        over the window. None before a whole window was watched or while the backlog is under ``min_span_s``
        old (a burst the engines take at once is not refused on the light load before it)."""
        if self.since is None or self.samples[-1][0] - self.since < self.window_s:
            return None
        if self.backlog_since is None or self.samples[-1][0] - self.backlog_since < self.min_span_s:
            return None
        served = self.samples[-1][1] - self.samples[0][1]
        return max(served, self.min_served) / self.window_s

    def per_s(self) -> float | None:
        """The capacity, or None while the window holds too little backlogged history to tell."""
        span = served = 0.0
        for (t0, c0, b0), (t1, c1, b1) in zip(self.samples, list(self.samples)[1:]):
            if b0 and b1:
                span, served = span + (t1 - t0), served + (c1 - c0)
        if span < self.min_span_s or served < self.min_served:
            return None
        return served / span


class ClassArrivals:
    """Requests admitted per second by priority class over the last ``window_s``, from samples of the shared
    per-priority ``admitted_<priority>`` counters (indexed by ``PRIORITY_CLASS``)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, tuple[int, ...]]] = deque()

    def sample(self, now: float, counts: Sequence[int]) -> None:
        if self.samples and any(c < c0 for c, c0 in zip(counts, self.samples[-1][1])):  # counters reset
            self.samples.clear()
        self.samples.append((now, tuple(counts)))
        while self.samples and now - self.samples[0][0] > self.window_s:
            self.samples.popleft()

    def above(self, priority: Priority) -> float:
        """Requests per second admitted in the classes above ``priority`` (0 while unknown)."""
        if len(self.samples) < 2:
            return 0.0
        (t0, c0), (t1, c1) = self.samples[0], self.samples[-1]
        if t1 <= t0:
            return 0.0
        higher = range(PRIORITY_CLASS[priority])
        return sum(c1[i] - c0[i] for i in higher) / (t1 - t0)


class Backpressure:
    """The admission limits for each priority: ``budgets`` are the classes' queue-wait budgets in seconds (none:
    bound by count only)."""

    def __init__(
        self,
        max_queue: int,
        budgets: Mapping[str, float] | None,
        rate: ServiceRate | None = None,
        arrivals: ClassArrivals | None = None,
    ) -> None:
        self.max_queue = max_queue
        self.budgets = dict(budgets or {})
        self.rate = rate or ServiceRate()
        self.arrivals = arrivals or ClassArrivals()
        self.engine_waiting = 0  # requests the engines hold beyond what they run, as last observed
        self.handed = 0  # requests this gateway handed to the engines (fast path) since then
        self.backlogged = False  # requests waited (queue or engines) at the last observation

    def observe(self, tick: Tick) -> None:
        """One monitor tick's counts: the service rate's and the arrival rates' samples, the engines' backlog."""
        self.engine_waiting = tick.engine_waiting
        if tick.engine_waiting > 0:  # saturated: what is on its way to the engines waits there too
            self.engine_waiting = max(tick.engine_waiting, tick.engine_held - tick.engine_running)
        self.handed = 0
        self.backlogged = tick.depth > 0 or self.engine_waiting > 0
        self.rate.sample(tick.now, tick.completed, backlogged=self.backlogged)
        self.arrivals.sample(tick.now, tick.admitted)

    def handed_to_engine(self) -> None:
        """A request went straight to an engine at admission: part of the engines' backlog until the next
        observation counts it (when they have one already)."""
        if self.engine_waiting > 0:
            self.handed += 1

    def behind(self, priority: Priority) -> int:
        """Requests in the engines beyond what they run that a request of ``priority`` waits behind once
        assigned: all of them for normal and low priority; none for high (SGLang's priority scheduling runs it
        first)."""
        return 0 if priority == "high" else self.engine_waiting + self.handed

    def capacity(self) -> float | None:
        """The measured capacity; while requests wait but it cannot be measured yet, the window's lower bound;
        None with nothing waiting and nothing measured, or before a whole window has been watched."""
        return self.rate.per_s() or self._bound()

    def _bound(self) -> float | None:
        """The window's lower bound on the capacity, while requests wait (None otherwise, or before a whole
        window has been watched)."""
        return self.rate.lower_bound_per_s() if self.backlogged else None

    def free_rate(self, priority: Priority) -> float | None:
        """Requests per second the deployment serves to ``priority`` and the classes above it once those above
        have been served (None while the capacity is unknown; at least a twentieth of the capacity, so a
        prediction stays finite). A capacity not measured yet is only a lower bound (what the window saw
        finish: few, while long streams run), which the classes above may well outrun at light load: it is
        taken whole, not less their arrivals."""
        rate = self.rate.per_s()
        if not rate:
            return self._bound()
        return max(rate - self.arrivals.above(priority), rate / 20)

    def limits(self, priority: Priority) -> Limits:
        depth = queue_room(self.max_queue, priority)
        budget, free = self.budgets.get(priority), self.free_rate(priority)
        if not budget or not free:  # no budget, or no measured service yet (cold start, stalled): count only
            return Limits(depth, 0)
        room = free * budget - self.behind(priority)
        return Limits(depth, max(1, int(room)), full=room < 1)

    def predicted_wait_s(self, priority: Priority, ahead: int) -> float | None:
        """The wait predicted for a request of ``priority`` with ``ahead`` requests of its class or higher waiting
        in the queue, and the engines' backlog it waits behind (None while the capacity is unknown)."""
        free = self.free_rate(priority)
        return None if free is None else (ahead + self.behind(priority) + 1) / free

    def retry_after_s(self, excess: int) -> int:
        """Seconds until ``excess`` requests have been served at the recent rate (1..60; 1 when unknown)."""
        rate = self.capacity()
        if not rate:
            return 1
        return _clip(excess / rate)

    def wait_retry_after_s(self, priority: Priority, ahead: int) -> int:
        """Seconds until the predicted wait of a request of ``priority`` fits its budget again (1..60)."""
        wait, budget = self.predicted_wait_s(priority, ahead), self.budgets.get(priority)
        if wait is None or not budget:
            return 1
        return _clip(wait - budget)


def _clip(seconds: float) -> int:
    return min(60, max(1, math.ceil(seconds)))
