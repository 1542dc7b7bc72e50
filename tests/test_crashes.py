"""Crash reports (flying.crashes): what a report says of a request, and the report in Redis."""

from __future__ import annotations

import time

import pytest

from flying import crashes
from flying.crashes import Blame
from flying.messages import CrashReport


def report(batch=(), held=()) -> CrashReport:
    return CrashReport(
        engine=2, at=time.time(), error="RuntimeError: boom", batch=batch, held=(*batch, *held)
    )


@pytest.mark.parametrize(
    "rids, batch, held, expected",
    [
        (["a~0"], ("a~0",), ("b~0",), Blame.CAUSE),
        # a request of two choices runs as two SGLang requests: together they are still one request
        (["a~1_0", "a~1_1"], ("a~1_0", "a~1_1"), (), Blame.CAUSE),
        (["a~0"], ("a~0", "b~0"), (), Blame.SHARED),
        (["b~0"], ("a~0",), ("b~0",), Blame.CLEARED),
        # an earlier attempt of the same request in the batch is another run, not this one
        (["a~1"], ("a~0",), (), Blame.UNKNOWN),
        (["c~0"], ("a~0",), ("b~0",), Blame.UNKNOWN),
        # raised outside any batch: no request is cleared, none blamed
        (["b~0"], (), ("b~0",), Blame.UNKNOWN),
    ],
    ids=["alone", "choices", "shared", "cleared", "other-attempt", "not-held", "no-batch"],
)
def test_what_a_report_says_of_a_request(rids, batch, held, expected):
    assert crashes.blame(report(batch, held), rids) is expected


def test_no_report_blames_nobody():
    assert crashes.blame(None, ["a~0"]) is Blame.UNKNOWN


async def test_a_report_written_by_the_worker_is_read_by_the_gateway(sync_redis, aredis, keys):
    written = report(("a~0",), ("b~3",))
    crashes.write(sync_redis, keys, written)
    assert await crashes.read(aredis, keys, 2) == written
    assert 0 < await aredis.ttl(keys.crash(2)) <= crashes.REPORT_TTL_S, "it expires"
    assert await crashes.read(aredis, keys, 1) is None


async def test_an_unreadable_report_is_no_report(aredis, keys):
    await aredis.set(keys.crash(0), b"{not json")
    assert await crashes.read(aredis, keys, 0) is None
