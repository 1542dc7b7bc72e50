"""Does loadgen measure what ``sglang.benchmark.serving`` (bench_serving) measures?

One stock SGLang CPU server on the tiny model; the same prompts (fixed token length, written as bench_serving's
``custom`` JSONL dataset), the same output length (ignore_eos), the same client shape (all requests queued at once,
``--max-concurrency C``). bench_serving and loadgen run alternately, ``--rounds`` times each; medians of their
median TTFT, median TPOT and output throughput are compared.

    .venv/bin/python benchmarks/loadgen_vs_bench_serving.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from _loadgen import run_loadgen

from devstack.stock_server import StockServer
from loadgen.workload import PromptMaker
from worker_ext.cpu_compat import sglang_cpu_env
from worker_ext.tinymodel import ensure


def bench_serving(url: str, model: Path, dataset: Path, n: int, out_len: int, conc: int, out: Path) -> dict:
    port = url.rsplit(":", 1)[1]
    cmd = [
        sys.executable,
        "-m",
        "sglang.benchmark.serving",
        "--backend",
        "sglang-oai-chat",
        "--host",
        "127.0.0.1",
        "--port",
        port,
        "--model",
        str(model),
        "--tokenizer",
        str(model),
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(dataset),
        "--num-prompts",
        str(n),
        "--sharegpt-output-len",
        str(out_len),
        "--request-rate",
        "inf",
        "--max-concurrency",
        str(conc),
        "--output-file",
        str(out),
        "--disable-tqdm",
        "--warmup-requests",
        "1",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=sglang_cpu_env())
    if done.returncode:
        raise SystemExit(f"bench_serving failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    row = json.loads(out.read_text().strip().splitlines()[-1])
    out.unlink()
    return {
        "ttft": row["median_ttft_ms"],
        "tpot": row["median_tpot_ms"],
        "throughput": row["output_throughput"],
        "completed": row["completed"],
    }


def loadgen(url: str, model: Path, n: int, in_len: int, out_len: int, conc: int, out: Path) -> dict:
    args = (
        "--model",
        "x",
        "-n",
        str(n),
        "--rate",
        "inf",
        "--max-concurrency",
        str(conc),
        "--input-tokens",
        str(in_len),
        "--output-tokens",
        str(out_len),
        "--tokenizer",
        str(model),
        "--warmup",
        "1",
    )
    s = run_loadgen(url, out, *args, quiet_stderr=True)
    return {
        "ttft": s["ttft_ms"]["p50"],
        "tpot": s["tpot_ms"]["p50"],
        "throughput": s["output_throughput"],
        "completed": s["completed"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lg-vs-bs-"))
    model = ensure(Path(".flying/tiny-llama"), seed=0)

    # The same prompts for both: loadgen's generator (seed 0, plan order), written as bench_serving's JSONL.
    make, rng = PromptMaker(model), np.random.default_rng(0)
    dataset = tmp / "prompts.jsonl"
    with open(dataset, "w") as f:
        for _ in range(a.requests):
            conv = [
                {"role": "user", "content": make(a.input_tokens, rng)},
                {"role": "assistant", "content": "ok ok"},
            ]
            f.write(json.dumps({"conversations": conv}) + "\n")

    server = StockServer(model, tmp / "server.log", max_total_tokens=8192)
    url = server.url
    results: dict[str, list[dict]] = {"bench_serving": [], "loadgen": []}
    try:
        server.start(timeout_s=240)
        for r in range(a.rounds):
            results["bench_serving"].append(
                bench_serving(
                    url, model, dataset, a.requests, a.output_tokens, a.concurrency, tmp / "bs.jsonl"
                )
            )
            results["loadgen"].append(
                loadgen(url, model, a.requests, a.input_tokens, a.output_tokens, a.concurrency, tmp / "lg")
            )
            print(f"round {r + 1}: " + "  ".join(f"{k} {v[-1]}" for k, v in results.items()), flush=True)
    finally:
        server.stop()

    print(
        f"\n{a.requests} requests x {a.input_tokens} in / {a.output_tokens} out tokens, concurrency {a.concurrency}, "
        f"{a.rounds} alternating rounds; medians over rounds"
    )
    print(f"{'metric':<22} {'bench_serving':>14} {'loadgen':>10} {'loadgen/bs':>11}")
    for key, name in (
        ("ttft", "median TTFT (ms)"),
        ("tpot", "median TPOT (ms)"),
        ("throughput", "output tok/s"),
    ):
        bs = statistics.median(x[key] for x in results["bench_serving"])
        lg = statistics.median(x[key] for x in results["loadgen"])
        print(f"{name:<22} {bs:>14.2f} {lg:>10.2f} {lg / bs:>11.3f}")


if __name__ == "__main__":
    main()
