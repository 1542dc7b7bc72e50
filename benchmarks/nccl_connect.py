"""What a bound group's first collective costs on GPU, with and without the pool connecting NCCL at build.

ProcessGroupNCCL creates its NCCL communicator lazily, at the first collective. The pool (worker_ext.comm_pool)
connects each data group at build instead, off the serving path. This measures, on one GPU (single-member groups,
since NCCL puts one rank per device): a bare ProcessGroupNCCL's first and second all-reduce, and a pooled group's
connect time at build and its first all-reduce after it. It also records whether NCCL accepts two ranks on one
device (it should refuse).

    python benchmarks/nccl_connect.py [--rounds 5] [--out results/nccl_connect.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flying.procs import free_port  # noqa: E402
from worker_ext.comm_pool import CommPool  # noqa: E402


def _allreduce_ms(pg: dist.ProcessGroup | dist.ProcessGroupNCCL) -> float:
    x = torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    cast(dist.ProcessGroup, pg).allreduce([x]).wait()  # (torch's stubs declare it on ProcessGroup only)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000


def bare(port: int) -> tuple[float, float]:
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    pg = dist.ProcessGroupNCCL(dist.PrefixStore("bare", store), 0, 1, dist.ProcessGroupNCCL.Options())
    return _allreduce_ms(pg), _allreduce_ms(pg)


def pooled(port: int) -> tuple[float, float]:
    pool = CommPool(0, 1, "127.0.0.1", port, sets=[(0,)], device="cuda:0", timeout_s=60)
    pool.build()
    if pool.error:
        raise RuntimeError(pool.error)
    return pool.connect_ms[(0,)], _allreduce_ms(pool.get((0,)).data)


def _duplicate_rank(rank: int, port: int, out) -> None:
    try:
        torch.cuda.set_device(0)
        store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
        opts = dist.ProcessGroupNCCL.Options()
        pg = dist.ProcessGroupNCCL(dist.PrefixStore("dup", store), rank, 2, opts)
        x = torch.ones(1, device="cuda")
        cast(dist.ProcessGroup, pg).allreduce([x]).wait(timedelta(seconds=20))
        torch.cuda.synchronize()
        out.put((rank, f"accepted: {x.item()}"))
    except Exception as exc:  # noqa: BLE001 - the answer is the error
        out.put((rank, f"{type(exc).__name__}: {str(exc).splitlines()[-1][:160]}"))


def duplicate_gpu() -> dict[int, str]:
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_duplicate_rank, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            r, what = out.get(timeout=60)
            got[r] = what
    except Exception:  # noqa: BLE001 - a hang is an answer too
        got.setdefault(0, "no answer in 60 s")
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    # each round in a fresh process: NCCL's one-time library setup would otherwise favour the later rounds
    ctx = mp.get_context("spawn")
    rows: dict[str, list[tuple[float, float]]] = {"bare": [], "pooled": []}
    with ctx.Pool(1, maxtasksperchild=1) as procs:
        for _ in range(a.rounds):
            for kind, fn in (("bare", bare), ("pooled", pooled)):
                rows[kind].append(procs.apply(fn, (free_port(),)))
    med = {k: [statistics.median(c) for c in zip(*v)] for k, v in rows.items()}
    result = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "rounds": a.rounds,
        "bare_first_allreduce_ms": med["bare"][0],
        "bare_second_allreduce_ms": med["bare"][1],
        "pooled_connect_at_build_ms": med["pooled"][0],
        "pooled_first_allreduce_ms": med["pooled"][1],
        "raw": rows,
        "two_ranks_one_gpu": duplicate_gpu(),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)


if __name__ == "__main__":
    main()
