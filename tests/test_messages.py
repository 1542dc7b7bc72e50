from flying.messages import Heartbeat, QueuedRequest, decode, encode, from_hash, to_hash


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
