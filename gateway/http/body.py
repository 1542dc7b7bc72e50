"""A request's body as the routes read it: at most a limit of bytes, within a timeout, decompressed when sent with
``Content-Encoding``, and declared as JSON (or as nothing)."""

from __future__ import annotations

import asyncio
import zlib

from starlette.requests import ClientDisconnect, Request

from gateway.api.errors import InvalidRequest, PayloadTooLarge, RequestTimeout, UnsupportedMediaType


async def read_body(request: Request, limit: int, timeout_s: float = 30.0) -> bytes:
    """The request's body, at most ``limit`` bytes (413), all of it within ``timeout_s`` (408: a client that
    declared more than it sends, or sends it too slowly, no longer holds the request open forever)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
    chunks, size, more = [], 0, True
    try:
        async with asyncio.timeout(timeout_s):  # (a timer, no task: the body usually came with the head)
            while more:  # ``receive`` itself, not ``request.stream()``: no async generator per request
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    raise ClientDisconnect()
                chunk, more = message.get("body", b""), message.get("more_body", False)
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        came = f"{size} of the {declared} bytes declared" if declared else f"{size} bytes"
        raise RequestTimeout(
            f"the request body did not arrive within {timeout_s:g} s ({came} came)"
        ) from None
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding")
    return body if encoding is None else decoded_body(body, encoding, limit)


# media types read as JSON besides application/json and */*+json: a body without one, and curl's ``-d`` default
LENIENT_TYPES = frozenset({"", "application/x-www-form-urlencoded"})


def check_media_type(header: str | None) -> None:
    """A body declared as anything but JSON (``text/plain``, a form upload) is a 415, not parsed as JSON."""
    media = (header or "").split(";", 1)[0].strip().lower()
    if media == "application/json" or media.endswith("+json") or media in LENIENT_TYPES:
        return
    raise UnsupportedMediaType(f"request body is {media}; send it as application/json")


def decoded_body(body: bytes, encoding: str, limit: int) -> bytes:
    """A body sent with ``Content-Encoding`` gzip or deflate, decompressed (at most ``limit`` bytes of it: 413);
    another encoding is a 415."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "x-gzip", "deflate"):
        raise UnsupportedMediaType(f"Content-Encoding {encoding} is not supported (gzip, deflate or none)")
    d = zlib.decompressobj(wbits=47)  # a gzip or a zlib header, found in the data
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as exc:
        raise InvalidRequest(f"the request body is not valid {encoding} data ({exc})") from None
    if len(out) > limit or d.unconsumed_tail:
        raise PayloadTooLarge(f"the decompressed request body exceeds the limit of {limit} bytes")
    if not d.eof or d.unused_data:  # cut short, or more after its end: not one whole stream
        raise InvalidRequest(f"the request body is not one whole {encoding} stream")
    return out
