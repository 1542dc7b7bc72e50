"""Early dispatch: at light load a request goes to its engine while its admission runs, not after it.

With the queue empty, the admission script assigns a request (one of high priority only to a bound group) at once
to a fast-path target the router published (:class:`flying.messages.FastTarget`), so the gateway's path was two round trips in a row: to
Redis, then to the engine. When the gateway's last look at the cluster (:class:`gateway.cluster_view.ClusterView`,
every ``monitor_s``) saw an empty queue and a target with room for the request, it sends the request to that
target first and admits it naming that engine (``RequestQueue.admit(sent_to=...)``); the two round trips overlap.
The script assigns the request there only if that engine is a fast-path target for it at that moment; otherwise it
writes nothing and the gateway takes the early request back (closed and aborted on the engine) and admits it again
under a fresh id, the usual way. A request still enters the queue (its record, its inflight slot, its end) and the
queue keeps its order and priorities: only a request the queue would have assigned at once goes early.

After a declined or refused one the gateway sends nothing early for ``backoff_s`` (its view was stale: the queue is
filling), so a saturated gateway pays for few requests sent twice: those it sent before the first decline came
back, at most the free room its last look saw. A client's own request id, a request whose class the backlog
already refuses, and a request of a tenant with rate limits never go early."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from flying.messages import Assignment, FastTarget, QueuedRequest
from gateway import tenants
from gateway.background import Background
from gateway.cluster_view import ClusterView
from gateway.http.upstream import StreamResponse, Upstream
from gateway.metrics import GatewayMetrics
from gateway.observer import NOTHING, Observer

FRESH_S = 1.0  # the router's targets key lives 1 s: an observation older than this says nothing of them
ABORT_AGAIN_S = 0.5


@dataclass
class Early:
    """One request sent early: where, and the engine's answer (its response head for a stream) on its way."""

    engine: int
    url: str
    answer: asyncio.Task[StreamResponse]
    rids: list[str]  # the ids it runs under there (what an abort names)

    def went_to(self, a: Assignment) -> bool:
        """Whether ``a`` assigns the request where it was sent."""
        return (a.engine, a.url) == (self.engine, self.url)


@dataclass
class EarlyDispatch:
    """Decides which requests go early and where (the target with the fewest requests held, counting those this
    gateway sent since its last look), and takes back those the admission declined."""

    cluster: ClusterView
    upstream: Upstream
    background: Background
    metrics: GatewayMetrics
    enabled: bool = True
    backoff_s: float = 1.0
    observer: Observer = NOTHING
    sent: int = field(default=0, init=False)  # requests sent early
    declined: int = field(default=0, init=False)  # ... that the admission declined or refused
    _declined_at: float = field(default=-1e9, init=False)
    _since: dict[int, int] = field(default_factory=dict, init=False)  # sent per engine since the last look
    _seen_at: float = field(default=-1e9, init=False)

    def target(self, rec: QueuedRequest) -> FastTarget | None:
        """Where ``rec`` may go early, if anywhere: the queue was empty at the last look (at most ``FRESH_S``
        ago), no early request was declined within ``backoff_s``, and a target fits it as the script checks
        (KV, prefix affinity, a constrained request only to a leader, a high-priority one only to a bound group)."""
        c, now = self.cluster, time.monotonic()
        if not self.enabled or c.depth or now - c.observed_at > FRESH_S:
            return None
        if (tenant := tenants.current.get()) is not None and (tenant.requests_per_s or tenant.tokens_per_min):
            return None  # a tenant over its limit would be refused by the script: not sent first
        if now - self._declined_at < self.backoff_s:
            return None
        if c.observed_at != self._seen_at:
            self._since, self._seen_at = {}, c.observed_at

        def load(t: FastTarget) -> int:
            return c.held.get(t.engine, 0) + self._since.get(t.engine, 0)

        fits = [
            t
            for t in c.fast
            if rec.kv_tokens <= t.max_kv
            and not (t.affinity and rec.prefix)
            and not (t.follower and rec.leader_only)
            and (t.epoch > 0 or rec.priority != "high")
            and load(t) < t.cap
        ]
        return min(fits, key=load, default=None)

    def send(self, rec: QueuedRequest, call: Callable[[str], Awaitable[StreamResponse]]) -> Early | None:
        """Start ``call(url)`` (the engine request) towards ``rec``'s early target, if it has one."""
        t = self.target(rec)
        if t is None:
            return None
        self._since[t.engine] = self._since.get(t.engine, 0) + 1
        self.sent += 1
        self.metrics.child(self.metrics.early, "sent").inc()
        early = Early(t.engine, t.url, asyncio.ensure_future(call(t.url)), rec.engine_rids())
        self.observer.sent_early(rec)
        return early

    async def answer(self, early: Early, rec: QueuedRequest) -> StreamResponse:
        """``early``'s answer (a stream's head) for the request it went early for; if the caller is cancelled
        meanwhile, taken back (a response that arrived is closed, not dropped)."""
        try:
            return await early.answer
        except asyncio.CancelledError:
            self.take_back(early, rec)
            raise

    def take_back(self, early: Early | None, rec: QueuedRequest, declined: bool = False) -> None:
        """``early`` will not be used (declined or refused, or its admission failed): stop it on the engine and
        close its answer, in the background. A decline or refusal (``declined``) starts the back-off."""
        if early is None:
            return
        self.observer.taken_back(rec)
        if declined:
            self.declined += 1
            self.metrics.child(self.metrics.early, "declined").inc()
            self._declined_at = time.monotonic()
        early.answer.cancel()
        self.background.spawn(self._stop(early))

    async def _stop(self, early: Early) -> None:
        """Close its connection, then abort it on the engine, and once more a moment later: an abort that arrives
        before the engine has registered the request (still templating it) does nothing."""
        await asyncio.wait([early.answer])  # (its outcome, whatever it is, without raising it)
        if not early.answer.cancelled() and early.answer.exception() is None:
            with contextlib.suppress(Exception):
                await early.answer.result().aclose()
        await self.upstream.abort(early.url, *early.rids)
        await asyncio.sleep(ABORT_AGAIN_S)
        await self.upstream.abort(early.url, *early.rids)
