"""The router's Prometheus metrics (``flying-router --metrics-port``), all prefixed ``flying_``.

Two kinds:
- events the router sees as it applies its decisions (:meth:`RouterMetrics.observe`): dispatches, binds and
  releases by reason, mode and outcome, how long switches take as the router sees them (command -> every member
  reports the group; release -> every member back in DP), policy rounds;
- the cluster's state, read from Redis when Prometheus scrapes (:class:`ClusterCollector`): queue depth and oldest
  wait by priority, the request counters of ``flying:stats``, each engine's mode, width, load, prefix-cache
  tokens and hit ratio (since the engine started) and the switch timings its heartbeat carries, groups by width, reason and state, the regime, whether this router leads.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from redis.backoff import NoBackoff
from redis.retry import Retry

from flying import control, redis_conn
from flying.breaker import decode_all
from flying.keys import Keys
from flying.messages import Group, RouterState, decode
from flying.queue import text
from router.cost_fit import CostFit
from router.decision import BindMode, Decision

ADMITTED_PREFIX = "admitted_"  # flying:stats's per-priority admission counters: admitted_high, ...
SWITCH_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


def bind_mode(g: Group) -> str:
    return BindMode.of(g).value


class RouterMetrics:
    """Counters and histograms of what the router does, in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.dispatched = Counter(
            "flying_router_dispatched",
            "Requests assigned by the router (the admission fast path is in "
            'flying_requests_total{event="fast"})',
            ["target"],
            registry=r,
        )
        self.dp_rules = Counter(
            "flying_router_dp_dispatch",
            "DP dispatches decided by rule: prefix (followed the prompt's prefix to "
            "the engine caching it), least-loaded (--dispatch least-loaded), no-chain (prompt under one block), "
            "no-match (no engine holds enough of it), imbalanced (loads out of balance)",
            ["rule"],
            registry=r,
        )
        self.binds = Counter(
            "flying_router_binds",
            "TP group binds: issued by the router, bound (every member reports it), or "
            "rolled back before they bound",
            ["reason", "mode", "outcome"],
            registry=r,
        )
        self.releases = Counter(
            "flying_router_releases",
            "TP group releases: issued, and done (every member back in DP)",
            ["reason", "mode", "outcome"],
            registry=r,
        )
        self.switch = Histogram(
            "flying_router_switch_seconds",
            "Bind: record written -> every member reports the group; release: "
            "release issued -> every member back in DP (as the router sees it, heartbeats included)",
            ["kind"],
            buckets=SWITCH_BUCKETS,
            registry=r,
        )
        self.rounds = Counter("flying_router_rounds", "Policy rounds run while leading", registry=r)
        self.round_errors = Counter(
            "flying_router_round_errors",
            "Rounds that raised an unexpected error (logged; the router goes on)",
            registry=r,
        )
        self.stalled = Gauge(
            "flying_router_stalled",
            "1 while requests wait or run and none has been assigned, finished or "
            "re-queued for --stall-s (router.watchdog)",
            registry=r,
        )
        self.stalls = Counter("flying_router_stalls", "Stalls the watchdog saw begin", registry=r)
        self.fit_error = Gauge(
            "flying_router_cost_fit_error",
            "Relative RMS residual of the cost model's fitted line for one kind of step",
            ["mode", "width"],
            registry=r,
        )
        self.fit_steps = Gauge(
            "flying_router_cost_fit_steps",
            "Steps the fitted line was fitted to",
            ["mode", "width"],
            registry=r,
        )
        self._rolled_back: set[int] = set()

    def observe_fit(self, fit: CostFit) -> None:
        """A new fit of the cost model (router.cost_fit): each line's error and samples."""
        for c in fit.curves:
            self.fit_error.labels(c.mode, str(c.width)).set(c.error)
            self.fit_steps.labels(c.mode, str(c.width)).set(c.steps)

    def observe(self, before: list[Group], d: Decision, assigned: int, now: float | None = None) -> None:
        """One applied round: ``before`` is the group records the round started from, ``d`` its decision."""
        now = time.time() if now is None else now
        self.rounds.inc()
        to_group = sum(1 for x in d.dispatches if x.epoch)
        if assigned:
            self.dispatched.labels("group").inc(min(to_group, assigned))
            self.dispatched.labels("dp").inc(max(0, assigned - to_group))
        for x in d.dispatches:
            if x.rule is not None:
                self.dp_rules.labels(x.rule).inc()
        for g in d.binds:
            self.binds.labels(g.reason, bind_mode(g), "issued").inc()
        prev = {g.epoch: g for g in before}
        for epoch, g in d.put.items():
            old = prev.get(epoch)
            if old is None or old.state == g.state:
                continue
            if old.state == "binding" and g.state == "bound":
                self.binds.labels(g.reason, bind_mode(g), "bound").inc()
                self.switch.labels("bind").observe(max(0.0, now - old.since))
            elif g.state == "releasing":
                if old.state == "binding":
                    self.binds.labels(g.reason, bind_mode(g), "rolled_back").inc()
                    self._rolled_back.add(epoch)  # its release undoes a bind that never formed: not a switch
                self.releases.labels(g.reason, g.released, "issued").inc()
            elif (
                old.state == "releasing" and g.state == "parked"
            ):  # released: its parked requests keep the record
                self.releases.labels(old.reason, old.released, "done").inc()
                self.switch.labels("release").observe(max(0.0, now - old.since))
        for epoch in d.drop:
            old = prev.get(epoch)
            if old is not None and old.state == "releasing":
                self.releases.labels(old.reason, old.released, "done").inc()
                if epoch in self._rolled_back:
                    self._rolled_back.discard(epoch)
                else:
                    self.switch.labels("release").observe(max(0.0, now - old.since))


def scrape_client(url: str) -> redis.Redis:
    """The collector's client: one try within 1 s while Redis is away, so a scrape (and a probe that scrapes)
    keeps its timeout; behind Sentinel it waits out a failover (about 5.5 s), as every client does there."""
    return redis_conn.sync_client(
        url, socket_timeout=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
    )


class ClusterCollector(Collector):
    """The cluster's state from Redis at scrape time (a synchronous client; Prometheus scrapes in a thread).

    Only the router holding the lease exports it (a standby's copy would double every ``sum``); every router
    exports ``flying_router_leader`` and ``flying_router_redis_up``. With Redis unreachable the scrape still
    answers: the router's own series, ``flying_router_redis_up`` 0 and the leadership this router last knew."""

    def __init__(
        self, r: redis.Redis, keys: Keys, router_id: str, leading: Callable[[], bool] = lambda: False
    ) -> None:
        self.r, self.keys, self.router_id, self.leading = r, keys, router_id, leading
        self.group_labels: set[tuple[str, str, str]] = set()  # flying_groups' series exported so far (then 0)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        up = GaugeMetricFamily("flying_router_redis_up", "1 while this router could read Redis at the scrape")
        leader = GaugeMetricFamily("flying_router_leader", "1 while this router holds the lease")
        try:
            lease = self.r.get(self.keys.router_lease)
            leads = lease is not None and text(lease) == self.router_id
            cluster = list(self._cluster()) if leads else []  # read whole first: no half-written scrape
        except redis.RedisError:
            up.add_metric([], 0.0)
            leader.add_metric([], 1.0 if self.leading() else 0.0)
            yield from (up, leader)
            return
        up.add_metric([], 1.0)
        leader.add_metric([], 1.0 if leads else 0.0)
        yield from (up, leader, *cluster)

    def _cluster(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        r, k = self.r, self.keys
        depth = GaugeMetricFamily(
            "flying_queue_depth", "Requests waiting in the global queue", labels=["priority"]
        )
        oldest = GaugeMetricFamily(
            "flying_queue_oldest_wait_seconds",
            "How long the oldest waiting request has waited",
            labels=["priority"],
        )
        for cls, (n, wait) in control.queue_depths(r, k).items():
            depth.add_metric([cls], n)
            oldest.add_metric([cls], wait)
        yield depth
        yield oldest
        stats = CounterMetricFamily(
            "flying_requests",
            "Request events counted in flying:stats (all gateways and routers): admitted, assigned (fast: those "
            "assigned by the admission itself, a part of assigned), requeued, completed, failed, cancelled",
            labels=["event"],
        )
        by_priority = CounterMetricFamily(
            "flying_requests_admitted_by_priority",
            "Requests admitted, by priority class",
            labels=["priority"],
        )
        for event, n in sorted((text(a), int(b)) for a, b in r.hgetall(k.stats).items()):
            if event.startswith(ADMITTED_PREFIX):
                by_priority.add_metric([event.removeprefix(ADMITTED_PREFIX)], n)
            else:
                stats.add_metric([event], n)
        yield stats
        yield by_priority
        yield from self._engines()
        yield from self._groups()
        yield self._breakers()

    def _engines(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        beats = control.status(self.r, self.keys)
        mode = GaugeMetricFamily(
            "flying_engine_mode",
            "1 for the engine's mode: dp, binding (a bind read, not applied), tp",
            labels=["engine", "mode"],
        )
        per_engine = {
            "width": ("flying_engine_width", "Width of the engine's TP group (1: DP)"),
            "running": ("flying_engine_running", "Requests running on the engine"),
            "waiting": ("flying_engine_waiting", "Requests waiting in the engine's own queue"),
            "free_kv_tokens": ("flying_engine_free_kv_tokens", "KV cache tokens free (evictable included)"),
        }
        seconds = {  # the heartbeat's milliseconds, in Prometheus's base unit
            "bind_ms": (
                "flying_engine_last_bind_seconds",
                "The engine's last bind, command at a step boundary -> ready",
            ),
            "release_ms": (
                "flying_engine_last_release_seconds",
                "The engine's last release, command -> DP layout back",
            ),
            "transform_ms": (
                "flying_engine_last_kv_transform_seconds",
                "The engine's last KV transformation",
            ),
        }
        families = {
            f: GaugeMetricFamily(name, doc, labels=["engine"]) for f, (name, doc) in per_engine.items()
        }
        timings = {f: GaugeMetricFamily(name, doc, labels=["engine"]) for f, (name, doc) in seconds.items()}
        rebuilds = CounterMetricFamily(
            "flying_engine_comm_rebuilds",
            "Pooled communicator groups rebuilt after a restart",
            labels=["engine"],
        )
        prompt = CounterMetricFamily(
            "flying_engine_prompt_tokens",
            "Prompt tokens of the requests the engine finished, since it started",
            labels=["engine"],
        )
        cached = CounterMetricFamily(
            "flying_engine_cached_tokens",
            "Of those prompt tokens, the ones found in the engine's prefix cache (SGLang's cached_tokens)",
            labels=["engine"],
        )
        ratio = GaugeMetricFamily(
            "flying_engine_prefix_cache_hit_ratio",
            "cached / prompt tokens of the requests the engine finished since it started (absent until one has)",
            labels=["engine"],
        )
        steps = CounterMetricFamily(
            "flying_group_steps",
            "Forwards the engine ran as a bound group's member, by step mode: sp (sequence-parallel prefill) or tp",
            labels=["engine", "mode"],
        )
        parked = GaugeMetricFamily(
            "flying_engine_parked_epochs",
            "Parked groups whose requests' KV head slices the engine holds (released for a burst, resumed when calm)",
            labels=["engine"],
        )
        for e, hb in beats.items():
            parked.add_metric([str(e)], len(hb.parked))
            steps.add_metric([str(e), "sp"], hb.steps_sp)
            steps.add_metric([str(e), "tp"], hb.steps_tp)
            current = "tp" if hb.mode == "tp" else "binding" if hb.pending else "dp"
            for m in ("dp", "binding", "tp"):
                mode.add_metric([str(e), m], 1.0 if m == current else 0.0)
            for f, fam in families.items():
                fam.add_metric([str(e)], float(getattr(hb, f)))
            for f, fam in timings.items():
                fam.add_metric([str(e)], getattr(hb, f) / 1000)
            rebuilds.add_metric([str(e)], hb.comm_rebuilds)
            prompt.add_metric([str(e)], hb.prompt_tokens)
            cached.add_metric([str(e)], hb.cached_tokens)
            if hb.cache_hit_rate is not None:
                ratio.add_metric([str(e)], hb.cache_hit_rate)
        yield mode
        yield from families.values()
        yield from timings.values()
        yield rebuilds
        yield from (prompt, cached, ratio, steps, parked)

    def _breakers(self) -> GaugeMetricFamily:
        """Each engine's circuit breaker (flying.breaker): 0 closed, 1 half-open (probed), 2 open; engines
        whose breaker never opened are absent (closed)."""
        fam = GaugeMetricFamily(
            "flying_engine_breaker_state",
            "The engine's circuit breaker: 0 closed (dispatched to), 1 half-open (its health probe in flight), "
            "2 open (left out after repeated failures)",
            labels=["engine"],
        )
        for e, b in sorted(decode_all(self.r.hgetall(self.keys.breakers)).items()):
            fam.add_metric([str(e)], float(b.state.level))
        return fam

    def _groups(self) -> Iterator[GaugeMetricFamily]:
        fam = GaugeMetricFamily(
            "flying_groups", "TP groups by width, reason and state", labels=["width", "reason", "state"]
        )
        counts: collections.Counter[tuple[str, str, str]] = collections.Counter(
            (str(g.width), g.reason, g.state) for g in control.groups(self.r, self.keys)
        )
        # a series once there reads 0 when its groups are gone, not no data
        self.group_labels |= counts.keys()
        for labels in sorted(self.group_labels):
            fam.add_metric(list(labels), counts.get(labels, 0))
        yield fam
        raw = self.r.get(self.keys.router_state)
        state = decode(raw, RouterState) if raw else RouterState()
        regime = GaugeMetricFamily(
            "flying_router_regime", "1 for the load regime: busy or light", labels=["regime"]
        )
        regime.add_metric(["busy"], 1.0 if state.busy else 0.0)
        regime.add_metric(["light"], 0.0 if state.busy else 1.0)
        yield regime
