"""One request's id followed through the gateway's, the router's and the engine's logs (JSON lines)."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.e2e


def records(path: Path, rid: str) -> list[dict]:
    """The JSON lines of ``path`` that mention ``rid`` (every one of them must be a JSON object)."""
    return [json.loads(line) for line in path.read_text().splitlines() if rid in line]


def wait_for(path: Path, rid: str, timeout_s: float = 10) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while not (found := records(path, rid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def test_one_request_id_is_followed_through_the_three_processes_logs(cluster):
    rid = f"e2e-logs-{uuid.uuid4().hex[:8]}"
    resp = httpx.post(
        cluster.config.gateway_url + "/v1/completions",
        json={"model": "tiny-llama", "prompt": "The river meets the sea", "max_tokens": 4},
        headers={
            "X-Request-Id": rid,
            "X-Priority": "high",
        },  # high: never on the fast path, the router assigns it
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-request-id"] == rid
    engine = int(resp.headers["x-flying-engine"])

    [gw] = [r for r in wait_for(cluster.log("gateway"), rid) if r["logger"] == "flying.gateway.requests"]
    assert gw["request_id"] == rid and gw["level"] == "INFO"
    assert (gw["status"], gw["priority"], gw["engine"]) == (200, "high", engine)
    assert gw["queue_ms"] >= 0 and gw["duration_ms"] > 0 and gw["ts"]

    [rt] = wait_for(cluster.log("router"), rid)
    assert rid in rt["request_ids"] and f"{rid}->{engine}" in rt["msg"] and rt["logger"] == "flying.router"

    worker = wait_for(cluster.log(f"worker{engine}"), rid)
    # SGLang ran it as rid <id>~0 (its first dispatch); the line's request_id is the gateway's id
    assert {r["msg"] for r in worker} >= {f"request.received {rid}~0", f"request.finished {rid}~0"}, worker
    assert all(r["request_id"] == rid and r["attempt"] == 0 for r in worker)
