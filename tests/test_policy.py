from flying.messages import QueuedRequest
from router.policy import EngineView, plan


def req(i: str, prompt: int = 10, out: int = 10, priority: str = "normal") -> QueuedRequest:
    return QueuedRequest(
        id=i, priority=priority, model="m", prompt_tokens=prompt, max_tokens=out, gateway="g", enqueued_at=0.0
    )


def eng(i: int, inflight: int = 0, free: int = 1000, cap: int = 1000) -> EngineView:
    return EngineView(i, f"http://e{i}", inflight, free, cap)


def test_spreads_requests_over_least_loaded_engines():
    out = plan([req("a"), req("b"), req("c")], [eng(0, inflight=1), eng(1)], max_inflight=8)
    assert [(d.request.id, d.engine) for d in out] == [("a", 1), ("b", 0), ("c", 1)]


def test_respects_the_inflight_cap_and_keeps_queue_order():
    out = plan([req("a"), req("b"), req("c")], [eng(0, inflight=1)], max_inflight=2)
    assert [d.request.id for d in out] == ["a"]


def test_request_too_big_for_every_engine_stays_queued_but_does_not_block_others():
    out = plan([req("big", prompt=5000), req("small")], [eng(0, cap=1000)], max_inflight=4)
    assert [d.request.id for d in out] == ["small"]


def test_request_goes_to_the_engine_whose_capacity_fits():
    out = plan([req("big", prompt=1500)], [eng(0, cap=1000), eng(1, cap=2000)], max_inflight=4)
    assert [(d.request.id, d.engine) for d in out] == [("big", 1)]


def test_no_engines_no_dispatch():
    assert plan([req("a")], [], max_inflight=4) == []


def test_ties_prefer_more_free_kv_then_lower_index():
    out = plan([req("a"), req("b")], [eng(0, free=100), eng(1, free=900), eng(2, free=900)], max_inflight=4)
    assert [d.engine for d in out] == [1, 2]
