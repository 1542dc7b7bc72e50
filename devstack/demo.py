"""``flying-demo``: the main job. Starts Redis, two CPU workers with the tiny model, the router and the gateway;
sends a short burst of mixed-priority streaming requests; prints a summary table; stops everything it started."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path

from devstack.cluster import Cluster, ClusterConfig
from devstack.redis_server import SentinelSet
from loadgen import metrics, report, runner
from loadgen.arrivals import Arrivals
from loadgen.workload import PromptMaker, Workload, plan
from worker_ext.tinymodel import ensure


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="flying-demo", description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--rate", type=float, default=8.0, help="requests per second (Poisson)")
    p.add_argument("--workdir", type=Path, default=Path(".flying"))
    p.add_argument(
        "--redis-url",
        default=None,
        help="use this Redis (redis://, or redis+sentinel://host:port,.../master/db) instead of starting one",
    )
    p.add_argument(
        "--sentinel",
        action="store_true",
        help="start a Redis primary, a replica and three Sentinels (instead of one redis-server) and use them",
    )
    a = p.parse_args(argv)

    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    model = ensure(a.workdir / "tiny-llama", seed=0)
    say(f"tiny model at {model}")
    sentinels = None
    if a.sentinel and not a.redis_url:
        sentinels = SentinelSet(data_dir=a.workdir / "logs" / "redis-sentinel").start()
        a.redis_url = sentinels.url
        say(
            f"redis primary :{sentinels.primary.port}, replica :{sentinels.replica.port}, sentinels {a.redis_url}"
        )
    cluster = Cluster(
        ClusterConfig(
            model_path=model,
            num_engines=a.engines,
            log_dir=a.workdir / "logs",
            redis_url=a.redis_url,
            standby_router=True,
        ),
        progress=say,
    )
    try:
        cluster.start()
        say(f"cluster up: gateway {cluster.config.gateway_url}, redis {cluster.redis_url}")
        workload = Workload(num_requests=a.requests, arrivals=Arrivals("poisson", a.rate))
        progress = report.Progress(a.requests, stream=sys.stdout)

        r = cluster.client()
        epochs_before = int(r.get(cluster.keys.epoch) or 0)
        say(f"sending {a.requests} streaming requests at {a.rate:g} req/s (high 20%, normal 60%, low 20%)")
        records, duration = asyncio.run(
            runner.run(
                runner.RunConfig(cluster.config.gateway_url, cluster.config.served_model_name),
                plan(workload, PromptMaker(model)),
                on_done=progress,
            )
        )
        summary = metrics.summarize(records, duration)
        print(report.table(summary))
        binds = int(r.get(cluster.keys.epoch) or 0) - epochs_before
        say(f"router: {binds} TP group binds during the burst (why: grep bind {cluster.log('router')})")
        out = a.workdir / "demo-summary.json"
        out.write_text(json.dumps(summary, indent=2))
        say(f"summary written to {out}; logs in {cluster.config.log_dir}")
        if summary["failed"]:
            sys.exit(1)
    except KeyboardInterrupt:
        say("interrupted")
        sys.exit(130)
    finally:
        say("stopping everything")
        cluster.stop()
        if sentinels is not None:
            sentinels.stop()
        say("stopped")


if __name__ == "__main__":
    main()
