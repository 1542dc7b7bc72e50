"""The gateway's Prometheus metrics (``GET /metrics``), all prefixed ``flying_gateway_``. Times are observed at the
gateway: queue time from admission to the router's assignment, TTFT from the request's arrival to its first event
(a stream) or its whole answer.

With several gateway processes on one port (``flying-gateway --workers N``), each writes its values to the shared
Prometheus multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``, set by ``gateway.http.workers``) and
:meth:`GatewayMetrics.exposition` reads all of them: a scrape that reaches any worker counts every worker's
requests, and ``flying_gateway_requests_in_flight`` is the sum over the live ones."""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own variable: the workers' shared directory
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "flying_gateway_requests",
            "Completion requests answered, by route, HTTP status and priority "
            "(a stream counts with the status it started with)",
            ["route", "status", "priority"],
            registry=r,
        )
        self.in_flight = Gauge(
            "flying_gateway_requests_in_flight",
            "HTTP requests in progress (streams to their last byte)",
            registry=r,
            multiprocess_mode="livesum",  # several workers: the sum over the live ones
        )
        self.queue_time = Histogram(
            "flying_gateway_queue_time_seconds",
            "Admission to the global queue -> the router's assignment",
            ["priority"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "flying_gateway_ttft_seconds",
            "Request received -> its first event (streams) or whole answer",
            ["priority"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.redispatched = Counter(
            "flying_gateway_redispatched",
            "Requests sent back to the queue because their engine failed or gave "
            "up: before its first event (re-dispatched) or mid-stream (resumed elsewhere)",
            ["cause"],
            registry=r,
        )
        self.poison = Counter(
            "flying_poison_requests",
            "Requests ended because they crashed an engine (a 500 request_crashed_engines): "
            "named by the engine's crash report, or the second engine to die holding them",
            registry=r,
        )
        self.early = Counter(
            "flying_gateway_early_dispatch",
            "Requests sent to their engine while their admission ran (sent), and "
            "those the admission declined or refused, taken back from the engine (declined)",
            ["outcome"],
            registry=r,
        )
        self.assignments = Counter(
            "flying_gateway_assignments",
            "Assignments of this gateway's requests, by how they came: admission "
            "(assigned by the admission itself, the queue empty), message (the router's, over the subscription) or "
            "reconciliation (a missed message, found in Redis)",
            ["by"],
            registry=r,
        )
        self.subscription_lost = Counter(
            "flying_gateway_assignment_subscription_lost",
            "Times the assignment subscription was found lost "
            "without an error (its listener ended, or Redis counted no subscriber) and made again",
            registry=r,
        )
        self.engine_failures = Counter(
            "flying_gateway_engine_failures",
            "Requests that failed on their engine (refused, reset, timed out, "
            "5xx), by engine: what its circuit breaker counts",
            ["engine"],
            registry=r,
        )
        self.rejected = Counter(
            "flying_gateway_rejected",
            "Requests refused, by HTTP status and error code (429 backpressure, 400 "
            "invalid, 401 no or wrong API key, ...)",
            ["status", "reason"],
            registry=r,
        )
        self.refused = Counter(
            "flying_gateway_refused",
            "Requests refused at admission (429), by priority and why: depth (the "
            "class's share of the queue is full) or wait (the predicted wait exceeds the class's budget)",
            ["priority", "reason"],
            registry=r,
        )
        self.expired = Counter(
            "flying_gateway_wait_budget_expired",
            "Admitted requests that waited their class's whole wait budget "
            "without an engine and ended with 504",
            ["priority"],
            registry=r,
        )
        self.tenant_requests = Counter(
            "flying_gateway_tenant_requests",
            "Requests admitted to the queue, by tenant (API key)",
            ["tenant"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "flying_gateway_tenant_tokens",
            "Tokens admitted (prompt + max_tokens), by tenant",
            ["tenant"],
            registry=r,
        )
        self.tenant_rejected = Counter(
            "flying_gateway_tenant_rejected",
            "A tenant's requests refused by its own limits: requests_per_s, "
            "tokens_per_min, max_concurrent (429) or max_priority (403)",
            ["tenant", "reason"],
            registry=r,
        )
        self.tenant_lowered = Counter(
            "flying_gateway_tenant_priority_lowered",
            "Requests that asked for a priority above their tenant's highest and run at that one instead",
            ["tenant", "requested", "granted"],
            registry=r,
        )
        self._children: dict[tuple, Any] = {}

    def exposition(self) -> bytes:
        """The metrics in Prometheus's text format: this process's, or every worker's with several."""
        if path := os.environ.get(MULTIPROC_ENV):
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path)
            return generate_latest(registry)
        return generate_latest(self.registry)

    def child(self, metric: Counter | Histogram, *labels: str):
        """``metric.labels(*labels)``, looked up once per label set (``labels`` takes a lock and builds a key on
        every call; this runs a few times per request)."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found
