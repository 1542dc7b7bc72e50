"""A request's body as the routes read it (gateway.http.body): its media type, its encoding, its limit."""

from __future__ import annotations

import gzip
import zlib

import pytest

from gateway.api.errors import InvalidRequest, PayloadTooLarge, UnsupportedMediaType
from gateway.http.body import check_media_type, decoded_body

DOC = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "application/json",
        "application/json; charset=utf-8",
        "application/vnd.api+json",
        "application/x-www-form-urlencoded",
    ],
)
def test_json_and_what_clients_send_without_saying_are_read(header):
    check_media_type(header)


@pytest.mark.parametrize("header", ["text/plain", "multipart/form-data; boundary=x", "application/xml"])
def test_a_body_declared_as_anything_else_is_a_415(header):
    with pytest.raises(UnsupportedMediaType, match="send it as application/json"):
        check_media_type(header)


@pytest.mark.parametrize("encoding", ["gzip", "x-gzip", "deflate", " GZIP "])
def test_gzip_and_deflate_bodies_are_decompressed(encoding):
    packed = zlib.compress(DOC) if "deflate" in encoding else gzip.compress(DOC)
    assert decoded_body(packed, encoding, limit=1 << 20) == DOC
    assert decoded_body(DOC, "identity", limit=1 << 20) == DOC


def test_a_body_that_decompresses_past_the_limit_is_a_413_and_a_broken_one_a_400():
    bomb = gzip.compress(b" " * 100_000)
    with pytest.raises(PayloadTooLarge, match="decompressed request body exceeds"):
        decoded_body(bomb, "gzip", limit=10_000)
    with pytest.raises(InvalidRequest, match="not valid gzip data"):
        decoded_body(b"not gzip at all", "gzip", limit=10_000)
    with pytest.raises(InvalidRequest, match="not one whole gzip stream"):
        decoded_body(gzip.compress(DOC)[:-6], "gzip", limit=10_000)


def test_another_encoding_is_a_415():
    with pytest.raises(UnsupportedMediaType, match="br is not supported"):
        decoded_body(DOC, "br", limit=1 << 20)
