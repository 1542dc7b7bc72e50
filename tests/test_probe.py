"""Idle probes (router.probe): an idle node whose group steps the fit has not measured is planned at that width
and sent the probe's prompts, within a budget, never under load; the plan follows the probe (router.regime)."""

from __future__ import annotations

import asyncio

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from flying.messages import Group
from router.config import PolicyConfig
from router.cost_fit import CostFit, Curve
from router.engine_view import EngineView
from router.probe import BUDGET, IDLE_S, SP_FACTORS, SP_REPEATS, TP_OUTPUTS, Prober, payloads, unmeasured
from router.regime import update
from router.round import Round
from router.snapshot import Snapshot


def views(n=2, running=0, mode="dp", group=(), url="http://e"):
    return [
        EngineView(i, f"{url}{i}", 0, 20_000, 20_000, num_engines=n, running=running, mode=mode, group=group)
        for i in range(n)
    ]


def snap(now, es=None, queued=0, admitted=0, groups=()):
    return Snapshot(
        now=now, waiting=[], queued=queued, engines=es or views(), groups=list(groups), admitted=admitted
    )


def measured(width=2):
    line = dict(ms=1.0, ms_per_token=0.1, steps=20, buckets=3, error=0.01)
    return CostFit(
        prior="cpu", curves=(Curve(mode="tp", width=width, **line), Curve(mode="sp", width=width, **line))
    )


def test_a_width_is_unmeasured_until_both_its_tp_and_sp_lines_are_fitted():
    assert unmeasured(None, 2) and not unmeasured(measured(2), 2) and unmeasured(measured(2), 4)
    only_tp = CostFit(prior="cpu", curves=measured().curves[:1])
    assert unmeasured(only_tp, 2)


def test_an_idle_node_is_probed_at_the_narrowest_unmeasured_width_after_idle_s():
    p = Prober()
    assert p.widths(snap(100.0), None, 8, True) == {}, "idle only from now"
    assert p.widths(snap(100.0 + IDLE_S / 2), None, 8, True) == {}
    assert p.widths(snap(100.0 + IDLE_S), None, 8, True) == {"0": 2}
    assert p.left == BUDGET - 1
    assert p.widths(snap(101.0 + IDLE_S), None, 8, True) == {"0": 2}, "held while it runs"


def test_no_probe_under_load_nor_where_measured_nor_without_load_adaptation():
    for kw in ({"queued": 3}, {"es": views(running=2)}):
        p = Prober()
        assert all(p.widths(snap(100.0 + t, **kw), None, 8, True) == {} for t in (0, 2 * IDLE_S, 4 * IDLE_S))
    for fit, width, adaptive in ((measured(2), 8, True), (None, 1, True), (None, 8, False)):
        p = Prober()
        assert all(p.widths(snap(100.0 + t), fit, width, adaptive) == {} for t in (0, 2 * IDLE_S))
    manual = Group(epoch=1, members=(0, 1), reason="manual", since=0.0)
    p = Prober()
    assert all(p.widths(snap(100.0 + t, groups=[manual]), None, 8, True) == {} for t in (0, 2 * IDLE_S))


def test_a_probe_ends_when_a_request_arrives_and_the_budget_bounds_them():
    p = Prober(budget=2)
    t, n = 100.0, 0
    for _ in range(2):
        p.widths(snap(t, admitted=n), None, 8, True)
        t += IDLE_S
        assert p.widths(snap(t, admitted=n), None, 8, True) == {"0": 2}
        t, n = t + 1, n + 1
        assert p.widths(snap(t, admitted=n), None, 8, True) == {}, "an admission ends it"
    assert p.left == 0
    assert all(p.widths(snap(t + k * IDLE_S, admitted=n), None, 8, True) == {} for k in range(1, 4))


def test_the_planner_takes_the_probes_width_for_the_probed_node():
    cfg = PolicyConfig()
    s = snap(100.0)
    rnd = Round(Snapshot(**{**s.__dict__, "probe": {"0": 2}}), cfg)
    update(rnd)
    assert rnd.out.state.widths == {"0": 2}
    rnd = Round(Snapshot(**{**s.__dict__, "probe": {"0": 2}}), PolicyConfig(max_width=1))
    update(rnd)
    assert rnd.out.state.widths == {"0": 1}, "never beyond what the operator allows"


def test_the_probes_prompts_span_the_sp_threshold_and_fit_the_engines_context():
    sp, tp = payloads(100_000, 512)
    assert sorted(len(b["input_ids"]) for b in sp) == sorted([512 * f for f in SP_FACTORS] * SP_REPEATS)
    assert len({tuple(b["input_ids"]) for b in sp}) == len(sp), "distinct: no prefix cache shortens one"
    assert [b["sampling_params"]["max_new_tokens"] for b in tp] == list(TP_OUTPUTS)
    assert all(len(b["input_ids"]) < 512 for b in tp), "below the threshold: TP steps"
    sp, tp = payloads(1000, 512)
    assert max(len(b["input_ids"]) + b["sampling_params"]["max_new_tokens"] for b in sp + tp) <= 1000
    assert payloads(1000, 0)[0] == [], "SP off: no SP prompts"


async def test_once_the_group_is_bound_its_leader_gets_the_prompts_and_the_probe_ends_answered():
    got: list[int] = []

    async def generate(request: Request) -> JSONResponse:
        got.append(len((await request.json())["input_ids"]))
        return JSONResponse({"text": ""})

    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/generate", generate, methods=["POST"])]),
                                           host="127.0.0.1", port=0, log_level="error"))  # fmt: skip
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    p = Prober()
    try:
        p.widths(snap(100.0), None, 8, True)
        assert p.widths(snap(100.0 + IDLE_S), None, 8, True) == {"0": 2}
        p.fire(views(), 512)  # not bound yet: nothing sent
        await asyncio.sleep(0.05)
        assert got == []
        bound = [EngineView(e, f"http://127.0.0.1:{port}", 0, 20_000, 20_000, num_engines=2, mode="tp",
                            group=(0, 1)) for e in (0, 1)]  # fmt: skip
        p.fire(bound, 512)
        for _ in range(200):
            if len(got) == sum(map(len, payloads(20_000, 512))):
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)
        sp, tp = payloads(20_000, 512)
        assert got[: len(sp)] == [len(b["input_ids"]) for b in sp], "the SP prompts one by one, in order"
        assert sorted(got[len(sp) :]) == sorted(len(b["input_ids"]) for b in tp)
        assert p.widths(snap(102.0 + IDLE_S, es=bound), None, 8, True) == {}, "answered: the probe ends"
        assert p.node is None
    finally:
        await p.close()
        server.should_exit = True
        await serving
