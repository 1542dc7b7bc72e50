"""What the long-context requests of each priority cost the rest of the paper workload in the simulator.

For each seed: static DP on the whole paper workload (it rejects the long requests: 400), then dynamic binding on
the same workload with every long request, with only the high-priority ones (which never wait for calm and are
never parked: they run at once, through a burst), and with none. Prints the rest's (prompts of at most 100K
tokens) burst P90 TTFT against static DP's on the same rest, the long requests' TTFT p50, and what their prefills
alone ask of the node (GPU-seconds of GEMMs and attention over the GPU-seconds of the trace's span)::

    PYTHONPATH=. .venv/bin/python benchmarks/long_priority.py --seeds 0-4

The gap between "high only" and "none" is what serving the high-priority long requests on arrival costs the
bursts; the gap between "all" and "high only" is what the normal-priority ones still cost after waiting for calm
and being parked in bursts.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ProcessPoolExecutor

from sim.cli import LONG_TOKENS, summarize
from sim.config import SimConfig
from sim.seeds import parse_seeds
from sim.simulator import Simulator
from sim.workload import SimRequest, paper_workload, two_level_phase

KEEPS = ("all", "high only", "none")


def kept(reqs: list[SimRequest], keep: str) -> list[SimRequest]:
    if keep == "all":
        return reqs
    return [r for r in reqs if r.prompt <= LONG_TOKENS or (keep == "high only" and r.priority == "high")]


def one_seed(seed: int) -> tuple[int, dict[str, dict], int, dict[str, float]]:
    reqs = paper_workload(seed=seed)
    phase = lambda t: two_level_phase(t, 60.0, 30.0)  # noqa: E731  (paper_workload's low_s and burst_s)
    out = {"dp": summarize(Simulator(SimConfig(mode="dp"), reqs).run(), phase)}
    for keep in KEEPS:
        out[keep] = summarize(Simulator(SimConfig(mode="dynamic"), kept(reqs, keep)).run(), phase)
    high = sum(1 for r in reqs if r.prompt > LONG_TOKENS and r.priority == "high")
    return seed, out, high, demand(reqs)


def demand(reqs: list[SimRequest]) -> dict[str, float]:
    """The long prompts' prefill (GEMMs and attention, GPU-seconds at width 1) as a share of what the node's GPUs
    do over the trace's span: all long requests, and the high-priority ones alone."""
    cfg = SimConfig()
    cost = cfg.cost
    gpu_s = lambda n: (n * cost.prefill_ms_per_token + cost.attn_ms(n * n / 2)) / 1000  # noqa: E731
    span = max(r.at for r in reqs) * cfg.engines
    longs = [r for r in reqs if r.prompt > LONG_TOKENS]
    return {
        "all": sum(gpu_s(r.prompt) for r in longs) / span,
        "high only": sum(gpu_s(r.prompt) for r in longs if r.priority == "high") / span,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0-4", help="FROM-TO or a list")
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args()
    with ProcessPoolExecutor(a.jobs) as pool:
        rows = sorted(pool.map(one_seed, parse_seeds(a.seeds)))
    print(
        "| seed | high-priority long requests | their prefill / the node's GPU time: all / high only "
        "| the rest's burst P90 / static DP's: "
        + " / ".join(KEEPS)
        + " | long TTFT p50 (s): all / high only |"
    )
    print("|---|---|---|---|---|")
    means = {k: 0.0 for k in KEEPS}
    for seed, out, high, share in rows:
        ratio = {k: out[k]["rest_ttft_p90_burst_ms"] / out["dp"]["rest_ttft_p90_burst_ms"] for k in KEEPS}
        for k in KEEPS:
            means[k] += ratio[k] / len(rows)
        p50 = [out[k]["long_ttft_p50_ms"] for k in ("all", "high only")]
        print(
            f"| {seed} | {high} | {share['all']:.2f} / {share['high only']:.2f} | "
            + " / ".join(f"{ratio[k]:.2f}" for k in KEEPS)
            + " | "
            + " / ".join("-" if v is None or v != v else f"{v / 1000:.0f}" for v in p50)
            + " |"
        )
    print("| mean | | | " + " / ".join(f"{means[k]:.2f}" for k in KEEPS) + " | |")


if __name__ == "__main__":
    main()
