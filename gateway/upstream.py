"""Talking to the engines' SGLang HTTP servers through one pooled httpx client."""

from __future__ import annotations

import contextlib
import logging

import httpx

log = logging.getLogger("flying.gateway")


class WorkerUnavailable(Exception):
    """The assigned engine could not be reached or died before answering."""


class Upstream:
    def __init__(self, read_timeout_s: float) -> None:
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=3.0, read=read_timeout_s, write=30.0, pool=30.0),
            limits=httpx.Limits(max_connections=2048, max_keepalive_connections=256),
        )

    async def close(self) -> None:
        await self.client.aclose()

    async def open_stream(self, url: str, path: str, body: dict) -> httpx.Response:
        """Send the request and return once response headers arrive (body still streaming)."""
        req = self.client.build_request("POST", url + path, json=body)
        try:
            return await self.client.send(req, stream=True)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectTimeout) as exc:
            raise WorkerUnavailable(f"{url}: {exc!r}") from exc

    async def post(self, url: str, path: str, body: dict) -> httpx.Response:
        try:
            resp = await self.client.post(url + path, json=body)
            await resp.aread()
            return resp
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectTimeout) as exc:
            raise WorkerUnavailable(f"{url}: {exc!r}") from exc

    async def abort(self, url: str, rid: str) -> None:
        """Stop a request on its engine (SGLang keeps decoding after a client disconnect otherwise)."""
        with contextlib.suppress(httpx.HTTPError):
            await self.client.post(f"{url}/abort_request", json={"rid": rid}, timeout=5)
