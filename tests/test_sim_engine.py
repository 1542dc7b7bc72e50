"""The simulator's engine model (sim.engine): an engine publishes the heartbeat a worker would, and the router's
view of it is built from that, as from a real one."""

from __future__ import annotations

from flying.messages import Bind
from router.engine_view import EngineView
from sim.config import SimConfig
from sim.simulator import Simulator


def test_an_idle_engine_looks_like_an_idle_worker_and_a_read_bind_shows_as_pending():
    sim = Simulator(SimConfig(engines=2, no_kv_transform=(1,)), [])
    kv = sim.kv_per_engine
    assert sim.engines[0].view() == EngineView(
        0, "sim://0", 0, kv, kv, num_engines=2, kv_transform=True, park=True
    )
    assert sim.engines[1].heartbeat().kv_transform is False
    sim.now = 1.0
    sim.engines[1].command(Bind(epoch=3, members=(0, 1), preempt="sequential"))
    hb = sim.engines[1].heartbeat()
    assert (hb.pending, hb.ts, hb.mode) == (3, 1.0, "dp") and sim.engines[1].state == "binding"
