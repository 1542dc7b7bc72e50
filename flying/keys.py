"""Every Redis key flying-serving uses, in one place (documented in docs/architecture.md and docs/redis.md)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix, so several deployments (or tests) can share a Redis."""

    prefix: str = "flying"

    @property
    def queue(self) -> str:
        """ZSET of waiting request ids; score = priority class * 1e12 + arrival sequence."""
        return f"{self.prefix}:queue"

    @property
    def seq(self) -> str:
        """STRING counter giving each admitted request its arrival sequence number."""
        return f"{self.prefix}:seq"

    @property
    def wake(self) -> str:
        """LIST the router blocks on; anyone who changes the queue or frees capacity pushes one token."""
        return f"{self.prefix}:router:wake"

    @property
    def router_lease(self) -> str:
        """STRING (PX lease) naming the one router allowed to dispatch."""
        return f"{self.prefix}:router:lease"

    @property
    def router_state(self) -> str:
        """STRING (JSON RouterState): each node's planned load width, the measured arrival rates and token mix."""
        return f"{self.prefix}:router:state"

    @property
    def cost_model(self) -> str:
        """STRING (JSON router.cost_fit.CostFit): the cost model the router fitted to the engines' step costs."""
        return f"{self.prefix}:cost_model"

    @property
    def fast_path(self) -> str:
        """STRING (JSON list of FastTarget, PX 1000, rewritten every round): where the admission script sends a
        short request at once while the queue is empty; gone (no fast path) when no router runs."""
        return f"{self.prefix}:router:fast"

    @property
    def decisions(self) -> str:
        """STREAM (capped at about 1,000 entries) of the router's decision log: field ``event``, a
        ``DecisionEvent`` JSON per bind, release, regime change and distrust, in the order the router applied them."""
        return f"{self.prefix}:router:decisions"

    @property
    def groups(self) -> str:
        """HASH epoch -> JSON Group: every TP group the router (or flyctl) bound and has not seen released."""
        return f"{self.prefix}:groups"

    @property
    def workers(self) -> str:
        """SET of engine indices that have ever sent a heartbeat."""
        return f"{self.prefix}:workers"

    @property
    def stats(self) -> str:
        """HASH of monotonic counters: admitted (and per priority: admitted_high, admitted_normal, admitted_low; their
        tokens: admitted_prompt_tokens, admitted_output_tokens, the router planner's token mix),
        assigned, requeued, completed, failed, cancelled."""
        return f"{self.prefix}:stats"

    @property
    def vclock(self) -> str:
        """HASH priority class -> the queue position of the last request assigned in it: the virtual clock from
        which a tenant's new request starts (fair sharing inside a class)."""
        return f"{self.prefix}:vclock"

    @property
    def tenants(self) -> str:
        """SET of the tenant names (one per API key, or as the key file names them) that have been admitted a request."""
        return f"{self.prefix}:tenants"

    def tenant(self, name: str) -> str:
        """HASH of one tenant's monotonic counters: requests and tokens admitted, refused_requests_per_s,
        refused_tokens_per_min; and ``finish:<class>``, where its next request in that class starts at the latest
        (fair sharing)."""
        return f"{self.prefix}:tenant:{name}"

    def tenant_bucket(self, name: str, kind: str) -> str:
        """HASH (t: tokens left, ts: when; PEXPIRE once full again): one tenant's ``requests`` or ``tokens``
        bucket, shared by every gateway."""
        return f"{self.prefix}:tenant:{name}:{kind}"

    @property
    def breakers(self) -> str:
        """HASH engine -> JSON Breaker (flying.breaker): each engine's circuit breaker, closed, open or half-open;
        written by gateways (failures) and the router (probes)."""
        return f"{self.prefix}:breakers"

    @property
    def suspects(self) -> str:
        """SET of request ids an engine died holding (``suspect`` in their records): the router sends each to an
        engine holding no other, so a request that kills a second engine is known (gateway: 500
        ``request_crashed_engines``); the router drops ids whose request ended."""
        return f"{self.prefix}:suspects"

    def crash(self, engine: int) -> str:
        """STRING (JSON CrashReport, EX ``flying.crashes.REPORT_TTL_S``): what engine's scheduler was running when it
        last raised, written before it went down; the gateways end a request its crashing batch held alone (500
        ``request_crashed_engines``) instead of re-dispatching it."""
        return f"{self.prefix}:crash:{engine}"

    def tenant_inflight(self, name: str) -> str:
        """HASH gateway id -> one tenant's requests in progress on that gateway: its max_concurrent, held across
        gateways (a gateway whose liveness key is gone no longer counts)."""
        return f"{self.prefix}:tenant:{name}:inflight"

    def request(self, rid: str) -> str:
        """HASH with one request's metadata and state (expires some time after it finishes)."""
        return f"{self.prefix}:req:{rid}"

    def worker(self, engine: int) -> str:
        """STRING: engine's latest heartbeat (JSON), expiring 3 s (PX 3000) after the last beat."""
        return f"{self.prefix}:worker:{engine}"

    def ready(self, engine: int) -> str:
        """STRING: launch id of the engine's server once its HTTP endpoint answers (set by flying-worker)."""
        return f"{self.prefix}:ready:{engine}"

    def inflight(self, engine: int) -> str:
        """SET of request ids assigned to engine and not yet finished."""
        return f"{self.prefix}:inflight:{engine}"

    @property
    def inflight_prefix(self) -> str:
        """``inflight(i)`` is this plus ``i`` (for scripts that pick the engine themselves)."""
        return f"{self.prefix}:inflight:"

    def gateway(self, gateway_id: str) -> str:
        """STRING (PX 3 s, refreshed every 0.25 s): a live gateway. The router ends the requests of a gateway
        whose key has been gone for a few seconds (they have no client any more) and aborts them on the engines."""
        return f"{self.prefix}:gateway:{gateway_id}"

    def gateway_channel(self, gateway_id: str) -> str:
        """Pub/sub channel on which the router tells one gateway where its requests go."""
        return f"{self.prefix}:gw:{gateway_id}"

    @property
    def epoch(self) -> str:
        """INCR counter: the last bind epoch handed out (epochs are unique and increasing)."""
        return f"{self.prefix}:epoch"

    def commands(self, engine: int) -> str:
        """STREAM of control commands (bind/release) for one engine."""
        return f"{self.prefix}:cmd:{engine}"
