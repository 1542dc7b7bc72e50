"""What cache-aware dispatch changes in a simulated run: prefix-cache hit rate, TTFT, throughput."""

from __future__ import annotations

import math

from loadgen.metrics import RequestRecord, stats
from sim.simulator import Simulator

Rows = dict[tuple[str, str], dict]  # (system, dispatch rule) -> summarize_prefix


def hit_rate(sim: Simulator, records: list[RequestRecord]) -> float:
    """Prompt tokens the prefix caches held when the served requests started, over their prompt tokens."""
    served = [q for q, r in zip(sim.reqs, records) if r.ok]
    return sum(q.cached for q in served) / max(1, sum(q.spec.prompt for q in served))


def summarize_prefix(sim: Simulator, records: list[RequestRecord]) -> dict:
    """Hit rate: prompt tokens the engines' prefix caches held when their requests started, over all prompt tokens
    served; throughput: output tokens per second from the first arrival to the last finish; by rule: the share of
    DP dispatches each rule placed (router.policy.DpRule)."""
    ok = [r for r in records if r.ok]
    ttft = stats([r.ttft * 1000 for r in ok])
    span = max((r.end for r in ok), default=0.0) - min((r.sent_at for r in ok), default=0.0)
    n = max(1, sum(sim.dp_rules.values()))
    return {
        "served": len(ok),
        "hit_rate": hit_rate(sim, records),
        "ttft_p50_ms": ttft["p50"],
        "ttft_p90_ms": ttft["p90"],
        "tokens_per_s": sum(r.output_tokens for r in ok) / span if span > 0 else math.nan,
        "by_rule": {k: v / n for k, v in sorted(sim.dp_rules.items())},
    }


def prefix_table(rows: Rows) -> str:
    """One line per (system, dispatch) run."""
    lines = [
        "| system | dispatch | hit rate | TTFT p50 (ms) | TTFT p90 (ms) | throughput (tokens/s) | served | DP dispatches by rule |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (system, dispatch), s in rows.items():
        rules = ", ".join(f"{k} {v:.0%}" for k, v in s["by_rule"].items())
        lines.append(
            f"| {system} | {dispatch} | {s['hit_rate']:.3f} | {s['ttft_p50_ms']:,.0f} | "
            f"{s['ttft_p90_ms']:,.0f} | {s['tokens_per_s']:,.0f} | {s['served']} | {rules} |"
        )
    return "\n".join(lines)


def ratios(rows: Rows) -> list[str]:
    """Cache-aware against least-loaded, per system: TTFT p50 and throughput ratios, hit rates."""
    out = []
    for system in dict.fromkeys(s for s, _ in rows):
        ca, ll = rows.get((system, "cache-aware")), rows.get((system, "least-loaded"))
        if ca and ll:
            out.append(
                f"- {system}: cache-aware / least-loaded TTFT p50 {ca['ttft_p50_ms'] / ll['ttft_p50_ms']:.3f}, "
                f"throughput {ca['tokens_per_s'] / ll['tokens_per_s']:.3f}; hit rate {ca['hit_rate']:.3f} vs "
                f"{ll['hit_rate']:.3f}"
            )
    return out
