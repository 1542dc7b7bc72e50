"""The SGLang touch points that run without a model (worker_ext.sglang_patches), over the smallest stand-ins of
SGLang's scheduler structures they read."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from flying.messages import GROUP_LOST
from worker_ext import sglang_patches


class Req(SimpleNamespace):
    def finished(self) -> bool:
        return self.finished_reason is not None


@pytest.mark.filterwarnings("ignore::UserWarning")  # importing SGLang's finish reasons on a CPU host
def test_dropping_a_leaders_tp_requests_ends_them_group_lost_through_its_output_streamer():
    streamed: list[list[str]] = []
    scheduler = SimpleNamespace(
        running_batch=SimpleNamespace(reqs=[Req(rid="a", finished_reason=None, return_logprob=False,
                                                kv=SimpleNamespace(holds_kv=False))]),
        waiting_queue=[Req(rid="b", finished_reason=None, return_logprob=False, kv=SimpleNamespace(holds_kv=False))],
        output_streamer=SimpleNamespace(stream_output=lambda reqs, logprob: streamed.append([r.rid for r in reqs])),
    )  # fmt: skip
    assert sglang_patches.drop_tp_requests(scheduler) == ["a", "b"]
    assert streamed == [["a", "b"]]
    assert scheduler.waiting_queue == [] and scheduler.running_batch.reqs == []
    assert GROUP_LOST.message in str(sglang_patches.group_lost().to_json())


def test_a_groups_request_limits_reach_sglangs_pool_statistics():
    """Bound, the scheduler budgets the group's pooled KV; SGLang's pool statistics (``--enable-metrics``, load
    reports) divide the free KV by their own copy of the capacity, and a stale one gave a negative usage that
    SGLang asserts against: the leader's scheduler died on its first bound prefill."""
    from sglang.srt.managers.scheduler_components.pool_stats_observer import SchedulerPoolStatsObserver

    fields = dict.fromkeys(f.name for f in dataclasses.fields(SchedulerPoolStatsObserver))
    observer = SchedulerPoolStatsObserver(**fields | {"max_total_num_tokens": 4096})
    scheduler = SimpleNamespace(
        pool_stats_observer=observer,
        kv_shard_widening=1,
        model_config=SimpleNamespace(context_len=8192),
        max_total_num_tokens=4096,
        max_req_len=4095,
        max_req_input_len=4090,
    )
    dp = sglang_patches.RequestLimits(4095, 4090, 4096)
    sglang_patches.set_request_limits(scheduler, dp, 2)
    assert scheduler.max_total_num_tokens == observer.max_total_num_tokens == 8192
    assert scheduler.pool_stats_observer is observer, "changed in place: other holders see the same capacity"
    sglang_patches.set_request_limits(scheduler, dp, 1)
    assert scheduler.max_total_num_tokens == observer.max_total_num_tokens == 4096


def test_an_sglang_rid_names_the_gateways_request_and_attempt():
    assert sglang_patches.request_of("r-1~2") == ("r-1", 2)
    assert sglang_patches.request_of(["r-1~0_0", "r-1~0_1"]) == ("r-1", 0)  # a request's n choices
    assert sglang_patches.request_of("HEALTH_CHECK_9f") is None  # a rid the gateway did not make
    assert sglang_patches.request_of(["a~0_0", "b~0_1"]) is None and sglang_patches.request_of(None) is None


def test_idle_poll_shortens_the_idle_schedulers_sleep_and_gives_it_back():
    import time as _time
    import types

    import zmq

    from worker_ext.sglang_patches import idle_poll

    class Sleeper:  # SGLang's IdleSleeper: a zmq poll of up to a second
        def __init__(self) -> None:
            self.poller = zmq.Poller()
            self.poller.register(zmq.Context.instance().socket(zmq.PULL), zmq.POLLIN)

        def maybe_sleep(self) -> str:
            self.poller.poll(1000)
            return "sglang's"

    scheduler = types.SimpleNamespace(idle_sleeper=Sleeper())
    idle_poll(scheduler, 0.02)
    t0 = _time.monotonic()
    assert scheduler.idle_sleeper.maybe_sleep() != "sglang's"
    assert _time.monotonic() - t0 < 0.5  # (a second before)
    idle_poll(scheduler, None)
    assert "maybe_sleep" not in vars(scheduler.idle_sleeper)  # the class's own again
    idle_poll(types.SimpleNamespace(), 0.02)  # no sleeper (--sleep-on-idle off): nothing to do
