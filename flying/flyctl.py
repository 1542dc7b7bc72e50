"""``flyctl``: operate a running deployment through Redis.

flyctl status                      engines: mode, epoch, group, width, load, last switch timings
flyctl bind 0 1 [--preempt hard]   bind engines 0 and 1 into one TP group (prints the epoch)
flyctl release EPOCH 0 1           release that epoch's group back to DP
"""

from __future__ import annotations

import argparse
import sys

import redis

from flying import control, settings
from flying.keys import Keys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flyctl", description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", default=settings.redis_url())
    p.add_argument("--key-prefix", default=settings.key_prefix())
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status")
    b = sub.add_parser("bind")
    b.add_argument("members", type=int, nargs="+")
    b.add_argument("--preempt", choices=("hard", "sequential", "soft"), default="hard")
    rel = sub.add_parser("release")
    rel.add_argument("epoch", type=int)
    rel.add_argument("members", type=int, nargs="+")
    a = p.parse_args(argv)
    r, keys = redis.Redis.from_url(a.redis_url), Keys(a.key_prefix)
    try:
        if a.cmd == "bind":
            if len(set(a.members)) < 2:
                print("flyctl: a group needs at least two distinct engines", file=sys.stderr)
                return 2
            print(control.bind(r, keys, tuple(sorted(set(a.members))), a.preempt))
        elif a.cmd == "release":
            control.release(r, keys, tuple(a.members), a.epoch)
        else:
            beats = control.status(r, keys)
            print(f"{'engine':>6} {'mode':>4} {'epoch':>5} {'group':>10} {'run':>4} {'wait':>4} {'free KV':>8} "
                  f"{'bind ms':>8} {'release ms':>10}  error")  # fmt: skip
            for e, hb in beats.items():
                group = ",".join(map(str, hb.group)) or "-"
                print(f"{e:>6} {hb.mode:>4} {hb.epoch:>5} {group:>10} {hb.running:>4} {hb.waiting:>4} "
                      f"{hb.free_kv_tokens:>8} {hb.bind_ms:>8.1f} {hb.release_ms:>10.1f}  {hb.switch_error}")  # fmt: skip
            if not beats:
                print("no live engines")
    except redis.RedisError as exc:
        print(f"flyctl: cannot reach Redis at {a.redis_url}: {exc}", file=sys.stderr)
        return 1
    return 0


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
