"""The simulator's workloads: :class:`SimRequest` (one request of a trace) and the paper's synthetic two-level
workload (:func:`paper_workload`; :func:`two_level_phase` says which phase a time falls in). The shared-prefix
workload is :mod:`sim.prefix_workload`; a CSV trace is read by :mod:`loadgen.trace`, and so is Mooncake's JSONL,
whose shared prefixes :func:`mooncake_requests` turns into block chains."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flying.prefix import BLOCK
from loadgen.trace import MOONCAKE_BLOCK, MooncakeRow


@dataclass(frozen=True)
class SimRequest:
    at: float
    priority: str
    prompt: int
    output: int
    blocks: tuple[
        int, ...
    ] = ()  # block chain of prompt + answer (flying.prefix; sim.prefix_workload); (): none

    @property
    def prompt_blocks(self) -> tuple[int, ...]:
        return self.blocks[: self.prompt // BLOCK]


def two_level_phase(t: float, low_s: float, burst_s: float) -> str:
    return "burst" if t % (low_s + burst_s) >= low_s else "low"


LOW_RATE = (2.0, 5.0)  # requests per second: the paper's low phase (one node of 8 GPUs) ...
BURST_RATE = (10.0, 30.0)  # ... and its bursts


def paper_workload(
    n: int = 4000,
    seed: int = 0,
    low_rate: tuple[float, float] = LOW_RATE,
    burst_rate: tuple[float, float] = BURST_RATE,
    low_s: float = 60.0,
    burst_s: float = 30.0,
    input_tokens: tuple[int, int] = (512, 4096),
    output_tokens: tuple[int, int] = (64, 512),
    high_share: float = 0.1,
    long_share: float = 0.0025,
    long_input: tuple[int, int] = (400_000, 600_000),
) -> list[SimRequest]:
    """The paper's synthetic workload: Poisson arrivals whose rate alternates between a low phase (2-5 req/s) and
    a burst (10-30 req/s), uniform prompt and output lengths, a share of high-priority and of long-context
    requests (long prompts exceed one engine's KV).

    The paper's token ranges did not survive in our copy of its text. The defaults put the cost model in the regime
    the paper reports: at a burst static TP queues (its per-GPU throughput is 0.78 of DP) while static DP keeps up;
    at low load TP's faster prefill wins. With shorter prompts (256-2048) static TP keeps up with every burst too."""
    from loadgen.arrivals import two_level

    rng = np.random.default_rng(seed)
    times = two_level(n, rng, low_rate, burst_rate, low_s, burst_s, anchor=False)
    out = []
    for t in times:
        long = rng.random() < long_share
        prompt = (
            int(rng.integers(*long_input))
            if long
            else int(rng.integers(input_tokens[0], input_tokens[1] + 1))
        )
        out.append(
            SimRequest(
                at=float(t),
                priority="high" if rng.random() < high_share else "normal",
                prompt=prompt,
                output=int(rng.integers(output_tokens[0], output_tokens[1] + 1)),
            )
        )
    return out


_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: distinct 64-bit block ids from distinct integers."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def mooncake_requests(rows: list[MooncakeRow]) -> list[SimRequest]:
    """Mooncake's rows as requests whose chains share what their hash ids share: each id covers
    ``MOONCAKE_BLOCK / BLOCK`` of our blocks, one distinct id for each; the answer's blocks are the request's own."""
    per = MOONCAKE_BLOCK // BLOCK
    out = []
    for i, r in enumerate(rows):
        ids, total = r.hash_ids, (r.input_tokens + r.output_tokens) // BLOCK
        # a block past the prompt (the answer's) or past the trace's ids is the request's own
        chain = [
            _mix(ids[b // per] * per + b % per)
            if b < r.input_tokens // BLOCK and b // per < len(ids)
            else _mix((1 << 62) | (i << 20) | b)
            for b in range(total)
        ]
        out.append(SimRequest(r.at, "normal", r.input_tokens, r.output_tokens, blocks=tuple(chain)))
    return out
