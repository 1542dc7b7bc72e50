"""``flyctl``: inspect and operate a running deployment through Redis.

flyctl status                      engines by node (mode, epoch, group, load, prefix-cache hit rate, switch
                                   timings), groups, each node's planned width, queue
flyctl queue [-n 20]               the waiting requests in dispatch order
flyctl watch [--interval 1]        status, refreshed until Ctrl-C
flyctl tenants                     each tenant's requests and tokens admitted and requests refused by its
                                   limits (all gateways)
flyctl bind 0 1 [--preempt hard] [--adopt] [--sp-threshold N]
                                   bind engines 0 and 1 into one TP group by hand (prints the epoch; the
                                   engines must be on one node);
                                   --adopt: their DP requests become the group's, KV moved by head slices;
                                   --sp-threshold: its steps of N batched tokens or more run sequence-parallel
flyctl release EPOCH 0 1 [--retract | --scatter | --park]
                                   release that epoch's group back to DP (--retract: at once, its TP
                                   requests recomputed in DP on the leader; --scatter: at once, each TP
                                   request continues in DP on its owner with its KV; --park: as --scatter,
                                   and those no engine holds alone stay parked, KV kept, until resumed);
                                   releasing a parked epoch ends its parked requests
flyctl resume EPOCH [--wait S]     bind a parked group's engines again, in order: its parked requests continue
flyctl model                       the cost model the router fitted to the engines' steps: each line (ms +
                                   ms per batched token), its steps and fit error, and the model's fields
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import msgspec
import redis

from flyctl.config import Bind, Queue, Resume, Watch
from flyctl.nodes import by_node, cross_node, node_header
from flying import cli, control, redis_conn
from flying.breaker import Breaker, decode_all
from flying.config import add_flags, from_flags
from flying.keys import Keys
from flying.messages import Heartbeat, RouterState, decode
from flying.queue import text
from router.cost_fit import CostFit


def render_status(r: redis.Redis, keys: Keys) -> str:
    lines = [
        f"{'engine':>6} {'mode':>4} {'epoch':>5} {'pending':>7} {'group':>9} {'inflight':>8} {'run':>4} "
        f"{'wait':>4} {'paused':>6} {'free KV':>8} {'cache hit':>9} {'bind ms':>8} {'release ms':>10} {'steps sp/tp':>13} {'breaker':>12}  error"
    ]
    beats = control.status(r, keys)
    unreadable: list[str] = []  # keys whose values this flyctl cannot read: said, the rest still shown
    try:
        breakers = decode_all(r.hgetall(keys.breakers))
    except (msgspec.MsgspecError, ValueError) as exc:
        unreadable.append(f"{keys.breakers} ({exc})")
        breakers = {}
    nodes = by_node(beats)
    for node, engines in nodes.items():
        if node or len(nodes) > 1:  # (engines that announce no node: one unnamed node, shown as before)
            lines.append(node_header(node, engines))
        lines += [_engine_row(r, keys, e, hb, breakers.get(e)) for e, hb in engines.items()]
    registered = sorted(int(x) for x in r.smembers(keys.workers))
    for e in (e for e in registered if e not in beats):  # registered once, not live now
        # its engine beats, its launcher withdrew the ready key (or has not set it yet)
        if r.exists(keys.worker(e)) and not r.exists(keys.ready(e)):
            left = r.scard(keys.inflight(e))
            lines.append(f"{e:>6} not live: draining ({left} requests to finish) or still starting")
            continue
        lines.append(
            f"{e:>6} down: no live heartbeat (stopped, or its worker died); breaker {breaker_cell(breakers.get(e))}"
        )
    if not beats:
        lines.append("no live engines")
    raw = r.get(keys.router_state)
    try:
        state = decode(raw, RouterState) if raw else None
    except msgspec.MsgspecError as exc:
        unreadable.append(f"{keys.router_state} ({exc})")
        state = None
    lease = r.get(keys.router_lease)
    if state is None:
        regime = "no router state"
    else:
        planned = ", ".join(
            f"node {n} {'DP' if w == 1 else f'width {w}'}" for n, w in sorted(state.widths.items())
        )
        verdict = "busy: groups take no busy engines" if state.busy else "light: a group serves better"
        rate = f"{state.rate:.1f} req/s" + (
            f" of {state.prompt_rate / state.rate:.0f}/{state.output_rate / state.rate:.0f} tokens"
            if state.rate > 0.01
            else ""
        )
        regime = f"planned: {planned or 'nothing yet'}; {verdict}; arrivals {rate}"
    if state is not None and (held := {e: t for e, t in state.suspect.items() if t > time.time()}):
        regime += "; left out of binds: " + ", ".join(
            f"{e} ({t - time.time():.0f} s)" for e, t in held.items()
        )
    lines.append(f"router: {'lease held by ' + text(lease) if lease else 'none holds the lease'}; {regime}")
    try:
        groups = control.groups(r, keys)
    except msgspec.MsgspecError as exc:
        unreadable.append(f"{keys.groups} ({exc})")
        groups = []
    lines.append(f"groups: {len(groups) or 'none'}")
    now = time.time()
    for g in groups:
        members = ",".join(map(str, g.members))
        lines.append(
            f"  epoch {g.epoch:>4}  [{members}]  {g.state:<9} {g.reason:<8} {g.preempt:<10} "
            f"for {now - g.since:6.1f} s  last used {now - g.last_used:6.1f} s ago"
            + (f"  resumes epoch {g.resumes}" if g.resumes else "")
            + (f"  parked requests: {g.parked_requests}" if g.state == "parked" and g.parked_requests else "")
        )
    depths = control.queue_depths(r, keys)
    total = sum(n for n, _ in depths.values())
    parts = ", ".join(f"{name} {n} (oldest {age:.2f} s)" for name, (n, age) in depths.items() if n)
    lines.append(f"queue: {total} waiting" + (f": {parts}" if parts else ""))
    lines += [f"unreadable (not written by this version?): {u}" for u in unreadable]
    return "\n".join(lines)


def unknown_group(r: redis.Redis, keys: Keys, epoch: int, members: tuple[int, ...]) -> str:
    """Why ``flyctl release EPOCH MEMBERS`` names no group ('' if it does): no group record has that epoch and
    no live engine reports it, or the record's members are others."""
    record = next((g for g in control.groups(r, keys) if g.epoch == epoch), None)
    if record is None:
        if any(hb.epoch == epoch for hb in control.status(r, keys).values()):
            return ""  # bound without a record (e.g. by hand with the router's record gone)
        return "no group has that epoch (flyctl status lists the groups)"
    if set(record.members) != set(members):
        return f"its group is {list(record.members)}, not {list(members)}"
    return ""


def breaker_cell(b: Breaker | None) -> str:
    """An engine's circuit breaker in ``flyctl status``: closed, open (seconds to its probe), half_open."""
    if b is None or b.dispatchable:
        return "closed"
    if b.state.value == "open":  # seconds to its probe; past it, probed once the engine is live again
        left = b.until - time.time()
        return f"open {left:.0f}s" if left >= 0.5 else "open, probe due"
    return b.state.value


def _engine_row(r: redis.Redis, keys: Keys, e: int, hb: Heartbeat, breaker: Breaker | None) -> str:
    group = ",".join(map(str, hb.group)) or "-"
    inflight = r.scard(keys.inflight(e))
    hit = "-" if hb.cache_hit_rate is None else f"{hb.cache_hit_rate:.1%}"
    return (
        f"{e:>6} {hb.mode:>4} {hb.epoch:>5} {hb.pending:>7} {group:>9} {inflight:>8} {hb.running:>4} "
        f"{hb.waiting:>4} {hb.paused:>6} {hb.free_kv_tokens:>8} {hit:>9} {hb.bind_ms:>8.1f} {hb.release_ms:>10.1f} "
        f"{f'{hb.steps_sp}/{hb.steps_tp}':>13} {breaker_cell(breaker):>12}  "
        + (f"parked: epoch {', '.join(map(str, hb.parked))}  " if hb.parked else "")
        + ("" if hb.pool_ready else "communicator pool connecting: binds refused  ")
        + f"{hb.switch_error}"
    )


def render_queue(r: redis.Redis, keys: Keys, limit: int) -> str:
    rows = control.waiting(r, keys, limit)
    lines = [f"{'request':<32} {'priority':>8} {'prompt':>7} {'max out':>7} {'waited s':>9} {'attempts':>8}"]
    now = time.time()
    for row in rows:
        lines.append(
            f"{row.get('id', '?'):<32} {row.get('priority', '?'):>8} {row.get('prompt_tokens', '?'):>7} "
            f"{row.get('max_tokens', '?'):>7} {now - float(row.get('enqueued_at', now)):>9.2f} "
            f"{row.get('attempts', '0'):>8}"
        )
    depth = r.zcard(keys.queue)
    lines.append(f"{depth} waiting" + (f" (first {len(rows)} shown)" if depth > len(rows) else ""))
    return "\n".join(lines)


def render_tenants(r: redis.Redis, keys: Keys) -> str:
    names = sorted(text(n) for n in r.smembers(keys.tenants))
    lines = [
        f"{'tenant':<24} {'requests':>9} {'tokens':>11} {'refused rps':>11} {'refused tpm':>11} "
        f"{'refused conc':>12} {'refused prio':>12}"
    ]
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(keys.tenant(name))
    for name, raw in zip(names, pipe.execute()):
        row = {text(k): int(v) for k, v in raw.items() if not text(k).startswith("finish:")}
        lines.append(
            f"{name:<24} {row.get('requests', 0):>9} {row.get('tokens', 0):>11} "
            f"{row.get('refused_requests_per_s', 0):>11} {row.get('refused_tokens_per_min', 0):>11} "
            f"{row.get('refused_max_concurrent', 0):>12} {row.get('refused_max_priority', 0):>12}"
        )
    if not names:
        lines.append("no tenant has been admitted a request (no API keys, or none used yet)")
    return "\n".join(lines)


def wait_bound(r: redis.Redis, keys: Keys, epoch: int, timeout_s: float) -> int:
    """``flyctl bind --wait``: until the group of ``epoch`` is bound (0) or rolled back, or ``timeout_s`` (1)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        g = next((g for g in control.groups(r, keys) if g.epoch == epoch), None)
        if g is not None and g.state == "bound":
            print(f"epoch {epoch} bound: {list(g.members)}")
            return 0
        if g is None or g.state == "releasing":
            print(
                f"flyctl: epoch {epoch} was rolled back (a member did not bind: the router's log and "
                f"{keys.decisions} say why)",
                file=sys.stderr,
            )
            return 1
        time.sleep(0.1)
    print(
        f"flyctl: epoch {epoch} not bound within {timeout_s:g} s (the router binds it when it runs)",
        file=sys.stderr,
    )
    return 1


def bind_and_wait(r: redis.Redis, keys: Keys, bind: Callable[[], int], wait_s: float) -> int:
    """``flyctl bind`` / ``resume``: make the bind (a refusal: exit 2), print its epoch, and with ``--wait`` wait
    until it is bound (:func:`wait_bound`)."""
    try:
        epoch = bind()
    except ValueError as exc:
        print(f"flyctl: {exc}", file=sys.stderr)
        return 2
    print(epoch, flush=True)
    return wait_bound(r, keys, epoch, wait_s) if wait_s else 0


MODEL_FIELDS = (
    ("overhead_ms", "ms a step"),
    ("prefill_ms_per_token", "ms a batched token, one engine"),
    ("allreduce_ms", "ms an all-reduce round (log2 width rounds a TP step)"),
    ("allreduce_ms_per_token", "ms a token an all-reduce round"),
    ("sp_alltoall_ms", "ms the all-to-alls of an SP step"),
    ("sp_alltoall_ms_per_token", "ms a token of a member's slice, all-to-all"),
)


def render_model(r: redis.Redis, keys: Keys) -> str:
    """The fitted cost model (``flying:cost_model``): its lines and the fields the planner predicts with."""
    raw = r.get(keys.cost_model)
    if not raw:
        return "no fitted cost model yet: the router plans with its prior (the H200 profile, or CPU's on CPU)"
    try:
        fit = decode(raw, CostFit)
    except msgspec.DecodeError as exc:
        return f"{keys.cost_model} unreadable: {exc}"
    lines = [f"cost model: {fit.model.get('name', '?')} (prior: {fit.prior})"]
    if not fit.curves:
        lines.append("  no kind of step has enough samples yet: every field is the prior's")
    for c in fit.curves:
        what = "DP" if c.mode == "dp" else f"{c.mode.upper()} width {c.width}"
        lines.append(f"  {what}: {c.ms:.2f} ms + {c.ms_per_token:.4f} ms/token ({c.steps} steps in "
                     f"{c.buckets} sizes, fit error {100 * c.error:.1f} %)")  # fmt: skip
    for name, unit in MODEL_FIELDS:
        lines.append(f"  {name} = {float(fit.model.get(name, 0.0)):.4f} ({unit})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flyctl", description=__doc__.splitlines()[0])
    cli.add_redis_arguments(p)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser(
        "status", help="engines (mode, group, load, KV, switch timings), the router, groups, queue"
    )
    add_flags(sub.add_parser("queue", help="the waiting requests in dispatch order"), Queue)
    sub.add_parser("tenants", help="each tenant's admitted requests and tokens, and refusals by limit")
    sub.add_parser("model", help="the cost model the router fitted to the engines' step times")
    add_flags(sub.add_parser("watch", help="status, refreshed every --interval seconds"), Watch)
    b = sub.add_parser(
        "bind", help="bind engines into a TP group by hand (the router keeps it until released)"
    )
    b.add_argument("members", type=int, nargs="+")
    add_flags(b, Bind)
    rel = sub.add_parser("release", help="release a group (its epoch and members, as status shows them)")
    rel.add_argument("epoch", type=int)
    rel.add_argument("members", type=int, nargs="+")
    how = rel.add_mutually_exclusive_group()
    how.add_argument(
        "--retract", action="store_true", help="at once: TP requests continue in DP (recomputed)"
    )
    how.add_argument(
        "--scatter", action="store_true", help="at once: TP requests continue in DP on their owners, KV moved"
    )
    how.add_argument(
        "--park",
        action="store_true",
        help="as --scatter, and the TP requests no engine holds alone stay parked (KV kept) until `flyctl resume`",
    )
    res = sub.add_parser("resume", help="bind a parked group's engines again: its parked requests continue")
    res.add_argument("epoch", type=int, help="the parked group's epoch (flyctl status lists it)")
    add_flags(res, Resume)
    a = p.parse_args(argv)
    url = cli.redis_url(a)
    r, keys = redis_conn.sync_client(url), Keys(a.key_prefix)
    try:
        if a.cmd == "bind":
            if len(set(a.members)) < 2:
                print("flyctl: a group needs at least two distinct engines", file=sys.stderr)
                return 2
            members = tuple(sorted(set(a.members)))
            if why := cross_node(control.status(r, keys), members):
                print(f"flyctl: cannot bind {list(members)}: {why}", file=sys.stderr)
                return 2
            o = from_flags(Bind, a)
            return bind_and_wait(
                r,
                keys,
                lambda: control.bind(r, keys, members, o.preempt, adopt=o.adopt, sp_threshold=o.sp_threshold),
                o.wait,
            )
        elif a.cmd == "release":
            if why := unknown_group(r, keys, a.epoch, tuple(sorted(set(a.members)))):
                print(f"flyctl: cannot release epoch {a.epoch}: {why}", file=sys.stderr)
                return 2
            control.release(r, keys, tuple(a.members), a.epoch, a.retract, scatter=a.scatter, park=a.park)
        elif a.cmd == "resume":
            return bind_and_wait(
                r, keys, lambda: control.resume(r, keys, a.epoch)[0], from_flags(Resume, a).wait
            )
        elif a.cmd == "tenants":
            print(render_tenants(r, keys))
        elif a.cmd == "model":
            print(render_model(r, keys))
        elif a.cmd == "queue":
            print(render_queue(r, keys, from_flags(Queue, a).limit))
        elif a.cmd == "watch":
            watch(r, keys, from_flags(Watch, a))
        else:
            print(render_status(r, keys))
    except redis.RedisError as exc:
        where = redis_conn.parse(url).describe()
        print(f"flyctl: cannot reach Redis at {where}: {redis_conn.explain(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # the reader left (flyctl watch | head): stop quietly, and quietly at exit too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0


def watch(r: redis.Redis, keys: Keys, w: Watch) -> None:
    """``flyctl watch``: the status every ``w.interval`` seconds, ``w.count`` times (0: until Ctrl-C)."""
    # no escapes into a file or a pipe
    shown, clear = 0, "\x1b[2J\x1b[H" if sys.stdout.isatty() else ""
    while not w.count or shown < w.count:
        print(clear + time.strftime("%H:%M:%S ") + render_status(r, keys), flush=True)
        shown += 1
        if not w.count or shown < w.count:
            time.sleep(w.interval)


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
