"""Weight-shard variants for a bound rank (width 2, rank 0) of one Llama layer's fused QKV projection:

* reorder: rows permuted in place once per switch, the shard is one contiguous block -> one GEMM (chosen);
* view: no reorder; q, k, v shard rows are three separate blocks -> three GEMMs and a concat;
* materialize: a contiguous copy of the shard (one GEMM, but extra weight memory).

    .venv/bin/python benchmarks/weight_variants.py
"""

from __future__ import annotations

import statistics
import time

import torch

from worker_ext.weights import Dims, LayerWeights, WeightsManager


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
    q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    qkv = torch.randn(q + 2 * kv, hidden)
    lw = LayerWeights(
        torch.nn.Parameter(qkv.clone(), requires_grad=False),
        torch.nn.Parameter(torch.randn(hidden, q), requires_grad=False),
        torch.nn.Parameter(torch.randn(2 * d.intermediate, hidden), requires_grad=False),
        torch.nn.Parameter(torch.randn(hidden, d.intermediate), requires_grad=False),
    )
    m = WeightsManager([lw], d)
    t0 = time.perf_counter()
    m.activate(2, 0)
    reorder_ms = (time.perf_counter() - t0) * 1000
    shard = lw.qkv.data
    slices = (qkv[: q // 2], qkv[q : q + kv // 2], qkv[q + kv : q + kv + kv // 2])
    copy = shard.clone()
    print(
        f"fused QKV {tuple(qkv.shape)} fp32, width 2, rank 0; one-time in-place reorder of this layer "
        f"(QKV + gate_up): {reorder_ms:.1f} ms; release back: ",
        end="",
    )
    t0 = time.perf_counter()
    m.release()
    print(f"{(time.perf_counter() - t0) * 1000:.1f} ms")
    m.activate(2, 0)
    print(f"{'tokens':>6} {'reorder (1 GEMM)':>17} {'view (3 GEMMs)':>15} {'materialize':>12}   median ms")
    for tokens in (1, 16, 256):
        x = torch.randn(tokens, hidden)
        a = bench(lambda x=x: torch.nn.functional.linear(x, shard))
        b = bench(lambda x=x: torch.cat([torch.nn.functional.linear(x, w) for w in slices], dim=-1))
        c = bench(lambda x=x: torch.nn.functional.linear(x, copy))
        assert torch.allclose(
            torch.nn.functional.linear(x, shard),
            torch.cat([torch.nn.functional.linear(x, w) for w in slices], -1),
        )
        print(f"{tokens:>6} {a:>17.3f} {b:>15.3f} {c:>12.3f}")
    print(
        f"extra weight memory: reorder 0 B, view 0 B, materialize {copy.numel() * 4 / 2**20:.1f} MiB per layer (QKV alone)"
    )


if __name__ == "__main__":
    main()
