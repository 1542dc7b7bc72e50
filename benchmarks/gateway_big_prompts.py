"""The gateway's event loop while megabyte prompts are tokenized: ``--bodies`` chat requests of about 4 MB each
(``hello world`` x 340,000: 2 million tokens, beyond the tiny model's context, so each ends in a 400 once counted)
sent at once to one gateway process, and ``/health`` timed every 0.5 s meanwhile. No engine runs: a fake live
engine and a router lease in a private Redis are enough for the gateway to admit and count.

    PYTHONPATH=. python benchmarks/gateway_big_prompts.py [--bodies 3] [--rounds 3] [--model /tmp/tiny]

Prints, per round, each big request's status and seconds, and the /health times (max and median).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from devstack.redis_server import RedisServer  # noqa: E402
from flying.keys import Keys  # noqa: E402
from flying.procs import free_port, stop, wait_healthy  # noqa: E402
from tests.stack import announce_engine  # noqa: E402


async def one_round(url: str, body: bytes, bodies: int, probes: int) -> tuple[list, list[float]]:
    async with httpx.AsyncClient(timeout=300) as c:

        async def big():
            t = time.perf_counter()
            r = await c.post(
                url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
            )
            return r.status_code, round(time.perf_counter() - t, 2)

        async def health():
            await asyncio.sleep(0.3)
            out = []
            for _ in range(probes):
                t = time.perf_counter()
                await c.get(url + "/health")
                out.append(time.perf_counter() - t)
                await asyncio.sleep(0.5)
            return out

        *bigs, times = await asyncio.gather(*(big() for _ in range(bodies)), health())
    return bigs, times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bodies", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="/tmp/tiny", help="the tiny model's folder (made if missing)")
    a = p.parse_args()
    if not (Path(a.model) / "tokenizer.json").is_file():
        subprocess.run([sys.executable, "-m", "worker_ext.tinymodel", a.model, "--seed", "0"], check=True)
    body = msgspec.json.encode(
        {
            "model": "tiny-llama",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "hello world " * 340_000}],
        }
    )
    rs = RedisServer().start()
    try:
        r, keys = redis.Redis.from_url(rs.url), Keys()
        announce_engine(r, keys, context_len=4096, max_total_tokens=100_000, free_kv_tokens=100_000)
        r.set(keys.router_lease, "benchmark", px=3_600_000)
        port = free_port()
        gw = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gateway.main",
                "--model-path",
                a.model,
                "--port",
                str(port),
                "--redis-url",
                rs.url,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group (flying.procs.stop signals the group)
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(gw, url, 60)
            for k in range(a.rounds):
                bigs, times = asyncio.run(one_round(url, body, a.bodies, probes=8 * a.bodies // 3 + 4))
                print(
                    f"round {k + 1}: big requests (status, s) {bigs}; /health max {max(times) * 1000:.0f} ms, "
                    f"median {statistics.median(times) * 1000:.1f} ms"
                )
        finally:
            stop(gw)
    finally:
        rs.stop()


if __name__ == "__main__":
    main()
