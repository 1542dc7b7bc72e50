"""The engines' circuit breakers as the router applies them (:mod:`flying.breaker`): an engine whose breaker is not
closed is left out of the policy's snapshot (no dispatch, no fast path, no bind), and an engine whose back-off is
over gets one probe, ``GET <url>/health`` (one generated token on SGLang), whose answer closes its breaker or
opens it again."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence

import httpx
import redis.asyncio as aioredis

from flying.breaker import Breaker, Breakers, decode_all
from flying.cancel import reraise_if_cancelled
from router.engine_view import EngineView

log = logging.getLogger("flying.router")
PROBE_PATH = "/health"
FORGET_S = 3600.0  # seconds after which a gone engine's breaker is dropped


class RouterBreakers:
    """Filters the live engines by their breakers and runs the probes (each in a task of its own, so a round never
    waits for an engine)."""

    def __init__(self, breakers: Breakers) -> None:
        self.breakers = breakers
        self.probes: set[asyncio.Task] = set()
        self._http: httpx.AsyncClient | None = None

    def dispatchable(
        self, views: Sequence[EngineView], rows: Mapping[bytes | str, bytes | str]
    ) -> list[EngineView]:
        """The engines of ``views`` whose breaker is closed (``rows``: the breakers hash as read in the round's
        snapshot); a probe is started for each whose back-off is over."""
        if not rows:
            return list(views)
        states = decode_all(rows)
        now = time.time()
        out = []
        for v in views:
            b = states.get(v.engine)
            if b is None or b.dispatchable:
                out.append(v)
            elif b.probe_due(now):
                self._start_probe(v, b)
        return out

    async def drop_stale(self, live: set[int], now: float) -> list[int]:
        """Forget the breakers of engines that are not live and whose breaker has not changed for
        :data:`FORGET_S` (engines long gone, or renumbered); returns those engines."""
        stale = sorted(
            e
            for e, b in (await self.breakers.read()).items()
            if e not in live and now - b.last_change > FORGET_S
        )
        for e in stale:
            await self.breakers.forget(e)
        return stale

    def _start_probe(self, v: EngineView, b: Breaker) -> None:
        task = asyncio.create_task(self.probe(v.engine, v.url), name=f"breaker-probe-{v.engine}")
        self.probes.add(task)
        task.add_done_callback(self.probes.discard)

    async def probe(self, engine: int, url: str) -> None:
        """Claim the engine's one probe; if this router got it, ask the engine's health endpoint and record the
        outcome (the breaker closes, or opens again for a longer back-off)."""
        try:
            if not await self.breakers.claim_probe(engine, time.time()):
                return
            ok, why = await self._ask(url)
            if ok:
                await self.breakers.success(engine, time.time())
                log.warning(
                    "engine %d: probe answered; its circuit breaker is closed, dispatching again", engine
                )
            else:
                await self.breakers.failure(engine, time.time(), f"probe: {why}")
                log.warning("engine %d: probe failed (%s); its circuit breaker stays open", engine, why)
        except aioredis.RedisError as exc:
            reraise_if_cancelled()
            log.warning("engine %d: breaker probe not recorded (redis: %r)", engine, exc)

    async def _ask(self, url: str) -> tuple[bool, str]:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self.breakers.settings.probe_timeout_s)
        try:
            resp = await self._http.get(url + PROBE_PATH)
        except httpx.HTTPError as exc:
            return False, repr(exc)
        return resp.status_code == 200, f"{PROBE_PATH} answered {resp.status_code}"

    async def close(self) -> None:
        for task in list(self.probes):
            task.cancel()
        await asyncio.gather(*self.probes, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()
            self._http = None
