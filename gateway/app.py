"""The gateway's application (Starlette): its routes (gateway.routes), error mapping (gateway.api.errors),
middleware and lifespan, assembled."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging

import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.routing import Route

from flying import redis_conn, taskdump
from gateway import routes as endpoints
from gateway.api import errors
from gateway.api import models as model_cards
from gateway.api.errors import APIError
from gateway.auth import InvalidAPIKey, RequireKey
from gateway.config import GatewayConfig
from gateway.drain import CountRequests, Drain
from gateway.http.hot_routes import HotRoutesApp
from gateway.metrics import GatewayMetrics
from gateway.observer import NOTHING
from gateway.request_log import RequestLog
from gateway.service import Gateway
from gateway.tenants import Tenants, TenantSlots
from gateway.tracing import TraceRequests, Tracing

log = logging.getLogger("flying.gateway")


def create_app(
    config: GatewayConfig,
    count_tokens=None,
    drain: Drain | None = None,
    tenants: Tenants | None = None,
    tracing: Tracing | None = None,
) -> Starlette:
    """The app; ``drain`` (made here when not given) counts requests in progress and holds the drain state;
    ``tenants`` are the API keys (default: ``config.api_keys``, plain); ``tracing`` its spans (default: to
    ``config.otlp_endpoint``, none without one)."""
    drain = drain or Drain()
    tracing = tracing or Tracing.from_config(config.otlp_endpoint, config.otel_service_name)
    tenants = tenants if tenants is not None else Tenants.of(config.api_keys)
    meters = GatewayMetrics()
    meters.in_flight.set_function(lambda: drain.active)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        counter = count_tokens
        if counter is None:
            from gateway.tokens import PromptCounter

            counter = PromptCounter(config.model_path)
        client = redis_conn.waiting_pool_client(
            config.redis_url, config.redis_max_connections, f"flying-gw-{config.gateway_id}"
        )
        gw = Gateway(config, client, counter, meters, observer=tracing or NOTHING)
        await gw.start()
        tenants.share(TenantSlots(client, gw.keys, config.gateway_id))  # max_concurrent across the gateways
        app.state.gateway = gw
        taskdump.install(asyncio.get_running_loop())
        # The start-up heap (transformers, the tokenizer: ~400K objects) is never garbage; out of the collector's
        # sight, a full collection takes ~1 ms instead of ~100 (a pause every request in flight would wait out).
        gc.collect()
        gc.freeze()
        log.info(
            "gateway %s serving %s on %s:%d (%s)",
            config.gateway_id,
            config.served_model_name,
            config.host,
            config.port,
            f"{len(tenants.book.entries)} API keys" if not tenants.open else "no API keys: open",
        )
        try:
            yield
        finally:
            await gw.stop()
            await client.aclose()
            if tracing is not None:
                tracing.shutdown()

    hot = {
        "/v1/chat/completions": functools.partial(endpoints.completions, kind="chat"),
        "/v1/completions": functools.partial(endpoints.completions, kind="completion"),
        "/v1/responses": functools.partial(endpoints.completions, kind="responses"),
    }
    routes = [
        *(Route(path, endpoint, methods=["POST"]) for path, endpoint in hot.items()),  # (other methods: 405)
        Route("/v1/models", model_cards.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model_cards.model, methods=["GET"]),
        Route("/health", endpoints.health, methods=["GET"]),
        Route("/metrics", endpoints.metrics, methods=["GET"]),
    ]
    handlers = {
        APIError: errors.api_error,
        HTTPException: errors.http_error,
        aioredis.RedisError: errors.redis_error,
        Exception: errors.internal_error,
    }
    app = HotRoutesApp(
        hot=hot,  # past Starlette's router and exception layer (gateway.http.hot_routes)
        routes=routes,
        lifespan=lifespan,
        exception_handlers=handlers,
        middleware=[
            *([Middleware(TraceRequests, tracing=tracing)] if tracing is not None else []),
            Middleware(CountRequests, drain=drain),
            Middleware(RequestLog),
            Middleware(
                RequireKey,
                tenants=tenants,
                protect_metrics=config.metrics_require_key,
                on_reject=lambda: meters.rejected.labels("401", InvalidAPIKey.code).inc(),
                metrics=meters,
            ),
        ],
    )
    # "/v1/models/" is a JSON 404, not a bare redirect (a POST cannot follow one)
    app.router.redirect_slashes = False
    app.state.drain = drain
    app.state.tenants = tenants
    return app
