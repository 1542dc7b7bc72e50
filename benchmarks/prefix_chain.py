"""What the gateway's admission pays for cache-aware dispatch: the prompt's block-hash chain (flying.prefix) and
its encoding for the request record, for token-id prompts of several lengths and for a text prompt.

.venv/bin/python benchmarks/prefix_chain.py [--repeat 20000]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from flying.prefix import block_hashes, encode_chain


def per_call_us(prompt: list[int] | str, repeat: int) -> tuple[float, float]:
    """(p50, p99) microseconds of one admission's chain, over ``repeat`` calls timed one by one."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        encode_chain(block_hashes(prompt))
        times.append((time.perf_counter_ns() - t0) / 1000)
    times.sort()
    return statistics.median(times), times[int(0.99 * len(times))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=20_000)
    a = p.parse_args()
    rng = random.Random(0)
    print("| prompt | blocks | p50 (us) | p99 (us) |\n|---|---|---|---|")
    for n in (500, 2000, 8000):
        ids = [rng.randrange(150_000) for _ in range(n)]
        p50, p99 = per_call_us(ids, a.repeat)
        print(f"| {n:,} token ids | {len(block_hashes(ids))} | {p50:.1f} | {p99:.1f} |")
    text = "".join(rng.choice("abcdefgh ") for _ in range(8000))
    p50, p99 = per_call_us(text, a.repeat)
    print(f"| 8,000-character text | {len(block_hashes(text))} | {p50:.1f} | {p99:.1f} |")
    print(f"\nload average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
