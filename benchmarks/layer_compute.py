"""The compute side of the simulator's cost model, measured on one GPU: a Llama-3-70B decoder layer (bf16) run as
a DP engine runs it, as one rank of TP8 runs it (1/8 of the heads and of the MLP, every token) and as one rank of
SP8 runs it (full weights on 1/8 of the tokens, attention over 1/8 of the heads for every token, as after
Ulysses' all-to-all), for one prompt, and a decode step of a few sequences. Times are per layer x 80 layers, with
no collective: what is left is each layout's GEMM and attention efficiency, which the cost model takes as perfect
(a TP8 rank's prefill costs 1/8 of DP's). The ratios are set beside the cost model's compute-only ratios and the
Shift Parallelism paper's measured TTFT ratios (collectives included there).

    python benchmarks/layer_compute.py [--reps 10] [--out results/layer_compute.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flying.cost_model import H200_LLAMA70B  # noqa: E402

HIDDEN, INTER, Q_HEADS, KV_HEADS, HEAD_DIM, LAYERS = 8192, 28672, 64, 8, 128, 80


class Layer:
    """One decoder layer's weights for a share ``1/shard`` of the heads and of the MLP."""

    def __init__(self, shard: int, dtype: torch.dtype) -> None:
        self.q, self.kv = Q_HEADS // shard, max(1, KV_HEADS // shard)
        inter = INTER // shard
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=dtype) * 0.02  # noqa: E731
        self.w_qkv = mk(HIDDEN, (self.q + 2 * self.kv) * HEAD_DIM)
        self.w_o = mk(self.q * HEAD_DIM, HIDDEN)
        self.w_gate_up = mk(HIDDEN, 2 * inter)
        self.w_down = mk(inter, HIDDEN)

    def linear_part(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.w_gate_up).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.w_down

    def inputs(self, tokens: int, attend: tuple[int, int, int, int]) -> tuple[torch.Tensor, ...]:
        """Activations for ``tokens`` through the linear layers and an attention of shape ``attend``: (batch,
        query heads, query tokens, key tokens) with ``1/shard`` of the KV heads."""
        b, heads, q_len, k_len = attend
        kv = max(1, heads * KV_HEADS // Q_HEADS)
        r = lambda *s: torch.randn(*s, device="cuda", dtype=self.w_o.dtype)  # noqa: E731
        return (
            r(tokens, HIDDEN),
            r(b, heads, q_len, HEAD_DIM),
            r(b, kv, k_len, HEAD_DIM),
            r(tokens, self.q * HEAD_DIM),
        )

    def run(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, o: torch.Tensor) -> None:
        x @ self.w_qkv  # noqa: B018
        F.scaled_dot_product_attention(q, k, k, is_causal=q.shape[2] > 1, enable_gqa=True)
        self.linear_part(o @ self.w_o)


def timed_ms(layer: Layer, inputs: tuple[torch.Tensor, ...], reps: int) -> float:
    """Median time of one layer's pass x 80, replayed from a CUDA graph (as an engine runs its steps, so kernel
    launches do not count)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            layer.run(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.run(*inputs)
    times = []
    for _ in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:]) * LAYERS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--prompts", default="512,4096,16384", help="prompt lengths, comma-separated")
    ap.add_argument("--out", type=Path, default=Path("results/layer_compute.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    dt = torch.bfloat16
    full, eighth = Layer(1, dt), Layer(8, dt)
    m = H200_LLAMA70B
    rows: dict[str, dict[str, float]] = {}
    for t in map(int, args.prompts.split(",")):
        dp = timed_ms(full, full.inputs(t, (1, Q_HEADS, t, t)), args.reps)
        tp8 = timed_ms(eighth, eighth.inputs(t, (1, Q_HEADS // 8, t, t)), args.reps)
        sp8 = timed_ms(full, full.inputs(-(-t // 8), (1, Q_HEADS // 8, t, t)), args.reps)
        body = lambda tokens, w: max(m.weight_read_ms, tokens * m.prefill_ms_per_token) / w  # noqa: E731
        rows[f"prefill {t}"] = {
            "dp_ms": dp,
            "tp8_rank_ms": tp8,
            "sp8_rank_ms": sp8,
            "tp8/sp8": tp8 / sp8,
            "dp/sp8": dp / sp8,
            "model tp8/sp8 (compute only)": body(t, 8)
            / max(m.weight_read_ms, -(-t // 8) * m.prefill_ms_per_token),
            "model dp/sp8 (compute only)": body(t, 1)
            / max(m.weight_read_ms, -(-t // 8) * m.prefill_ms_per_token),
        }
    for seqs in (4, 64, 256):
        dp = timed_ms(full, full.inputs(seqs, (seqs, Q_HEADS, 1, 1200)), args.reps)
        tp8 = timed_ms(eighth, eighth.inputs(seqs, (seqs, Q_HEADS // 8, 1, 1200)), args.reps)
        rows[f"decode {seqs} x 1200"] = {"dp_ms": dp, "tp8_rank_ms": tp8, "dp/tp8": dp / tp8}
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dtype": "bfloat16",
        "rows": rows,
    }
    print(json.dumps(out, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
