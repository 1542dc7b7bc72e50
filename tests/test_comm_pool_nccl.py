"""The communicator pool's GPU path: data groups on NCCL, driven by the same code the bound workers run (pooled
collectives, sequence-parallel all-to-alls, the KV head-slice exchange, reset and rebuild). Skipped without CUDA.
One GPU runs the single-member groups (NCCL refuses two ranks on one device); two GPUs also run a two-member group
across processes."""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from flying.procs import free_port
from worker_ext import kv_transform
from worker_ext.comm_pool import CommPool
from worker_ext.sequence_parallel import TokenSplit, gather_tokens, heads_of_all_tokens, tokens_of_all_heads

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the NCCL path)")
two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two GPUs: NCCL puts one rank per device"
)


def _single(watch_s: float = 0.2) -> CommPool:
    pool = CommPool(
        0, 1, "127.0.0.1", free_port(), sets=[(0,)], device="cuda:0", timeout_s=30, watch_s=watch_s
    )
    pool.start()
    assert pool.ready.wait(60), "the pool never finished building"
    assert pool.error == "", pool.error
    return pool


def test_an_nccl_group_is_connected_at_build_and_its_collectives_run_on_the_device():
    pool = _single()
    assert (0,) in pool.connect_ms, "the NCCL communicator was not created at build"
    g = pool.get((0,))
    x = torch.arange(6, dtype=torch.float32, device="cuda")
    assert torch.equal(g.all_reduce(x.clone()), x)
    inp = torch.randn(5, 3, device="cuda")
    out = torch.empty_like(inp)
    g.all_to_all(out, inp, [5], [5])
    assert torch.equal(out, inp)
    got = [torch.empty(4, device="cuda")]
    g.all_gather(got, torch.ones(4, device="cuda"))
    assert torch.equal(got[0], torch.ones(4, device="cuda"))
    assert set(g.spent_ms) == {"all_reduce", "all_to_all", "all_gather"}
    assert g.broadcast_object({"plan": 1}) == {"plan": 1}  # control stays on gloo, on the host


def test_sequence_parallel_exchanges_run_over_nccl():
    g = _single().get((0,))
    split = TokenSplit(7, 1)
    q, k, v = (torch.randn(7, n, device="cuda") for n in (8, 4, 4))
    q2, k2, v2 = heads_of_all_tokens([q, k, v], split, 0, g)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)
    assert torch.equal(tokens_of_all_heads(q2, split, 0, g), q)
    assert torch.equal(gather_tokens(q, split, g), q)


def test_the_kv_head_slice_exchange_moves_device_slots_over_nccl():
    g = _single().get((0,))
    k = [torch.randn(32, 2, 4, device="cuda") for _ in range(3)]
    v = [torch.randn(32, 2, 4, device="cuda") for _ in range(3)]
    want = [(kl[[1, 2, 3]].clone(), vl[[1, 2, 3]].clone()) for kl, vl in zip(k, v)]
    ex = kv_transform.Exchange(1, [[torch.tensor([1, 2, 3])]], [[torch.tensor([20, 21, 22])]])
    stats = kv_transform.run_exchange(g.data, 0, ex, k, v)
    for (kl, vl), (wk, wv) in zip(zip(k, v), want):
        assert torch.equal(kl[[20, 21, 22]], wk) and torch.equal(vl[[20, 21, 22]], wv)
    assert stats.tokens == 0 and stats.peak_bytes > 0  # a local copy: nothing left the rank


def test_a_reset_aborts_the_nccl_communicator_and_every_member_rebuilds_it():
    assert callable(getattr(dist.ProcessGroupNCCL, "abort", None)), "MergedGroup.close() relies on abort()"
    pool = _single()
    g = pool.get((0,))
    pool.reset(g, 3)
    with pytest.raises(RuntimeError, match="closed after a failed epoch"):
        g.all_reduce(torch.ones(1, device="cuda"))
    with pytest.raises(RuntimeError, match="being rebuilt"):
        pool.get((0,))
    deadline = time.monotonic() + 30
    while pool.reset_for.get((0,)) != 3:
        assert time.monotonic() < deadline, "never rebuilt"
        time.sleep(0.05)
    x = torch.full((2,), 5.0, device="cuda")
    assert torch.equal(pool.get((0,)).all_reduce(x), torch.full((2,), 5.0, device="cuda"))


def _pair(engine: int, port: int, out) -> None:
    try:
        torch.cuda.set_device(engine)
        pool = CommPool(
            engine, 2, "127.0.0.1", port, device=f"cuda:{engine}", timeout_s=20, watch_s=0.2
        ).start()
        assert pool.ready.wait(120) and pool.error == "", pool.error
        g = pool.get((0, 1))
        x = torch.full((3,), float(engine + 1), device="cuda")
        g.all_reduce(x)
        rows = [2, 5] if engine == 0 else [4, 1]  # uneven splits both ways
        inp = torch.arange(sum(rows), dtype=torch.float32, device="cuda").unsqueeze(1) + 100 * engine
        recv = [2, 4] if engine == 0 else [5, 1]
        got = torch.empty(sum(recv), 1, device="cuda")
        g.all_to_all(got, inp, recv, rows)
        blocked = 0.0
        if engine == 1:  # blocked in a collective its peer abandons: fails once the peer resets, not at 20 s
            t0 = time.monotonic()
            try:
                g.all_reduce(torch.ones(1, device="cuda"))
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - what is checked is how soon it fails
                pass
            blocked = time.monotonic() - t0
        else:
            time.sleep(1)
            pool.reset(g, 9)
        out.put((engine, x.tolist(), got.squeeze(1).tolist(), blocked))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((engine, "error", traceback.format_exc(), 0.0))


@two_gpus
@pytest.mark.slow
def test_a_two_gpu_pooled_group_reduces_exchanges_and_fails_fast_on_reset():
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_pair, args=(e, port, out)) for e in (0, 1)]
    for p in procs:
        p.start()
    got = {e: rest for e, *rest in (out.get(timeout=180) for _ in procs)}
    for p in procs:
        p.join(30)
    assert got[0][0] == [3.0] * 3 and got[1][0] == [3.0] * 3, got
    assert got[0][1] == [0.0, 1.0, 100.0, 101.0, 102.0, 103.0]  # rank 0: its first 2 rows, rank 1's first 4
    assert got[1][1] == [2.0, 3.0, 4.0, 5.0, 6.0, 104.0]
    assert got[1][2] < 15, f"the blocked peer failed after {got[1][2]:.1f} s (timeout 20 s)"
