"""Redis behind Sentinel (a primary, a replica, three Sentinels) under load: a real gateway and router process and
fake engines; the primary is killed (SIGKILL) and the Sentinels promote the replica. No request fails, and new
requests are served again within 3 s of the kill."""

from __future__ import annotations

import asyncio
import time

import pytest

from devstack.redis_server import SentinelSet
from flying import redis_conn
from tests.deployment import Deployment, steady

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]

KILL_AT_S = 2.0


@pytest.fixture
def sentinels(tmp_path):
    s = SentinelSet(data_dir=tmp_path / "redis").start()
    yield s
    s.stop()


def test_killing_the_primary_fails_no_request_and_serving_resumes_within_3_s(
    sentinels, keys, tiny_model, tmp_path
):
    killed: list[float] = []

    def kill_primary() -> None:
        killed.append(time.monotonic())
        sentinels.primary.kill()

    with Deployment(sentinels.url, keys, tiny_model, tmp_path) as d:
        d.start_engine()
        d.start_engine()
        d.start_router()
        (url,) = d.start_gateways(1)
        outcomes = asyncio.run(
            steady([url], seconds=KILL_AT_S + 5, rate=25, events={KILL_AT_S: kill_primary})
        )
    t_kill = killed[0]
    failed = [o for o in outcomes if o.status != 200]
    assert not failed, f"{len(failed)} of {len(outcomes)} failed, e.g. {failed[:3]}"
    assert sentinels.primary_port() == sentinels.replica.port, "the replica was promoted"
    after = [o for o in outcomes if o.sent >= t_kill]
    before = [o for o in outcomes if o.sent < t_kill]
    assert len(before) > 20 and len(after) > 20, (len(before), len(after))
    resumed = min(o.done for o in after) - t_kill
    stalled = [o for o in before if o.done > t_kill]  # in progress at the kill
    print(
        f"\n{len(outcomes)} requests at 25/s, none failed; {len(stalled)} in progress at the kill; the first request "
        f"sent after the kill answered {resumed:.2f} s after it; slowest {max(o.done - o.sent for o in outcomes):.2f} s"
    )
    assert resumed < 3.0
    assert redis_conn.sync_client(sentinels.url).zcard(keys.queue) == 0
