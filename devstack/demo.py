"""``flying-demo``: the main job. Starts Redis, CPU workers (--engines) with a generated Llama (hidden 512, 4 layers),
the router and the gateway; sends long prompts with the router keeping DP (a reference), the same long prompts at
low load with the router's defaults (it binds the engines: on this CPU a group prefills long prompts faster), then a
short burst of short mixed-priority requests (it goes back to DP, faster for them); prints a summary table of the
burst, each phase's TTFT and how many of its requests ran in TP groups or in DP, the bound/DP ratio of the long
prompts, and the mode track (when the engines bound and released, and why, from the router's decision log); stops
everything it started."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from devstack import mode_track
from devstack.cluster import Cluster, ClusterConfig
from devstack.redis_server import SentinelSet
from flying import cli, control, redis_conn
from loadgen import metrics, report, runner
from loadgen.arrivals import Arrivals
from loadgen.workload import Lengths, PromptMaker, Workload, plan
from worker_ext.tinymodel import TinyLlamaSpec, ensure

DP_ONLY = ("--max-width", "1")  # the reference phase's routers: no load groups


def parser() -> argparse.ArgumentParser:
    p = cli.parser("flying-demo", " ".join(__doc__.split("\n\n")[0].replace("``", "").split()))
    p.add_argument("--engines", type=cli.positive(int), default=2, help="CPU workers")
    p.add_argument("--requests", type=cli.positive(int), default=100, help="requests in the burst")
    p.add_argument(
        "--rate", type=cli.positive(float), default=8.0, help="the burst's requests per second (Poisson)"
    )
    p.add_argument(
        "--quiet-requests",
        type=cli.non_negative(int),
        default=4,
        help="long-prompt requests in the quiet phase before it, and in its DP reference (0: neither)",
    )
    p.add_argument(
        "--quiet-rate",
        type=cli.positive(float),
        default=0.25,
        help="the quiet phase's requests per second (Poisson)",
    )
    p.add_argument(
        "--quiet-tokens",
        default="3000:3500",
        help="the quiet phase's prompt tokens, lo:hi (uniform; the model's context is 4,096)",
    )
    p.add_argument(
        "--reference",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send the quiet phase's prompts first with the router keeping DP (--max-width 1), to compare",
    )
    p.add_argument(
        "--workdir", type=Path, default=Path(".flying"), help="the tiny model, logs and the summary"
    )
    p.add_argument(
        "--redis-url",
        default=None,
        help="use this Redis (redis://, or redis+sentinel://host:port,.../master/db) instead of starting one "
        "(default: start one)",
    )
    p.add_argument(
        "--sentinel",
        action="store_true",
        help="start a Redis primary, a replica and three Sentinels (instead of one redis-server) and use them",
    )
    return p


def workloads(a: argparse.Namespace) -> tuple[Workload | None, Workload]:
    """The quiet phase's workload (None: no quiet phase) and the burst's; ValueError when they cannot be made."""
    quiet = None
    if a.quiet_requests:
        lo, hi = tokens_span(a.quiet_tokens)
        quiet = Workload(
            num_requests=a.quiet_requests,
            arrivals=Arrivals("poisson", a.quiet_rate),
            input_tokens=Lengths("uniform", lo, hi),
            output_tokens=Lengths("uniform", 8, 8),
            priority_mix={"normal": 1.0},
            seed=1,
        )
    return quiet, Workload(num_requests=a.requests, arrivals=Arrivals("poisson", a.rate))


CONTEXT = 4096  # the generated model's context: a prompt and its 8 output tokens fit in it


def tokens_span(text: str) -> tuple[int, int]:
    """``lo:hi`` (or one number) prompt tokens within the model's context; ValueError naming the option."""
    lo, _, hi = text.partition(":")
    try:
        span = (int(lo), int(hi or lo))
    except ValueError:
        raise ValueError(f"--quiet-tokens: expected lo:hi token counts, got {text!r}") from None
    if not 1 <= span[0] <= span[1] <= CONTEXT - 8:
        raise ValueError(f"--quiet-tokens: expected 1 <= lo <= hi <= {CONTEXT - 8}, got {text!r}")
    return span


def main(argv: list[str] | None = None) -> None:
    p = parser()
    a = p.parse_args(argv)
    try:  # everything checked before anything starts: the cluster takes most of a minute to come up
        quiet, burst = workloads(a)
        if a.redis_url:
            redis_conn.parse(a.redis_url)
    except ValueError as exc:
        p.error(str(exc))

    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    started = time.time()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    model = ensure(a.workdir / "llama-512", seed=0, spec=TinyLlamaSpec.sized(512, 4))
    say(f"model (hidden 512, 4 layers, random weights) at {model}")
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
            router_args=DP_ONLY if quiet is not None and a.reference else (),
        ),
        progress=say,
    )
    try:
        cluster.start()
        say(f"cluster up: gateway {cluster.config.gateway_url}, redis {cluster.redis_url}")
        r = cluster.client()
        phases = []
        if quiet is not None and a.reference:
            say(
                f"reference: {a.quiet_requests} long prompts ({a.quiet_tokens} tokens) at {a.quiet_rate:g} req/s, "
                "the router keeping DP"
            )
            phases.append(send(cluster, model, "DP ref", quiet, a.quiet_rate))
            restart_routers(cluster, say)
        if quiet is not None:
            wait_bound(cluster, say)
            say(
                f"quiet phase: the same {a.quiet_requests} long prompts at {a.quiet_rate:g} req/s, router defaults"
            )
            phases.append(send(cluster, model, "quiet", quiet, a.quiet_rate))
        epochs_before = int(r.get(cluster.keys.epoch) or 0)
        say(f"sending {a.requests} streaming requests at {a.rate:g} req/s (high 20%, normal 60%, low 20%)")
        phases.append(send(cluster, model, "burst", burst, a.rate))
        summary = metrics.summarize(phases[-1].records, phases[-1].duration)
        print(report.table(summary))
        binds = int(r.get(cluster.keys.epoch) or 0) - epochs_before
        say(f"router: {binds} TP group binds during the burst (why: grep bind {cluster.log('router')})")
        print_modes(cluster, phases, started)
        out = a.workdir / "demo-summary.json"
        out.write_text(json.dumps(summary, indent=2))
        say(f"summary written to {out}; logs in {cluster.config.log_dir}")
        if any(not x.ok for p in phases for x in p.records):
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


def send(cluster: Cluster, model: Path, name: str, workload: Workload, rate: float) -> mode_track.Phase:
    """Run one phase through the gateway, with a progress line."""
    progress = report.Progress(workload.num_requests, stream=sys.stdout)
    t0 = time.time()
    records, duration = asyncio.run(
        runner.run(
            runner.RunConfig(cluster.config.gateway_url, cluster.config.served_model_name),
            plan(workload, PromptMaker(model)),
            on_done=progress,
        )
    )
    return mode_track.Phase(name, records, t0, time.time(), rate, duration)


def restart_routers(cluster: Cluster, say: Callable[[str], None]) -> None:
    """The reference is done: the router and its standby again, with their defaults (the planned widths, the
    measured rates and the fitted cost model stay in Redis)."""
    cluster.kill_router(signal.SIGTERM)
    cluster.kill_standby(signal.SIGTERM)
    cluster.start_router(())
    cluster.start_standby(())
    say("routers restarted with their defaults")


def wait_bound(cluster: Cluster, say: Callable[[str], None], timeout_s: float = 10.0) -> None:
    """Give the router a moment to plan the idle cluster: it binds where a group is predicted faster."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(g.state == "bound" for g in control.groups(cluster.client(), cluster.keys)):
            say("the router bound the idle engines into a TP group (predicted faster for this token mix)")
            return
        time.sleep(0.2)
    say(f"no TP group bound within {timeout_s:g} s (the mode track says why)")


def print_modes(cluster: Cluster, phases: list[mode_track.Phase], since: float) -> None:
    """Each phase's TTFT and TP/DP split, then the mode track."""
    r = cluster.client()
    print("phases:")
    for p in phases:
        print("  " + mode_track.phase_line(p, mode_track.modes(r, cluster.keys, p.started, p.ended)))
    named = {p.name: p for p in phases}
    if (
        "DP ref" in named
        and "quiet" in named
        and (ratio := mode_track.ttft_ratio(named["quiet"], named["DP ref"]))
    ):
        print(f"  the long prompts' TTFT p50, router defaults / DP only: {ratio:.2f}")
    events = mode_track.decision_log(r, cluster.keys, since)
    print("mode track (the router's decision log, t from the first phase's start):")
    for line in mode_track.track(events, phases):
        print("  " + line)


if __name__ == "__main__":
    main()
