"""Can loadgen hold a high open-loop rate on this machine without becoming the bottleneck?

Runs ``loadgen run`` (its own process) at a Poisson rate against the fast fake endpoint (another process) and
reports the client's dispatch lag (actual send time - scheduled time), the quantity a lagging client would hide.

    .venv/bin/python benchmarks/loadgen_dispatch.py --rate 300 --requests 3000
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _loadgen import run_loadgen

from flying.procs import stop
from loadgen.fake_server import start_process


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=300)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--output-tokens", default="8")
    p.add_argument("--itl-ms", type=float, default=2.0)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="loadgen-dispatch-"))
    server, url = start_process(tmp / "server.log", ttft_ms=5, itl_ms=a.itl_ms)
    try:
        args = ("-n", str(a.requests), "--rate", str(a.rate), "--output-tokens", a.output_tokens)
        s = run_loadgen(url, tmp / "run", *args)
    finally:
        stop(server)
    lag = s["dispatch_lag_ms"]
    offered = a.requests / s["duration_s"]
    print(
        f"rate {a.rate:g} req/s Poisson, {a.requests} requests, {s['completed']} completed, {s['failed']} failed"
    )
    print(
        f"achieved {offered:.0f} req/s over {s['duration_s']:.1f} s; output {s['output_throughput']:.0f} tok/s"
    )
    print(
        f"dispatch lag ms: p50 {lag['p50']:.2f}  p90 {lag['p90']:.2f}  p99 {lag['p99']:.2f}  mean {lag['mean']:.2f}"
    )
    print(f"TTFT p50 {s['ttft_ms']['p50']:.1f} ms (server-side TTFT is 5 ms)")


if __name__ == "__main__":
    main()
