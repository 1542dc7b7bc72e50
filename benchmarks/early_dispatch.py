"""Early dispatch's effect on the light-load hop: one request at a time through two gateways on one stack, one
sending a request to its engine while its admission runs (the default) and one with ``--no-early-dispatch``,
alternating, with the gateways' Redis reached directly and through a proxy that delays each direction by
``--delay-us`` (what a Redis on another host or pod adds; the loopback here has none).

    PYTHONPATH=. python benchmarks/early_dispatch.py [--delays-us 0,100,250] [--requests 300] [--rounds 3]

Prints, per delay and round, the Redis round trip the gateways see (a PING's p50 through the proxy), each
gateway's client-side p50 for non-streaming and streaming (TTFT) chat requests against two fake engines that
answer after ``--ttft-ms`` (a prefill's time; with 0 the engine answers before Redis does and there is little to
overlap), and how many requests went early (the gateway's own counter).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._stack import gateway_stack  # noqa: E402
from flying.procs import free_port, spawn, stop, wait_healthy  # noqa: E402

BODY = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


def _proxy(listen: int, upstream: int, delay_s: float) -> None:
    """A TCP proxy to ``upstream`` that holds every chunk ``delay_s`` in each direction (order kept)."""

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if delay_s:
                    await asyncio.sleep(delay_s)
                writer.write(data)
                await writer.drain()
        writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream)
        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", listen)
        await server.serve_forever()

    asyncio.run(main())


def gateway(port: int, redis_url: str, model: Path, log: Path, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "gateway.main",
        "--redis-url",
        redis_url,
        "--model-path",
        str(model),
        "--port",
        str(port),
        *extra,
    ]
    return spawn(cmd, log)


def redis_rtt_ms(url: str, n: int = 200) -> float:
    """A PING's p50 through ``url``, once the proxy is up."""
    r = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            r.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        r.ping()
        times.append(time.perf_counter() - t0)
    r.close()
    return statistics.median(times) * 1000


def early_sent(client: httpx.Client, url: str) -> int:
    for line in client.get(url + "/metrics").text.splitlines():
        if line.startswith('flying_gateway_early_dispatch_total{outcome="sent"}'):
            return int(float(line.split()[-1]))
    return 0


def one(client: httpx.Client, url: str, stream: bool) -> float:
    t0 = time.perf_counter()
    if not stream:
        client.post(url + "/v1/chat/completions", json=BODY).raise_for_status()
        return time.perf_counter() - t0
    with client.stream("POST", url + "/v1/chat/completions", json=BODY | {"stream": True}) as resp:
        resp.raise_for_status()
        first = None
        for line in resp.iter_lines():  # (read to its end: the connection is reused)
            if first is None and line.startswith("data:"):
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("a stream without an event")
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--delays-us", default="0,100,250", help="added delay per direction to the gateways' Redis"
    )
    ap.add_argument("--requests", type=int, default=300, help="per gateway, kind and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ttft-ms", type=float, default=5.0, help="the fake engines' time to their first token")
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    with gateway_stack("early-dispatch", engines=2, ttft_ms=a.ttft_ms) as st:
        model = Path(".flying/test-model")
        for delay_us in (int(x) for x in a.delays_us.split(",")):
            proxy_port = free_port()
            proxy = ctx.Process(target=_proxy, args=(proxy_port, st.server.port, delay_us / 1e6), daemon=True)
            proxy.start()
            url = f"redis://127.0.0.1:{proxy_port}"
            rtt_ms = redis_rtt_ms(url)
            gws = {}
            for name, extra in (("early", ()), ("after", ("--no-early-dispatch",))):
                port = free_port()
                proc = gateway(port, url, model, st.tmp / f"gateway-{name}-{delay_us}.log", *extra)
                wait_healthy(proc, f"http://127.0.0.1:{port}", 60)
                gws[name] = (proc, f"http://127.0.0.1:{port}")
            try:
                with httpx.Client(timeout=30) as client:
                    time.sleep(1.0)  # the gateways' first look at the router's targets
                    for r in range(a.rounds):
                        got: dict[tuple[str, bool], list[float]] = {
                            (n, s): [] for n in gws for s in (False, True)
                        }
                        sent0 = early_sent(client, gws["early"][1])
                        for _ in range(a.requests):
                            order = list(got)
                            random.shuffle(order)
                            for name, stream in order:
                                got[(name, stream)].append(one(client, gws[name][1], stream))
                        sent = early_sent(client, gws["early"][1]) - sent0
                        med = {k: statistics.median(v) * 1000 for k, v in got.items()}
                        print(
                            f"delay {delay_us:>4} us/direction (Redis round trip {rtt_ms:.2f} ms), round {r + 1}: "
                            f"non-streaming p50 "
                            f"early {med[('early', False)]:.2f} ms, after {med[('after', False)]:.2f} ms "
                            f"(saved {med[('after', False)] - med[('early', False)]:+.2f}); streaming TTFT p50 "
                            f"early {med[('early', True)]:.2f} ms, after {med[('after', True)]:.2f} ms "
                            f"(saved {med[('after', True)] - med[('early', True)]:+.2f}); "
                            f"{sent} of {2 * a.requests} sent early",
                            flush=True,
                        )
            finally:
                for proc, _ in gws.values():
                    stop(proc)
                proxy.terminate()
                proxy.join(5)


if __name__ == "__main__":
    main()
