"""The policy's view of an engine is built from its heartbeat, for the router and the simulator alike."""

from __future__ import annotations

from flying.messages import Heartbeat
from router.engine_view import EngineView


def test_a_view_carries_the_heartbeat_fields_the_policy_reads_and_the_inflight_count():
    hb = Heartbeat(engine=3, url="http://e3", pid=1, model="m", launch_id="L", mode="tp", epoch=7, pending=0,
                   num_engines=4, kv_transform=True, free_kv_tokens=100, max_total_tokens=900, ts=12.5)  # fmt: skip
    assert EngineView.from_heartbeat(hb, inflight=5) == EngineView(
        3, "http://e3", 5, 100, 900, mode="tp", epoch=7, pending=0, num_engines=4, beat_ts=12.5,
        kv_transform=True, launch_id="L",
    )  # fmt: skip
