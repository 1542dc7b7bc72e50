"""Two "nodes" on one machine (two CPU engines each, each node its own communicator pool), two gateways and two
routers (active and standby) over one Redis: groups bind inside a node, requests flow to both nodes through both
gateways, and a whole node killed under load loses no accepted request; when it comes back its engines rejoin in
DP."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from devstack.cluster import Cluster, ClusterConfig
from flying import control

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
BODY = {
    "model": "tiny-llama",
    "messages": [{"role": "user", "content": "a long story please"}],
    "max_tokens": 160,
    "ignore_eos": True,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def two_nodes(tiny_model, tmp_path_factory):
    config = ClusterConfig(
        model_path=tiny_model,
        num_engines=4,
        nodes=2,
        gateways=2,
        standby_router=True,
        log_dir=tmp_path_factory.mktemp("two-nodes"),
        max_total_tokens=4096,
        router_args=("--max-inflight-per-worker", "4"),
    )
    c = Cluster(config, progress=print).start(timeout_s=600)  # four CPU engines start slowly on two cores
    try:
        yield c
    finally:
        c.stop()


def wait_for(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (got := pred()):
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)
    return got


async def non_stream(client: httpx.AsyncClient, url: str) -> tuple[int, dict]:
    resp = await client.post(url + "/v1/chat/completions", json=BODY)
    return resp.status_code, resp.json()


async def stream(client: httpx.AsyncClient, url: str) -> tuple[int, list[dict]]:
    events = []
    body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                events.append(json.loads(line[5:]))
        return resp.status_code, events


def test_binds_stay_inside_a_node_and_a_lost_node_loses_no_accepted_request(two_nodes):
    c, r = two_nodes, two_nodes.client()
    node = {e: c.config.node_of(e) for e in range(4)}
    beats = c.heartbeats()
    assert {e: (hb.node, hb.pool_first, hb.num_engines) for e, hb in beats.items()} == {
        0: ("node0", 0, 2),
        1: ("node0", 0, 2),
        2: ("node1", 2, 2),
        3: ("node1", 2, 2),
    }
    # idle: the router binds load groups, one per node and none across
    groups = wait_for(
        lambda: len(control.groups(r, c.keys)) == 2 and control.groups(r, c.keys), 60, "2 groups"
    )
    assert sorted(g.members for g in groups) == [(0, 1), (2, 3)]

    urls = c.config.gateway_urls()
    served_by: dict[int, set[int]] = {0: set(), 1: set()}

    async def scenario():
        async with httpx.AsyncClient(timeout=240) as client:
            tasks = [asyncio.create_task(non_stream(client, urls[i % 2])) for i in range(12)]
            tasks += [asyncio.create_task(stream(client, urls[i % 2])) for i in range(4)]

            def both_nodes_busy() -> bool:
                for e in range(4):
                    if r.scard(c.keys.inflight(e)):
                        served_by[node[e]].add(e)
                return all(served_by.values())

            await asyncio.to_thread(wait_for, both_nodes_busy, 60, "requests on both nodes")
            c.kill_node(1, signal.SIGKILL)  # engines 2 and 3 at once, with whatever they were running
            return await asyncio.gather(*tasks)

    results = asyncio.run(scenario())
    for status, body in results[:12]:
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == BODY["max_tokens"]
    for status, events in results[12:]:  # streams continue on node 0 from the tokens already sent
        assert status == 200
        assert not [e for e in events if "error" in e], events[-3:]
        assert events[-1]["usage"]["completion_tokens"] == BODY["max_tokens"]
    assert int(r.hget(c.keys.stats, "requeued") or 0) > 0, "the lost node's requests were re-dispatched"
    # the lost node's groups are forgotten; node 0 keeps serving through both gateways
    wait_for(
        lambda: all(set(g.members) <= {0, 1} for g in control.groups(r, c.keys)), 20, "node 1's groups gone"
    )
    for url in urls:
        health = wait_for(lambda u=url: (h := httpx.get(u + "/health", timeout=5).json())["live_workers"] == [0, 1] and h, 10, "node 1 not live")  # fmt: skip
        assert health["status"] == "ok"

    for e in c.config.node_engines(1):  # the node comes back: its engines rejoin in DP
        c.start_worker(e)
    c.wait_live(range(4), 300)
    back = c.heartbeats()
    assert all(back[e].mode == "dp" or back[e].group == (2, 3) for e in (2, 3)), "DP, or bound in its node"
    ok = httpx.post(urls[1] + "/v1/chat/completions", json={**BODY, "max_tokens": 4}, timeout=120)
    assert ok.status_code == 200
