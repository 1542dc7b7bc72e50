"""API keys. With keys configured (``FLYING_API_KEYS``, comma-separated, or ``--api-key-file``, one per line), every
``/v1/*`` request needs ``Authorization: Bearer <key>``; a missing or wrong key gets 401 ``invalid_api_key`` in
OpenAI's shape. ``/health`` stays open; ``/metrics`` needs a key only when asked to. Keys are compared as SHA-256
digests in constant time and never logged (the config holds them with ``repr=False``)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import APIError


class InvalidAPIKey(APIError):
    status = 401
    code = "invalid_api_key"


def read_keys(env_value: str | None, path: str | None = None) -> tuple[str, ...]:
    """The keys from the environment variable's value and the file (blank lines and ``#`` comments skipped)."""
    keys = [k.strip() for k in (env_value or "").split(",")]
    if path:
        keys += [line.split("#", 1)[0].strip() for line in Path(path).read_text().splitlines()]
    return tuple(dict.fromkeys(k for k in keys if k))


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class RequireKey:
    """ASGI middleware: refuses protected paths without a valid bearer key (no keys: everything is open)."""

    def __init__(
        self,
        app: ASGIApp,
        keys: tuple[str, ...],
        protect_metrics: bool = False,
        on_reject: Callable[[], None] = lambda: None,
    ) -> None:
        self.app, self.on_reject = app, on_reject
        self.digests = [_digest(k) for k in keys]
        self.protect_metrics = protect_metrics

    def protected(self, path: str) -> bool:
        return bool(self.digests) and (
            path.startswith("/v1/") or (self.protect_metrics and path == "/metrics")
        )

    def allows(self, authorization: str) -> bool:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        d = _digest(token.strip())
        return any(hmac.compare_digest(d, k) for k in self.digests)  # every key compared: no early exit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.protected(scope["path"]):
            auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), "")
            if not self.allows(auth):
                self.on_reject()
                why = "a wrong API key" if auth else "no API key (send Authorization: Bearer <key>)"
                err = InvalidAPIKey(f"Incorrect API key provided: the request has {why}.")
                await err.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)
