import re
from pathlib import Path

from flying.keys import Keys
from flying.messages import Heartbeat


def test_every_key_is_under_the_prefix():
    k = Keys("p")
    names = [
        k.queue,
        k.seq,
        k.wake,
        k.router_lease,
        k.workers,
        k.stats,
        k.request("r1"),
        k.worker(3),
        k.ready(3),
        k.inflight(3),
        k.gateway_channel("g"),
        k.commands(3),
        k.decisions,
    ]
    assert all(n.startswith("p:") for n in names)
    assert len(set(names)) == len(names)


def test_schema_matches_the_documented_names():
    k = Keys()
    assert (k.queue, k.request("abc"), k.worker(0), k.inflight(1)) == (
        "flying:queue",
        "flying:req:abc",
        "flying:worker:0",
        "flying:inflight:1",
    )
    doc = (__import__("pathlib").Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    for name in (
        "flying:queue",
        "flying:seq",
        "flying:router:wake",
        "flying:router:lease",
        "flying:workers",
        "flying:stats",
        "flying:req:{id}",
        "flying:worker:{i}",
        "flying:ready:{i}",
        "flying:inflight:{i}",
        "flying:gw:{gateway}",
        "flying:cmd:{i}",
        "flying:router:decisions",
    ):
        assert name in doc, f"{name} not documented in docs/architecture.md"


def test_the_heartbeats_documented_fields_are_its_fields():
    doc = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `flying:worker:{i}` |"))
    listed = {f.strip() for f in re.search(r"JSON \(([^)]*)\)", row).group(1).split(",")}
    assert listed == set(Heartbeat.__struct_fields__)
