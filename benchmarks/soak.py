"""A chaos soak on the CPU stack: two-level load with sessions and priorities through 2 gateways, while the router
binds and releases on its own and, at set times, the Redis primary is killed (its Sentinels fail over), an engine
is killed with SIGKILL and started again, a gateway is stopped with SIGTERM (it drains) and started again, and the
active router is killed (the standby takes over; a new standby starts).

Reported: the answers by outcome (every request a gateway accepted must be answered: none lost, no 5xx), the
resident memory of each process at the end of the warm-up and at the end (the processes that ran throughout), the
engines' free KV at idle at the start and at the end, and Redis's memory.

    PYTHONPATH=. .venv/bin/python benchmarks/soak.py --minutes 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import time
from collections import Counter
from pathlib import Path

import httpx

from devstack.cluster import Cluster, ClusterConfig
from devstack.redis_server import SentinelSet
from worker_ext.tinymodel import ensure

SESSIONS = [f"You are assistant number {i}. " + "Answer briefly and politely. " * 8 for i in range(6)]
PRIORITIES = (("high", 0.2), ("normal", 0.6), ("low", 0.2))
LOW, BURST = (1.0, 20.0), (5.0, 8.0)  # (req/s, seconds) of the two levels
WARMUP = 0.1  # of the run: memory is measured from its end
# (share of the run, what happens)
CHAOS = ((0.2, "redis"), (0.4, "engine"), (0.6, "gateway"), (0.8, "router"))


def rss_kb(pid: int) -> int:
    """Resident memory of ``pid`` and its descendants (KiB)."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p.name))
    total, todo = 0, [pid]
    while todo:
        q = todo.pop()
        todo += children.get(q, [])
        try:
            for line in Path(f"/proc/{q}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def processes(c: Cluster) -> dict[str, int]:
    out = {f"engine {i}": p.pid for i, p in c.workers.items() if p.poll() is None}
    for name, p in (("gateway 0", c.gateway), ("router", c.router), ("standby", c.standby)):
        if p is not None and p.poll() is None:
            out[name] = p.pid
    out |= {f"gateway {i}": p.pid for i, p in c.more_gateways.items() if p.poll() is None}
    return out


def idle_kv(c: Cluster) -> dict[int, tuple[int, int]]:
    """Engine -> (free KV tokens, KV tokens), from the heartbeats."""
    return {e: (hb.free_kv_tokens, hb.max_total_tokens) for e, hb in c.heartbeats().items()}


async def one(client: httpx.AsyncClient, urls: list[str], i: int, rng: random.Random) -> str:
    """One request, to the gateways in a random order (a refused connection: the next one, as a load balancer
    does); its outcome: ok, refused (429/503 at the door: not accepted), error (another status), lost (accepted,
    then no whole answer)."""
    session = rng.choice(SESSIONS)
    priority = rng.choices([p for p, _ in PRIORITIES], [w for _, w in PRIORITIES])[0]
    stream = rng.random() < 0.5
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "system", "content": session}, {"role": "user", "content": f"question {i}"}],
        "max_tokens": rng.randint(8, 32),
        "stream": stream,
        "ignore_eos": True,
    }
    for url in rng.sample(urls, len(urls)):
        try:
            r = await client.post(url + "/v1/chat/completions", json=body, headers={"X-Priority": priority})
        except httpx.ConnectError:
            continue
        except httpx.HTTPError:
            return "lost"
        if r.status_code in (429, 503):
            return "refused"
        if r.status_code != 200:
            return f"error {r.status_code}"
        if stream and not r.text.rstrip().endswith("data: [DONE]"):
            return "lost"
        return "ok"
    return "refused"


async def load(urls: list[str], seconds: float, seed: int) -> Counter:
    rng, outcomes, tasks, i = random.Random(seed), Counter(), [], 0
    end = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=200)) as client:
        while time.monotonic() < end:
            for rate, span in (LOW, BURST):
                until = min(end, time.monotonic() + span)
                while time.monotonic() < until:
                    tasks.append(asyncio.create_task(one(client, urls, i, rng)))
                    i += 1
                    await asyncio.sleep(rng.expovariate(rate))
        for outcome in await asyncio.gather(*tasks):
            outcomes[outcome] += 1
    return outcomes


def chaos(c: Cluster, sentinels: SentinelSet, what: str) -> str:
    if what == "redis":
        sentinels.primary.kill()
        return "Redis primary killed (SIGKILL); the Sentinels promote the replica"
    if what == "engine":
        c.kill_worker(1)
        time.sleep(2)
        c.start_worker(1)
        c.wait_live([1], 300)
        return "engine 1 killed (SIGKILL) and started again"
    if what == "gateway":
        c.kill_gateway(signal.SIGTERM)
        c.start_gateway()
        c.wait_gateway(60)
        return "gateway 0 stopped (SIGTERM, drained) and started again"
    c.fail_over_router()
    return "the active router killed (SIGKILL); the standby took over, a new standby started"


async def soak(c: Cluster, sentinels: SentinelSet, seconds: float, seed: int) -> dict:
    kv0, t0 = idle_kv(c), time.monotonic()
    running = asyncio.create_task(load(c.config.gateway_urls(), seconds, seed))
    await asyncio.sleep(seconds * WARMUP)
    rss0 = {name: (pid, rss_kb(pid)) for name, pid in processes(c).items()}
    redis0 = c.client().info("memory")["used_memory"]
    events = []
    for share, what in CHAOS:
        await asyncio.sleep(max(0.0, t0 + share * seconds - time.monotonic()))
        events.append((round(time.monotonic() - t0, 1), await asyncio.to_thread(chaos, c, sentinels, what)))
        print(f"[{events[-1][0]:7.1f}s] {events[-1][1]}", flush=True)
    outcomes = await running
    await asyncio.sleep(15)  # idle: requests ended
    for _ in range(120):  # and every engine in DP (an idle node may be bound, or probed: router.probe)
        if all(hb.mode == "dp" for hb in c.heartbeats().values()):
            break
        await asyncio.sleep(1)
    rss1 = {name: (pid, rss_kb(pid)) for name, pid in processes(c).items()}
    return {
        "seconds": seconds,
        "outcomes": dict(outcomes),
        "events": events,
        "kv_idle_start": {str(e): v for e, v in kv0.items()},
        "kv_idle_end": {str(e): v for e, v in idle_kv(c).items()},
        "rss_kb_start": rss0,
        "rss_kb_end": rss1,
        "redis_used_memory": [redis0, c.client().info("memory")["used_memory"]],
    }


def run(out: Path, model: Path, seconds: float, seed: int = 0) -> dict:
    """The soak on a stack of its own (logs under ``out``); its report."""
    out.mkdir(parents=True, exist_ok=True)
    sentinels = SentinelSet(data_dir=out / "redis").start()
    try:
        config = ClusterConfig(
            model_path=model,
            num_engines=2,
            gateways=2,
            standby_router=True,
            redis_url=sentinels.url,
            log_dir=out / "logs",
            max_total_tokens=4096,
        )
        with Cluster(config, progress=print) as c:
            return asyncio.run(soak(c, sentinels, seconds, seed))
    finally:
        sentinels.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/soak"))
    a = p.parse_args()
    report = run(a.out, ensure(Path(".flying/test-model"), seed=0), a.minutes * 60, a.seed)
    (a.out / "soak.json").write_text(json.dumps(report, indent=1))
    print(summary(report))


def summary(r: dict) -> str:
    o = r["outcomes"]
    accepted = sum(n for k, n in o.items() if k != "refused")
    lines = [
        f"requests {sum(o.values())}: {o}; accepted {accepted}, lost {o.get('lost', 0)}, "
        f"5xx {sum(n for k, n in o.items() if k.startswith('error 5'))}"
    ]
    lines += [
        f"KV free at idle, engine {e}: {r['kv_idle_start'].get(e)} -> {v}"
        for e, v in r["kv_idle_end"].items()
    ]
    for name, (pid, end) in r["rss_kb_end"].items():
        pid0, start = r["rss_kb_start"].get(name, (None, 0))
        growth = (
            f"{100 * (end - start) / start:+.1f} %" if pid0 == pid and start else "(started during the run)"
        )
        lines.append(f"RSS {name}: {start if pid0 == pid else '-'} -> {end} KiB {growth}")
    lines.append(f"Redis used_memory: {r['redis_used_memory'][0]} -> {r['redis_used_memory'][1]} bytes")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
