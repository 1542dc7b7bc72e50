"""How many short streaming requests per second one gateway process sustains, and the TTFT it adds at that rate.

Two ``loadgen.fake_server`` engines (own processes, TTFT 0) behind the workers' real liveness code (heartbeat
thread, launcher's ready key); Redis, the router (``--manual``) and one gateway are real processes. The client is
a lean raw-socket HTTP/1.1 client on keep-alive connections (httpx would cost more CPU than the gateway), open
loop at ``--rate`` for ``--seconds``; the same client then sends the same load straight to the engines, and the
difference of the TTFT percentiles is what the hop adds at that rate.

    .venv/bin/python benchmarks/gateway_throughput.py --rate 400 --seconds 10

It also reports each process's CPU time during the via-gateway run (from ``/proc``), so the gateway's CPU per
request, hence what one gateway process can serve on one core, is known even when the machine cannot offer it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _stack import gateway_stack

BODY = json.dumps(
    {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
).encode()


class Conn:
    """One keep-alive HTTP/1.1 connection; ``post`` returns (status, seconds to the first event, to the end)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str) -> tuple[int, float, float]:
        t0 = time.perf_counter()
        head = f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
        for fresh in (self.writer is None, True):  # an idle connection the server closed: once more, anew
            if fresh:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            assert self.reader is not None and self.writer is not None
            self.writer.write(f"{head}content-length: {len(BODY)}\r\n\r\n".encode() + BODY)
            r = self.reader
            if status_line := await r.readline():
                break
            self.writer.close()
        status = int(status_line.split()[1])
        chunked, length = False, 0
        while (line := await r.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            chunked |= k.lower() == "transfer-encoding" and "chunked" in v
            length = int(v) if k.lower() == "content-length" else length
        first = None
        if not chunked:
            await r.readexactly(length)
            return status, time.perf_counter() - t0, time.perf_counter() - t0
        while (size := int((await r.readline()).strip() or b"0", 16)) > 0:
            data = await r.readexactly(size + 2)
            if first is None and b"data:" in data:
                first = time.perf_counter() - t0
        await r.readline()
        return status, first or 0.0, time.perf_counter() - t0


async def drive(host: str, port: int, path: str, rate: float, seconds: float, conns: int = 256):
    pool = [Conn(host, port) for _ in range(conns)]
    results: list[tuple[int, float, float]] = []

    async def one(c: Conn) -> None:
        try:
            results.append(await c.post(path))
        except (OSError, ValueError, asyncio.IncompleteReadError):
            results.append((-1, 0.0, 0.0))
            c.writer = None
        pool.append(c)

    tasks, n, t0 = [], int(rate * seconds), time.perf_counter()
    for i in range(n):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        c = pool.pop() if pool else Conn(host, port)
        tasks.append(asyncio.create_task(one(c)))
    await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) a process has used so far (``None``: this one, all its threads)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] * 1000 if len(xs) > 1 else float("nan")


def record(pid: int, out: str) -> subprocess.Popen:
    """py-spy sampling ``pid`` at 200 Hz into ``out`` until SIGINT."""
    cmd = [
        str(Path(sys.executable).with_name("py-spy")),
        "record",
        "-o",
        out,
        "--pid",
        str(pid),
        "--rate",
        "200",
    ]
    cmd += ["--nonblocking"] + ([] if out.endswith(".svg") else ["--format", "raw"])
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)  # attached
    return spy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=400)
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument(
        "--py-spy",
        metavar="OUT",
        help="record the gateway with py-spy during the via-gateway run (OUT.svg: a flame graph, else collapsed "
        "stacks, one line per stack)",
    )
    a = p.parse_args()
    router_args, gateway_args = ["--max-inflight-per-worker", "4096"], ["--max-queue", "100000"]
    with gateway_stack("gateway-throughput", 2, 1 << 20, router_args, gateway_args) as stack:
        port, gateway, engines = stack.port, stack.gateway, stack.engines
        asyncio.run(drive("127.0.0.1", port, "/v1/chat/completions", 50, 2))  # warm-up
        assert stack.server.proc is not None
        procs = {"gateway": gateway.pid, "router": stack.router.pid, "redis": stack.server.proc.pid}
        procs |= {f"engine{e}": proc.pid for e, (proc, _) in enumerate(engines)}
        procs["client+heartbeats"] = None  # this process
        spy = record(gateway.pid, a.py_spy) if a.py_spy else None
        before = {name: cpu_s(pid) for name, pid in procs.items()}
        via, via_s = asyncio.run(drive("127.0.0.1", port, "/v1/chat/completions", a.rate, a.seconds))
        used = {name: cpu_s(pid) - before[name] for name, pid in procs.items()}
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its output and exits
            spy.wait(60)
        eng_port = int(engines[0][1].rsplit(":", 1)[1])
        direct, direct_s = asyncio.run(
            drive("127.0.0.1", eng_port, "/v1/chat/completions", a.rate, a.seconds)
        )
    tmp = stack.tmp
    print(f"offered {a.rate:g} req/s for {a.seconds:g} s, streaming chat, max_tokens 2 (logs in {tmp})")
    for name, res, took in (("via gateway", via, via_s), ("direct", direct, direct_s)):
        ok = [x for x in res if x[0] == 200]
        ttft = [x[1] for x in ok]
        print(
            f"  {name:12s} {len(ok)}/{len(res)} ok, {len(ok) / took:7.1f} req/s achieved; TTFT p50 {pct(ttft, 50):6.2f}"
            f" ms  p90 {pct(ttft, 90):6.2f} ms  p99 {pct(ttft, 99):7.2f} ms"
        )
    v, d = [x[1] for x in via if x[0] == 200], [x[1] for x in direct if x[0] == 200]
    print(f"  added TTFT p50 {pct(v, 50) - pct(d, 50):.2f} ms, p99 {pct(v, 99) - pct(d, 99):.2f} ms")
    n = max(1, len(via))
    print(f"  CPU during the via-gateway run ({via_s:.1f} s, 2 cores: {2 * via_s:.1f} CPU s; {n} requests):")
    for name, secs in used.items():
        print(
            f"    {name:18s} {secs:6.2f} s  {secs / via_s * 100:5.1f} % of a core  {secs / n * 1000:6.3f} ms/request"
        )
    gw = used["gateway"] / n
    print(f"  the gateway: {gw * 1000:.3f} ms CPU per request => at most {1 / gw:.0f} requests/s on one core")


if __name__ == "__main__":
    main()
