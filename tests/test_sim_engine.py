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


def test_a_retracted_requests_recompute_pays_attention_over_its_prompt_and_output():
    """Retracted (``prefilled`` = -``generated``), a request recomputes its prompt and its output so far: the
    chunks' pairs add up to that whole sequence's causal count, never below zero."""
    from flying.messages import QueuedRequest
    from sim.engine import Req, attn_pairs
    from sim.workload import SimRequest

    q = QueuedRequest(id="r", priority="normal", model="m", prompt_tokens=100, max_tokens=300, gateway="", enqueued_at=0)  # fmt: skip
    r = Req(0, SimRequest(0.0, "normal", 100, 300), q)
    r.generated, r.prefilled = 250, -250
    first = attn_pairs([(r, 50)])
    assert first == 50 * 25
    r.prefilled += 50
    rest = attn_pairs([(r, 300)])
    assert first + rest == 350 * 350 / 2
