"""The step-time cost model the router's planner and the simulator share: how long one unit's step takes.

A continuous-batching step at width ``w`` costs a fixed overhead, the model's weight read (memory-bound, split
over ``w`` GPUs) or its prefill compute, whichever is larger, the attention/KV read of the decoding sequences, the
prefill chunks' attention (quadratic in a prompt: each chunk attends to the tokens before it), and ``log2(w)``
all-reduce rounds. Merged groups (dynamic binding) pay ``merged_overhead`` on top of the static TP
layout they emulate.

The default, :data:`H200_LLAMA70B`, is one H200 per engine serving Llama-3-70B (FP8 weights, about 70 GB), set so
the model reproduces the published numbers it can be checked against (see :func:`calibration`):

- paper Table 1 (Llama-70B, 8x H200, 3-5 req/s): mean TPOT static DP 32 ms, static TP 22 ms; peak throughput
  static TP / static DP = 2530 / 3164 tokens/s (per-sequence host work, which TP does not split, and the all-reduces set this);
- paper section 6.4: a live switch takes about 15 ms (bind and release);
- prior-art notes (published Flying Serving code, Llama-3-70B): a merged width-2 group costs about 1 % TPOT over
  the static layout;
- KV capacity: 141 GB - 70 GB weights - activations, at 160 KB per token (80 layers x 8 KV heads x 128 x K,V,
  FP8): about 350 K tokens per GPU;
- prefill attention: 4.4 ms per million (query, key) pairs at width 1 (80 layers x 64 heads x 128 x 4 FLOPs a
  pair at about 600 TFLOP/s of bf16 flash attention), which with GEMMs at bf16 reproduces one H200's measured
  prefill of 16,384 against 4,096 tokens (``benchmarks/layer_compute.py``). A 4,096-token prompt's attention is
  8 % of its prefill; a 500,000-token prompt's is about 550 GPU-seconds, ten times its GEMMs.

KV transformation costs are the router's own model (:mod:`router.transform_cost`); the simulator charges them
the same way.

Shift Parallelism (seed 001; the ``shift`` system of the simulator) runs one scheduler over ``sp`` GPUs
in two configurations that share one KV layout (every GPU holds ``1/sp`` of the KV heads of every token):

- base, Ulysses sequence parallelism (:meth:`CostModel.sp_step_ms`): every GPU runs ``1/sp`` of the step's tokens
  (padded to a multiple of ``sp``) through the *full* weights, so it stays weight-read-bound like a DP engine;
  attention reads ``1/sp`` of the context; two all-to-alls per layer cost a latency term and ``1/sp`` of TP's
  volume (seed 001, Table 2); the one scheduler keeps a share of the per-sequence host work
  (``sp_host_ms_per_seq``, the rest is split over the ranks), set so the saturated throughput per GPU is 0.82 of
  DP: the Shift Parallelism paper's own figure (SP and Shift lose 17-18 % against DP on Llama-70B, section 4.3) and
  Flying Serving's (1.22x lower peak throughput than Flying Serving);
- shift, full TP over the same ``sp`` GPUs (:meth:`CostModel.step_ms` at width ``sp``, a static layout: a second,
  TP-sharded copy of the weights), taken when the step batches at most the threshold's tokens (256 in the docs,
  512 in the code);
- memory (:meth:`CostModel.shift_kv_tokens`): the second copy costs ``1/sp`` of the weights on every GPU (seed 001,
  eq. 1: 8.75 GB at SP 8 here), KV the engines do not have.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple


def kv_transform_ms(
    moved: list[tuple[float, float]], bytes_per_token: int, gbps: float, fixed_ms: float, overlap: float = 0.0
) -> float:
    """Fixed cost + the busiest member's moved bytes (max of sent and received) over the link bandwidth; members
    exchange in parallel. ``moved``: (sent, received) KV tokens per member, as whole-token equivalents."""
    busiest = max((max(s, r) for s, r in moved), default=0.0)
    if busiest <= 0:
        return fixed_ms
    return fixed_ms + (1 - overlap) * busiest * bytes_per_token / (gbps * 1e9) * 1000


@dataclass(frozen=True)
class CostModel:
    name: str = "H200 / Llama-3-70B FP8"
    overhead_ms: float = 3.5  # scheduling, sampling, kernel launches per step
    weight_read_ms: float = 26.0  # one full pass over the weights at width 1 (memory-bound decode)
    prefill_ms_per_token: float = 0.11  # compute per token at width 1 (prefill, and decode at large batches)
    # per decoding sequence: scheduling, sampling (host side: not split by TP)
    decode_ms_per_seq: float = 0.06
    kv_ms_per_1k_tokens: float = 0.12  # attention: reading 1000 tokens of context at width 1
    allreduce_ms: float = 4.0  # per log2(width) round, all layers of one step: latency ...
    # ... and volume (hidden-size activations of every token, every layer)
    allreduce_ms_per_token: float = 0.008
    merged_overhead: float = 0.01  # a dynamically merged group vs a static TP engine of the same width
    switch_ms: float = 15.0  # bind or release, once every member is at its step boundary
    kv_tokens: int = 350_000  # KV cache per engine
    max_running: int = 256  # requests one engine (or group) runs at once
    chunk_tokens: int = 8192  # prefill tokens per step (chunked prefill)
    kv_bytes_per_token: int = 163_840  # 80 layers x 8 KV heads x 128 x (K, V) x 1 byte (FP8)
    link_gbps: float = 360.0  # KV head slices between the members of a group, per member and direction (GB/s)
    transform_fixed_ms: float = 4.0  # per KV transformation (adopt or scatter), see router.transform_cost
    transform_overlap: float = 0.0  # share of the bytes term hidden behind compute (Gyges' overlap: 0.86)
    weight_gb: float = 70.0  # one full copy of the weights (Shift Parallelism keeps a second, TP-sharded one)
    # Ulysses' all-to-alls, all layers of one step: latency, as one all-reduce round
    sp_alltoall_ms: float = 4.0
    # ... and volume per token of a member's slice (as an all-reduce's)
    sp_alltoall_ms_per_token: float = 0.008
    # per sequence: the one SP scheduler's unsplit host work (calibrated, above)
    sp_host_ms_per_seq: float = 0.006
    # prefill attention: per million (query, key) pairs at width 1, all layers (bf16 flash attention at about
    # 600 TFLOP/s: 80 layers x 64 heads x 128 x 4 FLOPs a pair; the H200 measurement in docs/benchmarks.md agrees)
    prefill_attn_ms_per_mpair: float = 4.4

    def transform_ms(self, moved: list[tuple[float, float]]) -> float:
        """One KV transformation: ``moved`` holds each member's (sent, received) KV tokens, counted as head slices
        (a token's slice at width d is 1/d of a token: pass tokens x fraction)."""
        return kv_transform_ms(
            moved, self.kv_bytes_per_token, self.link_gbps, self.transform_fixed_ms, self.transform_overlap
        )

    def attn_ms(self, pairs: float) -> float:
        """Prefill attention at width 1 for ``pairs`` (query, key) pairs (:func:`causal_pairs`): quadratic in the
        prompt, it is most of a long prompt's cost."""
        return pairs / 1e6 * self.prefill_attn_ms_per_mpair

    def step_ms(
        self,
        width: int,
        prefill_tokens: int,
        decode_seqs: int,
        context_tokens: int,
        merged: bool,
        attn_pairs: float = 0.0,
    ) -> float:
        w = width
        tokens = prefill_tokens + decode_seqs
        body = max(self.weight_read_ms, tokens * self.prefill_ms_per_token) / w  # memory- or compute-bound
        body += context_tokens / 1000 * self.kv_ms_per_1k_tokens / w + decode_seqs * self.decode_ms_per_seq
        body += self.attn_ms(attn_pairs) / w  # heads split over the group
        comm = (self.allreduce_ms + tokens * self.allreduce_ms_per_token) * math.log2(w) if w > 1 else 0.0
        t = self.overhead_ms + body + comm
        return t * (1 + self.merged_overhead) if merged and w > 1 else t

    def sp_step_ms(
        self, sp: int, prefill_tokens: int, decode_seqs: int, context_tokens: int, attn_pairs: float = 0.0
    ) -> float:
        """One step of Shift Parallelism's base configuration, sequence parallelism over ``sp`` GPUs."""
        per_gpu = -(-(prefill_tokens + decode_seqs) // sp)  # each rank's slice, padded
        # every rank reads all the weights
        body = max(self.weight_read_ms, per_gpu * self.prefill_ms_per_token)
        body += context_tokens / 1000 * self.kv_ms_per_1k_tokens / sp  # head-parallel attention
        body += self.attn_ms(attn_pairs) / sp
        host = decode_seqs * (self.decode_ms_per_seq / sp + self.sp_host_ms_per_seq)
        comm = self.sp_alltoall_ms + per_gpu * self.sp_alltoall_ms_per_token
        return self.overhead_ms + body + host + comm

    def mixed_step_ms(
        self,
        sp: int,
        local: tuple[int, int, int],
        group: tuple[int, int, int],
        attn_pairs: tuple[float, float] = (0.0, 0.0),
    ) -> float:
        """One member's share of a bound group's *mixed* step: its own DP work ``local`` (prefill tokens, decoding
        sequences, their context) and its slice of the group's ``group`` in sequence parallelism, in one pass over
        its full weights; the all-to-alls carry the group's tokens only (the member's own attend to its own KV)."""
        lp, ld, lctx = local
        gp, gd, gctx = group
        per_gpu = -(-(gp + gd) // sp)  # its slice of the group's tokens, padded
        body = max(self.weight_read_ms, (lp + ld + per_gpu) * self.prefill_ms_per_token)
        body += lctx / 1000 * self.kv_ms_per_1k_tokens + gctx / 1000 * self.kv_ms_per_1k_tokens / sp
        body += self.attn_ms(attn_pairs[0]) + self.attn_ms(attn_pairs[1]) / sp  # (local, group) prefill pairs
        host = ld * self.decode_ms_per_seq + gd * (self.decode_ms_per_seq / sp + self.sp_host_ms_per_seq)
        comm = self.sp_alltoall_ms + per_gpu * self.sp_alltoall_ms_per_token
        return self.overhead_ms + body + host + comm

    def group_step_ms(
        self,
        width: int,
        sp_threshold: int,
        prefill_tokens: float,
        decode_seqs: float,
        context_tokens: float,
        attn_pairs: float = 0.0,
    ) -> float:
        """One step of a unit the router can form: a DP engine (width 1), or a bound group of ``width`` whose steps
        of at least ``sp_threshold`` batched tokens run sequence-parallel and smaller ones merged TP (0: TP only),
        as the workers choose (worker_ext.sequence_parallel)."""
        tokens = prefill_tokens + decode_seqs
        if width > 1 and sp_threshold and tokens >= max(sp_threshold, width):
            return self.sp_step_ms(
                width, int(prefill_tokens), int(decode_seqs), int(context_tokens), attn_pairs
            )
        return self.step_ms(
            width, int(prefill_tokens), int(decode_seqs), int(context_tokens), True, attn_pairs
        )

    def shift_step_ms(
        self,
        sp: int,
        threshold: int,
        prefill_tokens: int,
        decode_seqs: int,
        context_tokens: int,
        attn_pairs: float = 0.0,
    ) -> tuple[float, bool]:
        """(ms, shifted): full TP over the ``sp`` GPUs when the step batches at most ``threshold`` tokens (the
        shift configuration), else sequence parallelism (the base configuration)."""
        if prefill_tokens + decode_seqs <= threshold:
            return self.step_ms(sp, prefill_tokens, decode_seqs, context_tokens, False, attn_pairs), True
        return self.sp_step_ms(sp, prefill_tokens, decode_seqs, context_tokens, attn_pairs), False

    def shift_kv_tokens(self, sp: int) -> int:
        """KV tokens per GPU under Shift Parallelism: the TP-sharded second copy (1/sp of the weights) is resident
        too."""
        return self.kv_tokens - int(self.weight_gb * 1e9 / sp / self.kv_bytes_per_token)


def causal_pairs(before: int, tokens: int) -> float:
    """The (query, key) pairs a prefill chunk of ``tokens`` attends over after ``before`` tokens of its sequence:
    each to all before it and, causally, to each other (a whole prompt of ``n``: ``causal_pairs(0, n)``)."""
    return tokens * (before + tokens / 2)


H200_LLAMA70B = CostModel()

# A CPU engine before any of its steps was measured (router.cost_fit replaces it with the fitted curves): compute
# grows with the batched tokens, a group's collectives go over loopback TCP and cost far more than on NVLink, so a
# group wins on long prompts only (docs/benchmarks.md, "Sequence-parallel prefill in a bound group": a pair
# prefills 4,096 tokens 1.55x faster in SP than one engine, 512 tokens about as fast).
CPU_PRIOR = CostModel(
    name="CPU (prior)",
    overhead_ms=10.0,
    weight_read_ms=0.0,
    prefill_ms_per_token=0.5,
    decode_ms_per_seq=0.0,
    kv_ms_per_1k_tokens=0.0,
    allreduce_ms=20.0,
    allreduce_ms_per_token=0.1,
    merged_overhead=0.0,
    switch_ms=20.0,
    kv_tokens=131_072,
    max_running=64,
    chunk_tokens=8192,
    kv_bytes_per_token=8192,  # (a small model's: 4 layers x K, V x 4 KV heads x 64 x fp32)
    link_gbps=0.3,  # gloo over loopback TCP
    transform_fixed_ms=10.0,
    sp_alltoall_ms=10.0,
    sp_alltoall_ms_per_token=0.2,
    sp_host_ms_per_seq=0.0,
    prefill_attn_ms_per_mpair=0.0,
)


# --cost NAME=FACTOR: a collective's cost scaled (every field of it), for the sensitivity table
COST_FACTORS: dict[str, tuple[str, ...]] = {
    "allreduce": ("allreduce_ms", "allreduce_ms_per_token"),
    "alltoall": ("sp_alltoall_ms", "sp_alltoall_ms_per_token"),
}


POSITIVE_COSTS = (
    "weight_read_ms",
    "kv_tokens",
    "max_running",
    "chunk_tokens",
    "kv_bytes_per_token",
    "link_gbps",
    "weight_gb",
)


def with_overrides(m: CostModel, text: str) -> CostModel:
    """``allreduce=2,alltoall=0.5`` (factors: :data:`COST_FACTORS`) or ``FIELD=VALUE`` (a field's new value,
    e.g. ``switch_ms=30``), comma-separated -> ``m`` changed so."""
    fields = {f.name: f.type for f in dataclasses.fields(CostModel)}
    changes: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        try:
            x = float(value)
        except ValueError:
            raise ValueError(f"--cost {item!r}: expected NAME=NUMBER") from None
        if not x >= 0:
            raise ValueError(f"--cost {item!r}: a cost or a factor is at least 0")
        if name in COST_FACTORS:
            changes |= {f: getattr(m, f) * x for f in COST_FACTORS[name]}
        elif name in fields and name != "name":
            changes[name] = int(x) if fields[name] in (int, "int") else x
        else:
            known = ", ".join([*COST_FACTORS, *(f for f in fields if f != "name")])
            raise ValueError(f"--cost {item!r}: unknown {name!r} (one of {known})")
    if zero := [f for f in POSITIVE_COSTS if changes.get(f, 1) <= 0]:
        raise ValueError(f"--cost {text!r}: {', '.join(zero)} must be above 0")
    if changes.get("transform_overlap", 0) > 1:
        raise ValueError(f"--cost {text!r}: transform_overlap is a share, 0 to 1")
    return dataclasses.replace(m, name=f"{m.name} ({text})", **changes) if changes else m


class Point(NamedTuple):
    """One calibration point: the model's value, the published one, and whether the model is set to meet it
    (within a tenth) or only reports it."""

    what: str
    model: float
    published: float
    followed: bool = True


def calibration(m: CostModel = H200_LLAMA70B) -> list[Point]:
    """(what, this model, published) for the points the model is set against: Flying Serving's (Table 1, section
    6.4) and Shift Parallelism's (seed 001: Figure 1 and section 4, Llama-70B on 8 GPUs: one 4,096-token prompt's
    TTFT at low traffic, TP8 1.56x and DP 6x SP8's; saturated throughput per GPU against DP, TP8 0.54, SP8 0.82).
    The model follows Flying Serving's where the two cannot both be met: its TP side is set by TP2's decode
    (Table 1), which puts TP8's all-reduces (three rounds) above what seed 001 measured. The prefill attention
    term is checked against one H200's bf16 prefill of a 70B layer stack at 4,096 and 16,384 tokens (the linear
    part at bf16, twice the FP8 cost)."""
    ctx = 4 * 1200  # four sequences of about 1200 tokens decoding (3-5 req/s, Table 1)
    dp = m.step_ms(1, 0, 4, ctx, merged=False)
    tp = m.step_ms(2, 0, 4, ctx, merged=False)
    merged = m.step_ms(2, 0, 4, ctx, merged=True)

    def sat(w: int) -> float:
        return w * m.max_running / m.step_ms(w, 0, w * m.max_running, w * m.max_running * 1200, False)

    n = 8 * m.max_running  # Shift Parallelism's base config, SP 8, as busy per GPU as a saturated DP engine
    sp8 = n / m.sp_step_ms(8, 0, n, n * 1200)
    prompt = 4096  # one request at low traffic: its TTFT is one prefill step
    ttft = {
        "dp": m.step_ms(1, prompt, 0, 0, False, causal_pairs(0, prompt)),
        "tp8": m.step_ms(8, prompt, 0, 0, False, causal_pairs(0, prompt)),
        "sp8": m.sp_step_ms(8, prompt, 0, 0, causal_pairs(0, prompt)),
    }
    bf16 = dataclasses.replace(m, prefill_ms_per_token=2 * m.prefill_ms_per_token)  # the measurement's GEMMs

    def alone(n: int) -> float:  # one prompt's prefill
        return bf16.step_ms(1, n, 0, 0, False, causal_pairs(0, n))

    paper = "Shift Parallelism paper: "  # seed 001
    return [
        Point("saturated throughput per GPU, static TP2 / DP", sat(2) / 2 / sat(1), 2530 / 3164),
        Point(f"{paper}saturated throughput per GPU, TP8 / DP", sat(8) / 8 / sat(1), 0.54, False),
        Point("saturated throughput per GPU, SP8 (shift's base) / DP", sp8 / 8 / sat(1), 0.82),
        Point(f"{paper}TTFT of one 4,096-token prompt, TP8 / SP8", ttft["tp8"] / ttft["sp8"], 1.56, False),
        Point(f"{paper}TTFT of one 4,096-token prompt, DP / SP8", ttft["dp"] / ttft["sp8"], 6.0, False),
        Point(
            "prefill of 16,384 / 4,096 tokens, one H200, bf16 (benchmarks/layer_compute.py)",
            alone(16384) / alone(4096),
            4171.1 / 933.8,
        ),
        Point("TPOT static DP, 4 running (ms)", dp, 32.0),
        Point("TPOT static TP2, 4 running (ms)", tp, 22.0),
        Point("merged TP2 / static TP2 TPOT", merged / tp, 1.01),
        Point("switch (ms)", m.switch_ms, 15.0),
        Point("KV transformation, fixed part (ms; Gyges' basic 3.15-4)", m.transform_fixed_ms, 4.0),
    ]
