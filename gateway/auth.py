"""API keys. With keys configured (``FLYING_API_KEYS``, comma-separated, or ``--api-key-file``: one per line, or
tenants with limits in TOML, see :mod:`gateway.tenants`), every ``/v1/*`` request needs
``Authorization: Bearer <key>``; a missing or wrong key gets 401 ``invalid_api_key`` in OpenAI's shape.
``/health`` stays open; ``/metrics`` needs a key only when asked to. Keys are compared as SHA-256 digests in
constant time and never logged (the config holds them with ``repr=False``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.api.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.tenants import Tenant, Tenants, current


class InvalidAPIKey(APIError):
    status = 401
    code = "invalid_api_key"


def read_keys(env_value: str | None, path: str | None = None) -> tuple[str, ...]:
    """The keys from the environment variable's value and the file (blank lines and ``#`` comments skipped)."""
    keys = [k.strip() for k in (env_value or "").split(",")]
    if path:
        keys += [line.split("#", 1)[0].strip() for line in Path(path).read_text().splitlines()]
    return tuple(dict.fromkeys(k for k in keys if k))


class TenantLimitReached(APIError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class RequireKey:
    """ASGI middleware: refuses protected paths without a valid bearer key (no keys: everything is open), and
    serves each ``/v1/*`` request as its key's tenant (:data:`gateway.tenants.current`), within the tenant's
    ``max_concurrent`` across the deployment's gateways (else 429; :class:`gateway.tenants.TenantSlots`). ``tenants`` (reloadable) wins over ``keys`` (plain keys)."""

    def __init__(
        self,
        app: ASGIApp,
        keys: tuple[str, ...] = (),
        protect_metrics: bool = False,
        on_reject: Callable[[], None] = lambda: None,
        tenants: Tenants | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.app, self.on_reject = app, on_reject
        self.tenants = tenants if tenants is not None else Tenants.of(keys)
        self.protect_metrics = protect_metrics
        self.metrics = metrics

    def protected(self, path: str) -> bool:
        return not self.tenants.open and (
            path.startswith("/v1/") or (self.protect_metrics and path == "/metrics")
        )

    def tenant(self, authorization: str) -> Tenant | None:
        """The tenant of a valid bearer key, else None."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return self.tenants.book.find(token.strip())

    def allows(self, authorization: str) -> bool:
        return self.tenant(authorization) is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), "")
        tenant = self.tenant(auth)
        if tenant is None:
            self.on_reject()
            why = "a wrong API key" if auth else "no API key (send Authorization: Bearer <key>)"
            err = InvalidAPIKey(f"Incorrect API key provided: the request has {why}.")
            await err.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        shared = await self._enter(tenant)
        if shared is None:
            if self.metrics is not None:
                self.metrics.tenant_rejected.labels(tenant.name, "max_concurrent").inc()
                self.metrics.rejected.labels("429", TenantLimitReached.code or "").inc()
            self.tenants.refused(tenant.name, "max_concurrent")
            busy = TenantLimitReached(
                f"tenant {tenant.name} has {tenant.max_concurrent} requests in progress, its max_concurrent "
                "limit; retry after 1 s",
                retry_after_s=1,
            )
            await busy.response()(scope, receive, send)
            return
        token = current.set(tenant)
        try:
            await self.app(scope, receive, send)
        finally:
            current.reset(token)
            self.tenants.leave(tenant)
            if shared:
                assert self.tenants.slots is not None
                self.tenants.slots.leave(tenant.name)

    async def _enter(self, tenant: Tenant) -> bool | None:
        """Count a request of ``tenant`` in progress, on this gateway and, for a tenant with ``max_concurrent``,
        in the deployment's shared count (True: counted there too). None: at its limit, not counted."""
        if not self.tenants.enter(tenant):
            return None
        slots, limit = self.tenants.slots, tenant.max_concurrent
        if slots is None or limit is None:
            return False
        if not await slots.enter(tenant.name, limit):
            self.tenants.leave(tenant)
            return None
        return True
