"""Our hop beside the Rust gateways: ``sglang-router`` and ``vllm-router`` in front of the same fake engines as our
stack (Redis, router, gateway), measured in one run, in interleaved rounds.

    .venv/bin/python benchmarks/router_hop.py --rounds 5

Each Rust gateway is installed from PyPI into its own virtual environment under ``~/.cache/flying-bench/`` on the
first run (``python -m venv`` + pip); one that cannot be installed is skipped with a note. All of them use
round-robin over the same two ``loadgen.fake_server`` engines (their own processes, TTFT 0).

- Light load, one request at a time: per round, ``--pairs`` times, each target (direct to an engine, ours,
  sglang-router, vllm-router) in a fresh random order, once streaming (TTFT: the first ``data:`` event) and once
  not (the whole answer). "Added" is a target's p50 minus direct's p50 in the same round; the median over rounds is
  quoted.
- Saturated: ``--clients`` closed-loop clients on keep-alive connections send ``--requests`` streaming requests
  (max_tokens 2) through each target in turn (a fresh random order per round): requests/s, TTFT p50/p99 and added
  p50/p99 (minus direct's in the same round), and each process's CPU per request (from ``/proc``).
- At that rate: direct, ours and ``--pace`` (sglang-router) in turn, open loop at ``--pace``'s median saturated
  rate, ``--rounds`` times: TTFT p50/p99 and added p50/p99 (minus direct's in the same round); then direct and
  ours at each of ``--at-rates`` (req/s) the same way.

With ``--baseline DIR``, a second gateway runs the code of another checkout (``DIR``: its ``gateway`` package and
what it imports) against the same Redis, router and engines, as the target ``before``: our gateway before and
after a change, measured in one run.

The client is a lean raw-socket HTTP/1.1 client (one write per request) on uvloop. Every process the benchmark
starts is stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from _stack import GatewayStack, gateway_stack

from flying.procs import NotReady, free_port, spawn, stop

VENVS = Path.home() / ".cache" / "flying-bench"
CHAT = "/v1/chat/completions"


def body(stream: bool, max_tokens: int = 4) -> bytes:
    doc = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return json.dumps(doc | {"stream": True} if stream else doc).encode()


@dataclass(frozen=True)
class Rust:
    """A Rust gateway from PyPI: its package and its program (in the venv's ``bin/``), run with its defaults but
    round-robin over the engines (its log level included: each gateway logs as it does out of the box)."""

    name: str
    package: str
    program: tuple[str, ...]

    def command(self, venv: Path, port: int, metrics_port: int, urls: list[str]) -> list[str]:
        return [
            str(venv / "bin" / self.program[0]),
            *self.program[1:],
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *urls,
            "--policy",
            "round_robin",
            "--prometheus-port",
            str(metrics_port),
        ]


RUST = (
    Rust("sglang-router", "sglang-router==0.3.2", ("python", "-m", "sglang_router.launch_router")),
    Rust("vllm-router", "vllm-router==0.1.17", ("vllm-router",)),
)


def install(rust: Rust) -> Path | str:
    """The venv holding ``rust.package`` (made and installed on first use), or why it could not be."""
    venv = VENVS / rust.name
    marker = venv / ".installed"
    if marker.exists() and marker.read_text() == rust.package:
        return venv
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, capture_output=True)
        subprocess.run(
            [str(venv / "bin/pip"), "install", "-q", rust.package],
            check=True,
            capture_output=True,
            timeout=900,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        return f"could not install {rust.package}: {exc!r} {err.decode(errors='replace')[-300:]}"
    marker.write_text(rust.package)
    return venv


class Conn:
    """One keep-alive HTTP/1.1 connection; ``post`` returns (status, seconds to the first event (to the end for a
    JSON answer), seconds to the end)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, payload: bytes) -> tuple[int, float, float]:
        head = f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{self.port}\r\ncontent-type: application/json\r\n"
        data = f"{head}content-length: {len(payload)}\r\n\r\n".encode() + payload
        for fresh in (self.writer is None, True):  # an idle connection the server closed: once more, anew
            if fresh:
                self.close()
                self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
            assert self.reader is not None and self.writer is not None
            t0 = time.perf_counter()
            self.writer.write(data)
            if status_line := await self.reader.readline():
                break
        r = self.reader
        status = int(status_line.split()[1])
        chunked, length, close = False, 0, False
        while (line := await r.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            k = k.lower()
            chunked |= k == "transfer-encoding" and "chunked" in v
            close |= k == "connection" and "close" in v.lower()
            length = int(v) if k == "content-length" else length
        first = None
        if not chunked:
            await r.readexactly(length)
        else:
            while (size := int((await r.readline()).strip() or b"0", 16)) > 0:
                chunk = await r.readexactly(size + 2)
                if first is None and b"data:" in chunk:
                    first = time.perf_counter() - t0
            await r.readline()
        end = time.perf_counter() - t0
        if close:
            self.close()
        return status, first or end, end

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def pct(xs: list[float], q: int) -> float:
    """The q-th percentile of seconds, in ms."""
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] * 1000 if len(xs) > 1 else float("nan")


@dataclass
class Target:
    name: str
    port: int
    pids: dict[str, int] = field(default_factory=dict)  # the processes on its path (CPU accounting)


KINDS = {  # light-load request kinds: (streaming, on a fresh connection)
    "streaming TTFT": (True, False),
    "streaming TTFT, new connection each": (True, True),
    "non-streaming total": (False, False),
}


async def light(targets: list[Target], pairs: int, warmup: int = 20) -> dict[tuple[str, str], list[float]]:
    """Per (target, kind): ``pairs`` latencies, one request at a time, targets and kinds in a fresh order each
    time."""
    conns = {t.name: Conn(t.port) for t in targets}
    out: dict[tuple[str, str], list[float]] = {(t.name, k): [] for t in targets for k in KINDS}
    for i in range(warmup + pairs):
        order = [(t, k) for t in targets for k in KINDS]
        random.shuffle(order)
        for t, kind in order:
            stream, fresh = KINDS[kind]
            conn = Conn(t.port) if fresh else conns[t.name]
            status, first, _ = await conn.post(CHAT, body(stream))
            if fresh:
                conn.close()
            if status != 200:
                raise RuntimeError(f"{t.name} answered {status}")
            if i >= warmup:
                out[(t.name, kind)].append(first)
    for c in conns.values():
        c.close()
    return out


async def saturate(port: int, clients: int, requests: int) -> tuple[list[tuple[int, float, float]], float]:
    """``clients`` closed-loop clients until ``requests`` answers: (status, TTFT, total) each, and the seconds."""
    payload, results = body(True, 2), []
    left = requests

    async def client() -> None:
        nonlocal left
        conn = Conn(port)
        while left > 0:
            left -= 1
            try:
                results.append(await conn.post(CHAT, payload))
            except (OSError, ValueError, asyncio.IncompleteReadError):
                results.append((-1, 0.0, 0.0))
                conn.close()
        conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return results, time.perf_counter() - t0


async def offered(port: int, rate: float, requests: int) -> tuple[list[tuple[int, float, float]], float]:
    """Open loop: ``requests`` streaming requests sent at ``rate`` per second (each on an idle keep-alive
    connection, a new one when none is idle), whatever the answers' pace."""
    payload, results, idle = body(True, 2), [], []

    async def one() -> None:
        conn = idle.pop() if idle else Conn(port)
        try:
            results.append(await conn.post(CHAT, payload))
            idle.append(conn)
        except (OSError, ValueError, asyncio.IncompleteReadError):
            results.append((-1, 0.0, 0.0))
            conn.close()

    tasks, t0 = [], time.perf_counter()
    for i in range(requests):
        if (delay := t0 + i / rate - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one()))
    await asyncio.gather(*tasks)
    for conn in idle:
        conn.close()
    return results, time.perf_counter() - t0


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def ready(proc: subprocess.Popen, port: int, timeout_s: float = 60) -> None:
    """Until a streaming and a JSON chat request through ``port`` both answer 200."""
    deadline = time.monotonic() + timeout_s

    async def probe() -> bool:
        c = Conn(port)
        try:
            return [(await c.post(CHAT, body(s)))[0] for s in (True, False)] == [200, 200]
        except (OSError, ValueError, asyncio.IncompleteReadError):
            return False
        finally:
            c.close()

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NotReady(f"exited with code {proc.returncode}")
        if asyncio.run(probe()):
            return
        time.sleep(0.5)
    raise NotReady(f"port {port} not serving after {timeout_s:.0f} s")


@contextlib.contextmanager
def rust_gateways(stack: GatewayStack, skip: set[str]) -> Iterator[tuple[list[Target], list[str]]]:
    """The installable Rust gateways running in front of the stack's engines, and notes on those skipped."""
    urls = [url for _, url in stack.engines]
    procs, targets, notes = [], [], []
    try:
        for rust in RUST:
            if rust.name in skip:
                notes.append(f"{rust.name}: skipped (--skip)")
                continue
            venv = install(rust)
            if isinstance(venv, str):
                notes.append(f"{rust.name}: {venv}")
                continue
            port = free_port()
            proc = spawn(rust.command(venv, port, free_port(), urls), stack.tmp / f"{rust.name}.log")
            procs.append(proc)
            try:
                ready(proc, port)
            except NotReady as exc:
                notes.append(f"{rust.name}: did not serve ({exc}); see {stack.tmp / rust.name}.log")
                continue
            targets.append(Target(rust.name, port, {rust.name: proc.pid}))
            notes.append(f"{rust.name}: {rust.package}, {threads(proc.pid)} threads (pid {proc.pid})")
        yield targets, notes
    finally:
        for proc in procs:
            stop(proc)


def extra_gateway(stack: GatewayStack, name: str, args: list[str], checkout: str = ".") -> Target:
    """A gateway process (``--workers 2``: a supervisor and its workers) running ``checkout``'s code against
    ``stack``'s Redis and router, serving once it answers (stopped with the stack's processes: registered in
    main's cleanup); its CPU is its workers' with several."""
    port, model = free_port(), Path(".flying/test-model").resolve()
    cmd = [
        sys.executable,
        "-m",
        "gateway.main",
        "--redis-url",
        stack.server.url,
        "--model-path",
        str(model),
        "--port",
        str(port),
        *args,
    ]
    root = Path(checkout).resolve()  # (``-m`` puts the working directory first on the path: run it there)
    with open(stack.tmp / f"gateway-{name.replace(' ', '-')}.log", "ab") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=root,
            env=dict(os.environ, PYTHONPATH=str(root)),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    _started.append(proc)
    ready(proc, port)
    workers = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    every_worker_serves(port, len(workers))
    gateways = {f"gateway{i}": pid for i, pid in enumerate(sorted(workers))} or {"gateway": proc.pid}
    assert stack.server.proc is not None
    return Target(name, port, gateways | {"router": stack.router.pid, "redis": stack.server.proc.pid})


def every_worker_serves(port: int, workers: int, timeout_s: float = 60) -> None:
    """Until ``workers`` distinct gateway ids have answered /health on fresh connections (the kernel spreads them
    among the workers listening; one still starting would get none of the benchmark's connections)."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(seen) < workers:
        if time.monotonic() > deadline:
            raise NotReady(
                f"{len(seen)} of {workers} gateway workers on port {port} serve after {timeout_s:.0f} s"
            )
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            seen.add(httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()["gateway_id"])


_started: list[subprocess.Popen] = []  # processes main starts beside the stack's, stopped on its way out


def report_light(rounds: list[dict[tuple[str, str], list[float]]], names: list[str]) -> None:
    for kind in KINDS:
        print(f" light load, {kind}: p50 per round (ms), added p50 = p50 - direct's p50")
        added: dict[str, list[float]] = {n: [] for n in names}
        for i, r in enumerate(rounds, 1):
            base = pct(r[("direct", kind)], 50)
            cells = []
            for n in names:
                p = pct(r[(n, kind)], 50)
                added[n].append(p - base)
                cells.append(f"{n} {p:.2f}" + ("" if n == "direct" else f" (+{p - base:.2f})"))
            print(f"  round {i}: " + ", ".join(cells))
        print(
            "  median added p50: " + ", ".join(f"{n} {statistics.median(added[n]):.2f} ms" for n in names[1:])
        )


def report_saturated(rounds: list[dict[str, tuple]], names: list[str], clients: int) -> None:
    print(f" saturated, {clients} clients, streaming max_tokens 2: req/s; TTFT p50/p99 (ms); added p50/p99")
    rates: dict[str, list[float]] = {n: [] for n in names}
    adds: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for i, r in enumerate(rounds, 1):
        d_ok = [x[1] for x in r["direct"][0] if x[0] == 200]
        print(f"  round {i}")
        for n in names:
            res, took, cpu = r[n]
            ok = [x[1] for x in res if x[0] == 200]
            rate = len(ok) / took
            rates[n].append(rate)
            a50, a99 = pct(ok, 50) - pct(d_ok, 50), pct(ok, 99) - pct(d_ok, 99)
            adds[n].append((a50, a99))
            per = ", ".join(f"{k} {v / max(1, len(res)) * 1000:.3f}" for k, v in cpu.items())
            print(
                f"   {n:14s} {len(ok)}/{len(res)} ok {rate:7.1f} req/s  TTFT {pct(ok, 50):6.2f} / {pct(ok, 99):6.2f}"
                f"  added {a50:6.2f} / {a99:6.2f}  CPU ms/request: {per}"
            )
    print("  medians over rounds:")
    for n in names:
        m = statistics.median(rates[n])
        extra = "".join(
            f"; {o} / {n} per round: {', '.join(f'{a / b:.2f}' for a, b in zip(rates[o], rates[n]))}"
            for o in names
            if o.startswith("ours") and not n.startswith("ours") and n != "direct"
        )
        print(
            f"   {n:14s} {m:7.1f} req/s, added p50 {statistics.median(a for a, _ in adds[n]):6.2f} ms, "
            f"p99 {statistics.median(b for _, b in adds[n]):6.2f} ms{extra}"
        )


def report_at_rate(at_rate: dict[str, list[tuple]], why: str) -> None:
    rate = at_rate["direct"][0][2]
    print(f" open loop at {rate:.0f} req/s ({why}), streaming max_tokens 2: per round")
    added: dict[str, list[tuple[float, float]]] = {}
    for i, direct in enumerate(at_rate["direct"]):
        d = [x[1] for x in direct[0] if x[0] == 200]
        print(f"  round {i + 1}")
        for name, runs in at_rate.items():
            res, took, _ = runs[i]
            ok = [x[1] for x in res if x[0] == 200]
            a50, a99 = pct(ok, 50) - pct(d, 50), pct(ok, 99) - pct(d, 99)
            added.setdefault(name, []).append((a50, a99))
            print(
                f"   {name:14s} {len(ok)}/{len(res)} ok {len(ok) / took:7.1f} req/s  TTFT {pct(ok, 50):6.2f} / "
                f"{pct(ok, 99):6.2f}  added {a50:6.2f} / {a99:6.2f}"
            )
    print(
        "  medians: "
        + ", ".join(
            f"{n} added p50 {statistics.median(a for a, _ in v):.2f} ms, p99 "
            f"{statistics.median(b for _, b in v):.2f} ms"
            for n, v in added.items()
            if n != "direct"
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pairs", type=int, default=200, help="light-load requests per target and kind per round")
    p.add_argument("--clients", type=int, default=64, help="saturated: concurrent closed-loop clients")
    p.add_argument("--requests", type=int, default=5000, help="saturated: requests per target per round")
    p.add_argument("--skip", action="append", default=[], choices=[r.name for r in RUST])
    p.add_argument("--no-light", action="store_true", help="only the saturated part")
    p.add_argument("--no-saturated", action="store_true", help="only the light-load part")
    p.add_argument(
        "--baseline",
        metavar="DIR",
        help="also a gateway running another checkout's code (target 'before'), on the same Redis and router",
    )
    p.add_argument(
        "--workers",
        default="1,2",
        help="ours with these gateway worker counts (flying-gateway --workers), each a target ('ours', 'ours x2')",
    )
    p.add_argument(
        "--pace",
        default="sglang-router",
        choices=[r.name for r in RUST],
        help="after the saturated rounds, ours and this one open loop at its saturated rate (the added p99 there)",
    )
    p.add_argument(
        "--at-rates",
        default="",
        metavar="R,R",
        help="also run direct and ours open loop at these rates (req/s), after the pace-setter's",
    )
    a = p.parse_args()
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    VENVS.mkdir(parents=True, exist_ok=True)
    router_args, gateway_args = [], ["--max-queue", "100000"]
    with (
        gateway_stack("router-hop", 2, 1 << 20, router_args, gateway_args) as stack,
        rust_gateways(stack, set(a.skip)) as (rust, notes),
        contextlib.ExitStack() as cleanup,
    ):
        cleanup.callback(lambda: [stop(proc) for proc in _started])
        assert stack.server.proc is not None
        engines = {f"engine{e}": proc.pid for e, (proc, _) in enumerate(stack.engines)}
        direct = Target("direct", int(stack.engines[0][1].rsplit(":", 1)[1]))
        ours = Target(
            "ours",
            stack.port,
            {"gateway": stack.gateway.pid, "router": stack.router.pid, "redis": stack.server.proc.pid},
        )
        counts = [int(n) for n in a.workers.split(",")]
        targets = [direct, *([ours] if 1 in counts else [])]
        targets += [
            extra_gateway(stack, f"ours x{n}", [*gateway_args, "--workers", str(n)]) for n in counts if n > 1
        ]
        if a.baseline:
            targets.append(extra_gateway(stack, "before", gateway_args, a.baseline))
        targets += rust
        names = [t.name for t in targets]
        light_rounds, sat_rounds = [], []
        for i in range(a.rounds):
            if not a.no_light:
                light_rounds.append(run(light(targets, a.pairs)))
            if not a.no_saturated:
                r: dict[str, tuple] = {}
                for t in random.sample(targets, len(targets)):
                    pids = t.pids | engines
                    before = {k: cpu_s(v) for k, v in pids.items()}
                    res, took = run(saturate(t.port, a.clients, a.requests))
                    r[t.name] = (res, took, {k: cpu_s(v) - before[k] for k, v in pids.items()})
                sat_rounds.append(r)
            print(f"round {i + 1} of {a.rounds} done", file=sys.stderr, flush=True)
        at_rates: list[tuple[str, dict[str, list[tuple]]]] = []
        pace = next((t for t in rust if t.name == a.pace), None)
        ours_and_direct = [
            t for t in targets if t.name == "direct" or t.name.startswith("ours") or t.name == "before"
        ]
        paces: list[tuple[float, str, list[Target]]] = []
        if (
            sat_rounds and pace is not None
        ):  # open loop at the pace-setter's saturated rate: the p99 added there
            rate = statistics.median(
                len([x for x in sr[pace.name][0] if x[0] == 200]) / sr[pace.name][1] for sr in sat_rounds
            )
            paces.append((rate, f"{pace.name}'s saturated rate", [*ours_and_direct, pace]))
        paces += [(float(x), "--at-rates", ours_and_direct) for x in filter(None, a.at_rates.split(","))]
        for rate, why, paced in paces:
            at_rate: dict[str, list[tuple]] = {}
            for _ in range(a.rounds):
                for t in random.sample(paced, len(paced)):
                    at_rate.setdefault(t.name, []).append(run(offered(t.port, rate, a.requests)) + (rate,))
            at_rates.append((why, at_rate))
    print(f"router hop: {a.rounds} interleaved rounds on {os.cpu_count()} cores (logs in {stack.tmp})")
    for note in notes:
        print(f" {note}")
    if light_rounds:
        report_light(light_rounds, names)
    if sat_rounds:
        report_saturated(sat_rounds, names, a.clients)
    for why, at_rate in at_rates:
        report_at_rate(at_rate, why)


if __name__ == "__main__":
    main()
