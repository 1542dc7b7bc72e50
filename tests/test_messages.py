import json

import msgspec
import pytest

from flying.messages import (
    GROUP_LEADER_ONLY,
    GROUP_LOST,
    GROUP_PARKED,
    Heartbeat,
    QueuedRequest,
    decode,
    encode,
    engine_rid,
    from_hash,
    split_engine_rid,
    to_hash,
    uncounted,
)


def test_request_round_trips_through_a_redis_hash():
    req = QueuedRequest(
        id="r",
        priority="high",
        model="m",
        prompt_tokens=5,
        max_tokens=7,
        gateway="g",
        enqueued_at=12.5,
        seq=3,
    )
    fields = to_hash(req) | {"state": "queued", "engine": "1"}
    assert all(isinstance(v, str) for v in fields.values())
    assert from_hash(fields, QueuedRequest) == req
    assert req.kv_tokens == 12


def test_heartbeat_json_round_trip():
    hb = Heartbeat(engine=1, url="http://x", pid=9, model="m", free_kv_tokens=100, step=4)
    assert decode(encode(hb), Heartbeat) == hb


@pytest.mark.filterwarnings("ignore::UserWarning")  # SGLang's OpenAI server warns on import without CUDA
def test_the_gateway_knows_how_a_worker_ends_a_request_whose_group_was_lost():
    """Both sides of the GroupLost contract: the finish reason the worker sets, rendered by SGLang's own OpenAI
    server as a stream's error event, is what the gateway re-dispatches on; a normal event is not."""
    from sglang.srt.entrypoints.openai.serving_base import OpenAIServingBase

    from flying.messages import GaveUp, engine_gave_up
    from worker_ext.sglang_patches import group_lost

    reason = group_lost().to_json()
    code = reason["status_code"]
    event = OpenAIServingBase.create_streaming_error_response(None, reason["message"], code.name, code.value)
    assert engine_gave_up(json.loads(event)) == GaveUp(GROUP_LOST.message, group_lost=True)
    parked = group_lost(
        GROUP_PARKED.message
    ).to_json()  # (worker_ext.parking: set aside before its first token)
    event = OpenAIServingBase.create_streaming_error_response(None, parked["message"], code.name, code.value)
    assert engine_gave_up(json.loads(event)) == GaveUp(GROUP_PARKED.message, group_lost=True, parked=True)
    pinned = group_lost(GROUP_LEADER_ONLY.message).to_json()  # a follower refused a constrained request
    event = OpenAIServingBase.create_streaming_error_response(None, pinned["message"], code.name, code.value)
    assert engine_gave_up(json.loads(event)).parked and uncounted(pinned["message"])
    assert not uncounted(GROUP_LOST.message)
    assert engine_gave_up({"choices": [{"index": 0, "finish_reason": "abort"}]}) == GaveUp("aborted")
    assert engine_gave_up({"choices": [{"index": 0, "finish_reason": "length"}]}) is None


def test_n_choices_hold_kv_each_and_are_known_to_sglang_by_suffixed_ids():
    one = QueuedRequest(id="r", model="m", prompt_tokens=5, max_tokens=7, gateway="g", enqueued_at=0)
    two = QueuedRequest(id="r", model="m", prompt_tokens=5, max_tokens=7, gateway="g", enqueued_at=0, n=2)
    assert (one.kv_tokens, two.kv_tokens) == (12, 19)
    assert one.engine_rids() == ["r~0"] and two.engine_rids() == ["r~0_0", "r~0_1"]
    again = msgspec.structs.replace(one, attempts=2)
    assert again.engine_rids() == ["r~2"], "its second re-dispatch runs under a rid of its own"


def test_no_engine_rid_begins_with_another_requests_or_attempts():
    """SGLang's abort of a rid also ends every rid that begins with it: a reused client id's ``<id>-<hex>``, an
    id that extends another, and a later attempt each get a rid that no other one begins."""
    rids = [engine_rid(i, a) for i in ("abc", "abc-1f2e3d4c", "abcd", "ab.c") for a in range(3)]
    assert not [(x, y) for x in rids for y in rids if x != y and y.startswith(x)]
    assert [split_engine_rid(r) for r in ("abc~2", "abc-1f2e3d4c~0", "plain", "a~b", "n2~1_3", "a~0_x")] == [
        ("abc", 2),
        ("abc-1f2e3d4c", 0),
        ("plain", None),
        ("a~b", None),
        ("n2", 1),  # a choice's rid (engine_rids)
        ("a~0_x", None),
    ]


def test_a_heartbeat_without_a_node_decodes_as_one_nodes_engine():
    """Records written before engines announced their node: node "" and a pool from engine 0, as one node."""
    from flying.messages import Heartbeat, decode

    old = b'{"engine":1,"url":"u","pid":2,"model":"m","num_engines":4}'
    hb = decode(old, Heartbeat)
    assert (hb.node, hb.pool_first, hb.num_engines) == ("", 0, 4)
