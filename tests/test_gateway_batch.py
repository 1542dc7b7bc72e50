"""Merging a batch's per-prompt answers and streams (gateway.api.batch), against plain generators."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.api.batch import check_fits, merge_streams
from gateway.api.errors import InvalidRequest
from gateway.relay import DONE
from gateway.tenants import Tenant


def event(doc: dict) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


async def stream(i: int, closed: list[int], hang: bool = False):
    try:
        yield event({"id": f"s{i}", "choices": [{"index": 0, "text": f"p{i}"}]})
        if hang:
            await asyncio.Event().wait()
        yield event({"id": f"s{i}", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}) + DONE  # fmt: skip
    finally:
        closed.append(i)


async def test_streams_merge_renumbered_with_one_usage_and_one_done():
    closed: list[int] = []
    chunks = [c async for c in merge_streams([stream(0, closed), stream(1, closed)], n=2, include_usage=True)]
    body = b"".join(chunks)
    assert body.endswith(DONE) and body.count(b"[DONE]") == 1
    docs = [json.loads(e[5:]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]
    assert sorted(c["index"] for d in docs for c in d["choices"]) == [0, 2]
    assert docs[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    assert len({d["id"] for d in docs}) == 1, "one id for every chunk of the merged stream, as OpenAI's"
    assert sorted(closed) == [0, 1]


async def test_closing_the_merged_stream_closes_every_prompts_stream():
    closed: list[int] = []
    merged = merge_streams(
        [stream(0, closed, hang=True), stream(1, closed, hang=True)], n=1, include_usage=False
    )
    first = await anext(merged)
    assert first.startswith(b"data: ")
    await merged.aclose()
    assert sorted(closed) == [0, 1]


def test_a_batch_that_could_never_be_admitted_whole_is_a_400_that_says_so():
    check_fits(5, max_queue=4096, priority="normal", tenant=None)
    with pytest.raises(InvalidRequest, match="more than the queue takes at low priority") as caught:
        check_fits(700, max_queue=1000, priority="low", tenant=None)
    assert caught.value.param == "prompt"
    check_fits(2, max_queue=4096, priority="normal", tenant=Tenant("t", requests_per_s=2))
    with pytest.raises(InvalidRequest, match="may send 2 at once"):
        check_fits(3, max_queue=4096, priority="normal", tenant=Tenant("t", requests_per_s=2))
