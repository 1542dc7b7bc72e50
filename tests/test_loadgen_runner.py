"""loadgen.runner against the fake endpoint in-process, on uvloop as the CLI runs it: requests go out on their
schedule and never before it (uvloop's timers fire up to a millisecond early; a dispatch lag is never negative)."""

from __future__ import annotations

import uvloop

from flying.procs import free_port
from loadgen import fake_server, runner
from loadgen.workload import PlannedRequest


def test_no_request_is_sent_before_its_schedule():
    async def scenario():
        port = free_port()
        reqs = [PlannedRequest(0.0037 * i, "normal", "hi", 4, 2) for i in range(200)]  # between timer ticks
        async with await fake_server.serve(port, itl_ms=1, state=fake_server.EngineState(log=[])):
            return (await runner.run(runner.RunConfig(f"http://127.0.0.1:{port}", "m"), reqs))[0]

    records = uvloop.run(scenario())
    assert all(r.ok for r in records)
    assert min(r.dispatch_lag for r in records) >= 0, [r.dispatch_lag for r in records if r.dispatch_lag < 0]
