"""The SGLang touch points that run without a model (worker_ext.sglang_patches), over the smallest stand-ins of
SGLang's scheduler structures they read."""

from __future__ import annotations

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
