"""The communicator pool across real processes (gloo on CPU), no default process group anywhere."""

import multiprocessing as mp
import time

import pytest
import torch

from flying.groups import merge_sets
from flying.procs import free_port
from worker_ext.comm_pool import CommPool


def test_merge_sets_are_linear_aligned_ranges():
    assert merge_sets(1) == []
    assert merge_sets(2) == [(0, 1)]
    assert merge_sets(4) == [(0, 1), (2, 3), (0, 1, 2, 3)]
    assert merge_sets(6) == [(0, 1), (2, 3), (4, 5), (0, 1, 2, 3), (0, 1, 2, 3, 4, 5)]
    assert len(merge_sets(8)) == 7
    assert merge_sets(4, widths=(4,)) == [(0, 1, 2, 3)]
    with pytest.raises(ValueError):
        merge_sets(4, widths=(8,))


def _member(engine, n, port, out):
    pool = CommPool(engine, n, "127.0.0.1", port, timeout_s=5).start()
    pool.ready.wait(60)
    res = {"groups": list(pool.groups), "error": pool.error, "host_bytes": pool.host_bytes}
    for members in pool.groups:
        g = pool.get(members)
        x = torch.tensor([float(engine + 1)])
        g.all_reduce(x)
        plan = g.broadcast_object({"step": 7, "from": engine} if g.rank == 0 else None)
        res[members] = (x.item(), plan)
    out.put((engine, res))


def test_every_engine_builds_its_groups_and_they_work():
    ctx = mp.get_context("spawn")
    out, port, n = ctx.Queue(), free_port(), 4
    procs = [ctx.Process(target=_member, args=(e, n, port, out)) for e in (3, 1, 2, 0)]  # any start order
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert results[0]["groups"] == [(0, 1), (0, 1, 2, 3)]
    assert results[3]["groups"] == [(2, 3), (0, 1, 2, 3)]
    for res in results.values():
        assert res["error"] == ""
        for members in res["groups"]:
            total, plan = res[members]
            assert total == sum(m + 1 for m in members)
            assert plan == {"step": 7, "from": members[0]}  # the leader's plan reached every member


def _dies_or_waits(engine, port, out):
    pool = CommPool(engine, 2, "127.0.0.1", port, timeout_s=3).start()
    pool.ready.wait(60)
    g = pool.get((0, 1))
    if engine == 1:
        out.put("joined")
        return  # the process exits: a dead member
    time.sleep(1)
    t0 = time.monotonic()
    try:
        g.all_reduce(torch.ones(1))
        out.put(("no error", time.monotonic() - t0))
    except RuntimeError as exc:
        out.put(("error", time.monotonic() - t0, str(exc)[:80]))


def test_a_dead_member_is_an_error_within_the_timeout_not_a_hang():
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_dies_or_waits, args=(e, port, out)) for e in (0, 1)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    verdict = next(x for x in got if x != "joined")
    assert verdict[0] == "error" and verdict[1] < 5
