"""The chaos soak (benchmarks/soak.py) for three minutes: two-level load through 2 gateways while the Redis
primary, an engine, a gateway and the active router are killed in turn; every request a gateway accepted is
answered, none with a 5xx. docs/benchmarks.md, "Chaos soak", has the long runs."""

from __future__ import annotations

import pytest

from benchmarks.soak import run, summary

pytestmark = [pytest.mark.e2e, pytest.mark.chaos, pytest.mark.timeout(900)]


def test_a_three_minute_chaos_soak_loses_nothing(tiny_model, tmp_path):
    report = run(tmp_path, tiny_model, 180, seed=1)
    print(summary(report))
    outcomes = report["outcomes"]
    assert outcomes.get("ok", 0) > 100, outcomes
    assert set(outcomes) <= {"ok", "refused"}, f"lost or failed requests: {outcomes}"
    assert [what for _, what in report["events"]] and len(report["events"]) == 4, "every fault was injected"
    assert report["kv_idle_end"]["0"] == report["kv_idle_start"]["0"], (
        "engine 0's KV at idle is all free again"
    )
