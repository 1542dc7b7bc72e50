"""The resident weight layout on one Llama layer (hidden 2048, fp32): what a switch costs and what the forward pays.

* switch: a bind to width 2 and the release, which only re-point views, against the per-switch in-place reorder of
  the fused QKV and gate_up weights that the resident layout replaced (issue 3's design, timed here as that pass);
* forward: per projection (fused QKV, gate_up), one GEMM on the resident rows plus the activation order that puts
  the output back in stock column order, against the same GEMM on stock-ordered weights (stock tp=1 in DP mode,
  stock ``--tp 2``'s contiguous shard at width 2); the results are checked bit-identical.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/weight_variants.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from worker_ext.sglang_patches.model import LayerWeights
from worker_ext.weights import (
    Dims,
    WeightsManager,
    megatron_gate_up_rows,
    megatron_qkv_rows,
)


def bench(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    torch.manual_seed(0)
    hidden, d = 2048, Dims(num_heads=16, num_kv_heads=4, head_dim=128, intermediate=5632)
    qkv = torch.randn(d.q_rows + 2 * d.kv_rows, hidden)
    gate_up = torch.randn(2 * d.intermediate, hidden)
    param = lambda t: torch.nn.Parameter(t.clone(), requires_grad=False)  # noqa: E731
    lw = LayerWeights(
        param(qkv),
        param(torch.randn(hidden, d.q_rows)),
        param(gate_up),
        param(torch.randn(hidden, d.intermediate)),
    )
    t0 = time.perf_counter()
    m = WeightsManager([lw], d)
    load_ms = (time.perf_counter() - t0) * 1000
    bind = bench(lambda: (m.activate(2, 0), m.release()), reps=200)
    order = torch.randperm(qkv.shape[0]), torch.randperm(gate_up.shape[0])
    scratch = qkv.clone(), gate_up.clone()
    reorder = bench(lambda: [w.copy_(w.index_select(0, o)) for w, o in zip(scratch, order)], reps=5)
    print(
        f"one layer, fused QKV {tuple(qkv.shape)} + gate_up {tuple(gate_up.shape)} fp32 ({d.pieces} pieces):\n"
        f"  resident layout at load (once): {load_ms:.1f} ms\n"
        f"  bind to width 2 + release (views only): {bind * 1000:.1f} us\n"
        f"  per-switch in-place reorder it replaces (QKV + gate_up, one direction): {reorder:.1f} ms"
    )
    print(
        f"{'mode':>6} {'proj':>8} {'tokens':>6} {'stock GEMM':>11} {'resident GEMM + order':>22} {'order alone':>12}"
    )
    for width, megatron in ((1, None), (2, (megatron_qkv_rows(d, 2, 0), megatron_gate_up_rows(d, 2, 0)))):
        m.activate(width, 0)
        act = m.activation_order(width)
        projs = (
            ("qkv", qkv, lw.qkv.data, act.qkv_out, 0),
            ("gate_up", gate_up, lw.gate_up.data, act.gate_up_out, 1),
        )
        for name, full, resident, undo, i in projs:
            stock = full if megatron is None else full[megatron[i]].contiguous()
            for tokens in (1, 16, 256):
                x = torch.randn(tokens, hidden)
                if not torch.equal(undo(F.linear(x, resident)), F.linear(x, stock)):
                    raise RuntimeError(
                        f"{name} at width {width}: the resident weights do not reproduce stock"
                    )
                y = F.linear(x, resident)
                a = bench(lambda x=x, w=stock: F.linear(x, w))
                b = bench(lambda x=x, w=resident, u=undo: u(F.linear(x, w)))
                c = bench(lambda y=y, u=undo: u(y), reps=200)
                mode = "DP" if width == 1 else f"TP{width}"
                print(f"{mode:>6} {name:>8} {tokens:>6} {a:>11.3f} {b:>22.3f} {c:>12.3f}")
    m.release()
    print("median ms; bit-identical results checked for every row")


if __name__ == "__main__":
    main()
