"""``flying-sim``: replay a workload (the paper's, or a CSV trace) through static DP, static TP, Shift Parallelism
and dynamic binding in the simulator, and write the paper-style table, a JSON summary and a Figure-8-style
timeline (``timeline.png``: the dynamic run's engines by mode with its bind/release decisions, shift's TP/SP
steps, latency and throughput of every system; ``sim/plots.py``).

flying-sim --requests 4000 --out sim-out               the paper's two-level workload on 8 simulated H200s
flying-sim --no-kv-transform --out sim-before          the same, engines without KV transformation (adopt/scatter)
flying-sim --mixed-steps --out sim-mixed                engines that run their DP work in a bound group's steps
flying-sim --policy max_width=4 --policy off=park      override the simulated router's settings
flying-sim --trace my.csv --preset burstgpt --out o    your own trace (a BurstGPT or Azure CSV, or loadgen's format)
flying-sim --preset azure --out o                       SYNTHETIC, shaped like the Azure 2023 trace (azure-code, burstgpt)
flying-sim --modes shift,dynamic --shift-threshold 512  Shift Parallelism with the code's threshold
flying-sim --workload shared-prefix --modes dp --engines 4   cache-aware vs least-loaded DP dispatch
flying-sim --modes dp,shift,dynamic --long-share 0 --seeds 0-19   the targets over 20 seeds
flying-sim --nodes 16 --modes dp,shift,dynamic          16 nodes of 8 engines, 16 times the arrival rate
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import time
import typing
from pathlib import Path

from flying import cli
from flying.cost_model import calibration, with_overrides
from loadgen.metrics import RequestRecord, peak_output_throughput, stats, timeseries
from loadgen.results import finite
from loadgen.trace import PRESETS, read_mooncake, read_trace
from router.config import mechanisms
from router.policy import Limits, PolicyConfig
from sim.config import Mode, SimConfig
from sim.plots import burst_spans, mode_counts, plot, shift_share
from sim.prefix_report import hit_rate, prefix_table, ratios, summarize_prefix
from sim.prefix_workload import shared_prefix_workload
from sim.presets import PRESETS as SYNTHETIC
from sim.presets import TRACE_COLUMNS, preset_workload, rate_phase
from sim.seeds import TARGETS, Target, over_seeds, parse_seeds, seeds_table
from sim.simulator import Simulator
from sim.workload import (
    BURST_RATE,
    LOW_RATE,
    SimRequest,
    mooncake_requests,
    paper_workload,
    two_level_phase,
)

FLAT_SKIP_S = 15.0  # a flat period is a low phase less its first 15 s (the paper's "flat periods", section 6)


def flat_period(t: float, low_s: float, burst_s: float, skip_s: float = FLAT_SKIP_S) -> bool:
    """``t`` falls in a low phase, at least ``skip_s`` after it began (the burst's backlog has drained)."""
    return skip_s <= t % (low_s + burst_s) < low_s


MODES = ("dp", "tp", "shift", "dynamic")
MOONCAKE = "mooncake"  # --preset of Mooncake's JSONL traces (loadgen.trace.read_mooncake), with --trace
LONG_TOKENS = 100_000  # a prompt longer than this is a long-context request (reported apart)
BUCKET_S = 5.0  # the timeline's bucket


def system_name(mode: str) -> str:
    return {"dynamic": "dynamic", "shift": "shift"}.get(mode, f"static {mode.upper()}")


def summarize(records: list[RequestRecord], phase, flat=lambda t: False) -> dict:
    ok = [r for r in records if r.ok]
    ms = lambda rs: [r.ttft * 1000 for r in rs]  # noqa: E731
    by_phase = {p: [r for r in ok if phase(r.sent_at) == p] for p in ("low", "burst")}
    flats = [r for r in ok if flat(r.sent_at)]
    tpots = [r.tpot * 1000 for r in ok if r.tpot is not None]
    cls = {p: [r for r in ok if r.priority == p] for p in ("high", "normal")}
    longs = [r for r in ok if r.prompt_tokens > LONG_TOKENS]
    return {
        "served": len(ok),
        "rejected": sum(1 for r in records if r.status == 400),
        "ttft_p90_burst_ms": stats(ms(by_phase["burst"]))["p90"],
        "ttft_p90_low_ms": stats(ms(by_phase["low"]))["p90"],
        "ttft_mean_flat_ms": stats(ms(flats))["mean"],
        "ttft_p90_flat_ms": stats(ms(flats))["p90"],
        "ttft_mean_ms": stats(ms(ok))["mean"],
        "queue_mean_ms": stats([r.queue_ms for r in ok if r.queue_ms is not None])["mean"],
        "tpot_p50_ms": stats(tpots)["p50"],
        "peak_tokens_per_s": peak_output_throughput(ok, bucket_s=10.0),
        "high_ttft_mean_ms": stats(ms(cls["high"]))["mean"],
        "high_tpot_mean_ms": stats([r.tpot * 1000 for r in cls["high"] if r.tpot is not None])["mean"],
        "normal_ttft_mean_ms": stats(ms(cls["normal"]))["mean"],
        "long_served": sum(1 for r in ok if r.prompt_tokens > LONG_TOKENS),
        # long requests apart from the rest: their TTFT, and the rest's burst P90
        "long_ttft_p50_ms": stats(ms(longs))["p50"],
        "long_ttft_p90_ms": stats(ms(longs))["p90"],
        "rest_ttft_p90_burst_ms": stats(ms([r for r in by_phase["burst"] if r.prompt_tokens <= LONG_TOKENS]))[
            "p90"
        ],
    }


ROWS = (
    ("P90 TTFT at burst (ms)", "ttft_p90_burst_ms"),
    ("P90 TTFT at low load (ms)", "ttft_p90_low_ms"),
    ("mean TTFT in flat periods (ms)", "ttft_mean_flat_ms"),
    ("P90 TTFT in flat periods (ms)", "ttft_p90_flat_ms"),
    ("mean queue time (ms)", "queue_mean_ms"),
    ("median TPOT (ms)", "tpot_p50_ms"),
    ("peak throughput (tokens/s, 10 s)", "peak_tokens_per_s"),
    ("high priority: mean TTFT (ms)", "high_ttft_mean_ms"),
    ("high priority: mean TPOT (ms)", "high_tpot_mean_ms"),
    ("normal: mean TTFT (ms)", "normal_ttft_mean_ms"),
    ("served / rejected (400)", None),
    ("long-context requests served", "long_served"),
    ("long-context requests: TTFT p50 (ms)", "long_ttft_p50_ms"),
    ("long-context requests: TTFT p90 (ms)", "long_ttft_p90_ms"),
    ("the rest: P90 TTFT at burst (ms)", "rest_ttft_p90_burst_ms"),
)


def table(summary: dict[str, dict]) -> str:
    modes = [m for m in MODES if m in summary]
    lines = ["| metric | " + " | ".join(map(system_name, modes)) + " |"]
    lines.append("|---" * (len(modes) + 1) + "|")
    for label, key in ROWS:
        if key is None:
            cells = [f"{summary[m]['served']} / {summary[m]['rejected']}" for m in modes]
        else:
            cells = ["-" if math.isnan(v := summary[m][key]) else f"{v:,.0f}" for m in modes]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(a: float, b: float) -> float:
    """a / b, NaN where either is not measured (NaN) or b is 0."""
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else math.nan


def targets(s: dict[str, dict]) -> list[tuple[Target, float]]:
    """(target, ratio) for each of :data:`sim.seeds.TARGETS` whose systems ran; a ratio is NaN where the workload
    has no requests to measure it on (see :data:`UNMEASURED`)."""
    return [
        (t, _ratio(s["dynamic"][t.metric], s[t.against][t.metric]))
        for t in TARGETS
        if "dynamic" in s and t.against in s
    ]


UNMEASURED = {  # why a target's ratio is NaN, by metric
    "ttft_p90_burst_ms": "no requests in bursts",
    "ttft_p90_low_ms": "no requests at low load",
    "ttft_mean_flat_ms": "no requests in flat periods",
    "peak_tokens_per_s": "no tokens served",
}


def target_line(t: Target, ratio: float) -> str:
    """One run against a target's per-seed bound (its mean bound is judged over seeds: ``--seeds``)."""
    if math.isnan(ratio):
        return f"- {t.what}: {UNMEASURED[t.metric]}: not measured"
    sign = ">=" if t.higher else "<="
    met = "met" if t.meets(ratio, t.seed_bound) else "NOT met"
    bounds = f"a seed's bound {sign} {t.seed_bound:.2f}; the mean's, {sign} {t.mean_bound:.2f}, is judged by --seeds"
    return f"- {t.what}: {ratio:.3f} ({bounds}): {met}"


# metrics compared against the best other system on a trace or preset (higher is better only for throughput)
VERSUS = (
    ("P90 TTFT at burst", "ttft_p90_burst_ms"),
    ("P90 TTFT at low load", "ttft_p90_low_ms"),
    ("mean TTFT", "ttft_mean_ms"),
    ("median TPOT", "tpot_p50_ms"),
    ("peak throughput", "peak_tokens_per_s"),
)


def versus_best(s: dict[str, dict]) -> list[str]:
    """Dynamic against the best of the other systems, metric by metric (burst and low load: the arrival rate over
    the last 10 s above or below 1.5 times the run's mean)."""
    out = []
    for what, key in VERSUS:
        higher = key == "peak_tokens_per_s"
        others = {m: v[key] for m, v in s.items() if m != "dynamic" and not math.isnan(v[key])}
        if not others or math.isnan(d := s["dynamic"][key]):
            continue
        best = (max if higher else min)(others, key=others.__getitem__)
        ratio = d / others[best] if others[best] else math.nan
        better = ratio >= 1 if higher else ratio <= 1
        out.append(
            f"- dynamic / best other ({system_name(best)}), {what}: {ratio:.3f} "
            f"({'as good or better' if better else 'worse'})"
        )
    return out


def transform_report(sim: Simulator) -> list[str]:
    """What the dynamic run's KV transformations and retractions cost."""
    out = []
    for kind in ("adopt", "scatter"):
        ms = sorted(x[2] for x in sim.transforms if x[1] == kind)
        n = sum(x[3] for x in sim.transforms if x[1] == kind)
        if ms:
            out.append(
                f"- {kind}: {len(ms)} transformations moving {n} requests, stall median "
                f"{ms[len(ms) // 2]:.1f} ms, max {ms[-1]:.1f} ms"
            )
    st = sim.stats
    out.append(
        f"- requests scattered: {st['scattered']:.0f}, retracted (recomputed): {st['retracted']:.0f} "
        f"(of which scatter fallbacks, the owner's KV full: {st['scatter_fallbacks']:.0f})"
    )
    return out


def shift_report(sim: Simulator) -> list[str]:
    """Where the shift run's time went: full-TP (shift) and SP (base) steps, and the KV the weight copy left."""
    tp = sum(s for _, s, shifted in sim.shift_steps if shifted)
    sp = sum(s for _, s, shifted in sim.shift_steps if not shifted)
    n_tp = sum(1 for *_, shifted in sim.shift_steps if shifted)
    return [
        f"- threshold {sim.cfg.shift_threshold} batched tokens: {n_tp} of {len(sim.shift_steps)} steps in full TP "
        f"({tp:.0f} s), the rest in SP ({sp:.0f} s)",
        f"- KV per GPU {sim.kv_per_engine:,} tokens (the TP-sharded weight copy takes "
        f"{sim.cfg.cost.kv_tokens - sim.kv_per_engine:,})",
    ]


def picture(
    sims: dict[str, Simulator], series: dict[str, dict], bursts: list, out: Path, title: str, dpi: int
) -> None:
    t_end = max((s["t"][-1] + BUCKET_S for s in series.values() if s["t"]), default=BUCKET_S)
    dyn, shift = sims.get("dynamic"), sims.get("shift")
    # matplotlib is a dependency; a trimmed install still gets the table
    with contextlib.suppress(ImportError):
        plot(
            {system_name(m): s for m, s in series.items()},
            out,
            track=mode_counts(dyn.track, t_end, BUCKET_S) if dyn else None,
            decisions=dyn.decisions if dyn else (),
            shift=shift_share(shift.shift_steps, t_end, BUCKET_S) if shift else None,
            bursts=bursts,
            bucket_s=BUCKET_S,
            title=title,
            dpi=dpi,
        )


def span(text: str, option: str = "--input") -> tuple[int, int]:
    """``lo:hi`` token counts (``--input``, ``--output``); ValueError naming what is wrong."""
    lo, sep, hi = text.partition(":")
    try:
        got = int(lo), int(hi)
    except ValueError:
        raise ValueError(f"{option}: expected lo:hi token counts, e.g. 512:4096, got {text!r}") from None
    if not sep or not 1 <= got[0] <= got[1]:
        raise ValueError(f"{option}: expected lo:hi with 1 <= lo <= hi, got {text!r}")
    return got


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def policy_overrides(items: list[str]) -> tuple[dict, dict]:
    """``FIELD=VALUE`` strings -> (PolicyConfig fields, Limits fields), each value parsed as its field's type
    (ValueError naming the item when it cannot be); ``off`` takes mechanisms separated by commas."""
    classes = (typing.get_type_hints(PolicyConfig), typing.get_type_hints(Limits))
    out: tuple[dict, dict] = ({}, {})
    for item in items:
        name, sep, value = item.partition("=")
        which = next((i for i, hints in enumerate(classes) if name in hints), None)
        if which is None:
            raise ValueError(f"--policy {item}: neither PolicyConfig nor Limits has a field {name!r}")
        if not sep:
            raise ValueError(f"--policy {item}: expected FIELD=VALUE")
        kind = classes[which][name]
        try:
            if kind == int | None:
                out[which][name] = None if value.lower() in ("", "none") else int(value)
            elif kind is bool:
                out[which][name] = _bool(value)
            elif kind in (int, float):
                out[which][name] = kind(value)
            elif typing.get_origin(kind) is frozenset:
                out[which][name] = mechanisms(value)
            else:
                out[which][name] = value
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"--policy {item}: {e}") from None
        except ValueError:
            raise ValueError(
                f"--policy {item}: {value!r} is not a {getattr(kind, '__name__', kind)}"
            ) from None
    return out


DESCRIPTION = (
    "Replay a workload (the paper's, a synthetic one shaped like a public trace, or a CSV trace) through static "
    "DP, static TP, Shift Parallelism and dynamic binding in the simulator; write the paper-style table "
    "(table.md), a JSON summary and a timeline (timeline.png) under --out."
)


def tp_width_problem(width: int, engines: int) -> str | None:
    """Why static TP cannot split ``engines`` per node into groups of ``width`` (None: it can)."""
    if width <= engines and engines % width == 0:
        return None
    fits = ", ".join(str(w) for w in range(1, engines + 1) if engines % w == 0)
    return (
        f"--tp-width {width} does not split the {engines} engines per node into whole groups (static TP "
        f"would leave engines in DP); choose one of {fits}"
    )


def out_problem(out: Path) -> str | None:
    """Why the results cannot be written under ``out`` (None: they can); made now, not after the run."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot make the folder ({e.strerror})"
    if not os.access(out, os.W_OK):
        return "cannot write there (no permission)"
    return None


PAPER_SHAPE = (  # (option, default, what): the paper workload's shape, refused with a trace or a preset
    ("--low-s", "60", "seconds of each low phase"),
    ("--burst-s", "30", "seconds of each burst"),
    ("--input", "512:4096", "prompt tokens lo:hi, uniform"),
    ("--output", "64:512", "output tokens lo:hi, uniform (also the shared-prefix workload's answers)"),
    ("--high-share", "0.1", "share of high-priority requests"),
    ("--long-share", "0.0025", "share of long-context requests (400K-600K-token prompts)"),
)


def paper_shape(a: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """The paper workload's options, checked and defaulted in place; refused where another workload is run."""
    given = [name for name, _, _ in PAPER_SHAPE if getattr(a, _dest(name)) is not None]
    if a.workload == "shared-prefix":
        other = "--workload shared-prefix"
        given = [g for g in given if g != "--output"]  # (its answers' lengths)
    else:
        other = "--trace" if a.trace else f"--preset {a.preset}" if a.preset in SYNTHETIC else ""
    if other and given:
        verb = "shapes" if len(given) == 1 else "shape"
        p.error(f"{', '.join(given)} {verb} the paper workload; {other} brings its own")
    for name, default, _ in PAPER_SHAPE:
        if getattr(a, _dest(name)) is None:
            setattr(a, _dest(name), default)
    for name in ("low_s", "burst_s", "high_share", "long_share"):
        try:
            setattr(a, name, float(getattr(a, name)))
        except ValueError:
            p.error(f"--{name.replace('_', '-')}: not a number: {getattr(a, name)!r}")
    for name in ("low_s", "burst_s"):
        if not getattr(a, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be above 0, got {getattr(a, name):g}")


def _dest(option: str) -> str:
    return option.lstrip("-").replace("-", "_")


def main(argv: list[str] | None = None) -> int:
    d = SimConfig()
    p = argparse.ArgumentParser(prog="flying-sim", description=DESCRIPTION)
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests in the workload (per node; default 4000, a --trace's all)",
    )
    p.add_argument("--engines", type=int, default=d.engines, help="engines per node")
    p.add_argument(
        "--nodes",
        type=int,
        default=d.nodes,
        help="nodes (bind domains: groups never span two) of --engines each, over one global queue; the paper "
        "workload's arrival rates and --requests are scaled by it",
    )
    p.add_argument(
        "--tp-width",
        type=int,
        default=None,
        help=f"static TP width (default: {d.tp_width}, or the widest below it that splits --engines; dynamic's: "
        "--policy max_width=W)",
    )
    p.add_argument("--seed", type=int, default=0, help="the workload's random seed")
    g = p.add_argument_group(
        "the paper workload's shape (two-level arrivals; a --trace or a synthetic --preset has its own)"
    )
    for name, default, what in PAPER_SHAPE:
        g.add_argument(name, default=None, help=f"{what} (default: {default})")
    p.add_argument(
        "--trace",
        metavar="FILE",
        help="CSV trace instead of the synthetic workload (a real Azure or BurstGPT trace: add --preset azure / "
        "burstgpt for its column names)",
    )
    p.add_argument(
        "--trace-speed",
        type=float,
        default=1.0,
        help="with --trace: replay this many times faster (arrival times divided by it), as loadgen's",
    )
    p.add_argument(
        "--preset",
        choices=sorted(set(PRESETS) | set(SYNTHETIC) | {MOONCAKE}),
        default="native",
        help="with --trace: the trace's column names (mooncake: Mooncake's JSONL, whose hash_ids are shared "
        "prefixes). Without: a SYNTHETIC workload shaped like a public trace "
        "(no trace is included): "
        + "; ".join(f"{k}: {v.follows}" for k, v in SYNTHETIC.items())
        + " (see sim/presets.py)",
    )
    p.add_argument("--modes", default=",".join(MODES), help="systems to run: dp, tp, shift, dynamic")
    p.add_argument(
        "--shift-threshold",
        type=cli.non_negative(int),
        default=d.shift_threshold,
        help="shift: a step batching at most this many tokens runs in full TP (docs 256, code 512)",
    )
    p.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a PolicyConfig or Limits field of the simulated router (repeatable), e.g. max_width=4, "
        "off=park,kv-transform",
    )
    p.add_argument(
        "--kv-transform",
        action=argparse.BooleanOptionalAction,
        default=d.kv_transform,
        help="the engines apply Bind.adopt / Release.scatter (off: the 'before' table)",
    )
    p.add_argument(
        "--mixed-steps",
        action=argparse.BooleanOptionalAction,
        default=d.mixed_steps,
        help="the engines apply Bind.keep: bound, a member runs its own DP requests in the group's steps (the "
        "live workers do not yet: a projection)",
    )
    p.add_argument(
        "--park",
        action=argparse.BooleanOptionalAction,
        default=d.park,
        help="the engines apply Release.park / Bind.resume: a group serving a request no engine holds alone parks "
        "it (KV kept) when load turns busy and resumes it when light (off: it serves through the burst)",
    )
    p.add_argument(
        "--spread-ownership",
        action=argparse.BooleanOptionalAction,
        default=d.policy.on("spread-ownership"),
        help="a bound group's TP requests are owned by its members in turn (a release scatters them evenly); "
        "off: the policy's off=spread-ownership",
    )
    p.add_argument(
        "--cost",
        default="",
        metavar="NAME=X,...",
        help="change the cost model: allreduce=2,alltoall=0.5 scale a collective's cost; FIELD=VALUE sets a "
        "CostModel field (e.g. switch_ms=30)",
    )
    p.add_argument(
        "--seeds",
        help="FROM-TO or a list (0-19, 1,4,7): run --modes on each seed's paper workload and print, per target, "
        "how many seeds meet it, the mean and the worst ratio (needs dp, shift and dynamic)",
    )
    p.add_argument(
        "--jobs", type=cli.positive(int), default=1, help="--seeds: seeds simulated at once (processes)"
    )
    prefix_arguments(p)
    p.add_argument(
        "--out", type=Path, default=Path("sim-out"), help="folder for table.md, summary.json, timeline.png"
    )
    p.add_argument("--dpi", type=cli.positive(int), default=100, help="timeline.png's resolution")
    a = p.parse_args(argv)
    if a.requests is None:
        a.requests = 10**9 if a.trace else 4000
    paper_shape(a, p)
    if unknown := [m or "''" for m in a.modes.split(",") if m not in MODES]:
        p.error(f"--modes: unknown {', '.join(unknown)} (choose from {', '.join(MODES)})")
    if a.tp_width is None:  # the default, narrowed to a width that splits the engines
        a.tp_width = max(w for w in range(1, min(d.tp_width, max(a.engines, 1)) + 1) if a.engines % w == 0)
    for name in ("requests", "engines", "nodes", "tp_width"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    for name in ("high_share", "long_share"):
        if not 0 <= getattr(a, name) <= 1:
            p.error(f"--{name.replace('_', '-')} is a share, 0 to 1, got {getattr(a, name)}")
    if "tp" in a.modes.split(",") and (why := tp_width_problem(a.tp_width, a.engines)):
        p.error(why)
    if a.preset == MOONCAKE and not a.trace:
        p.error("--preset mooncake reads a trace: give its JSONL file with --trace")
    if a.trace_speed != 1.0 and not a.trace:
        p.error("--trace-speed needs --trace")
    if not a.trace_speed > 0:
        p.error(f"--trace-speed must be above 0, got {a.trace_speed:g}")
    if a.trace and not Path(a.trace).is_file():
        p.error(f"--trace: no such file: {a.trace}")
    if why := out_problem(a.out):
        p.error(f"--out {a.out}: {why}")
    try:
        span(a.input), span(a.output, "--output")
        if a.seeds:
            parse_seeds(a.seeds)
        policy, limits = policy_overrides(a.policy)
        if not a.spread_ownership:
            policy["off"] = policy.get("off", d.policy.off) | {"spread-ownership"}
        policy_config = dataclasses.replace(d.policy, **policy)
        limits_config = dataclasses.replace(d.limits, **limits)
        for rule in a.dispatch.split(","):
            dataclasses.replace(policy_config, dispatch=rule)
    except ValueError as e:
        p.error(str(e))
    if a.seeds and (a.workload == "shared-prefix" or a.trace or a.preset in SYNTHETIC):
        p.error(
            "--seeds runs the paper workload; it does not take --workload shared-prefix, --trace or a --preset"
        )
    if a.workload == "shared-prefix":
        if a.nodes > 1:
            p.error("--nodes runs the paper workload (or a trace), not --workload shared-prefix")
        if why := prefix_problem(a):
            p.error(why)
        return prefix_main(a, d)
    if a.trace:
        try:
            if a.preset == MOONCAKE:
                reqs = mooncake_requests(read_mooncake(a.trace, speed=a.trace_speed, limit=a.requests))
            else:
                columns = PRESETS[TRACE_COLUMNS.get(a.preset, a.preset)]
                rows = read_trace(a.trace, columns, speed=a.trace_speed, limit=a.requests)
                reqs = [
                    SimRequest(r.at, r.priority or "normal", r.input_tokens, r.output_tokens) for r in rows
                ]
        except (OSError, ValueError) as e:
            p.error(f"--trace: {e}")
        phase = rate_phase([r.at for r in reqs])
        flat = lambda t: False  # noqa: E731
    elif a.preset in SYNTHETIC:
        reqs = preset_workload(a.preset, a.requests * a.nodes, a.seed, a.nodes)
        phase = rate_phase([r.at for r in reqs])
        flat = lambda t: False  # noqa: E731
    else:
        reqs = paper_workload(a.requests * a.nodes, a.seed, **workload_args(a))
        phase = lambda t: two_level_phase(t, a.low_s, a.burst_s)  # noqa: E731
        flat = lambda t: flat_period(t, a.low_s, a.burst_s)  # noqa: E731
    base = dataclasses.replace(
        d,
        engines=a.engines * a.nodes,
        nodes=a.nodes,
        tp_width=a.tp_width,
        kv_transform=a.kv_transform,
        mixed_steps=a.mixed_steps,
        park=a.park,
        shift_threshold=a.shift_threshold,
    )
    base = dataclasses.replace(base, policy=policy_config, limits=limits_config)  # (checked above)
    try:
        base = dataclasses.replace(base, cost=with_overrides(base.cost, a.cost))
    except ValueError as e:
        p.error(str(e))
    a.out.mkdir(parents=True, exist_ok=True)
    if a.seeds:
        if a.trace or not {"dp", "shift", "dynamic"} <= set(a.modes.split(",")):
            p.error("--seeds runs the paper workload with at least --modes dp,shift,dynamic")
        return seeds_main(a, base)
    summary, series, sims = {}, {}, {}
    for mode in a.modes.split(","):
        t0 = time.perf_counter()
        sim = sims[mode] = Simulator(dataclasses.replace(base, mode=mode), reqs)
        records = sim.run()
        summary[mode] = summarize(records, phase, flat) | {"hit_rate": hit_rate(sim, records)}
        series[mode] = timeseries(records, BUCKET_S)
        print(
            f"{mode}: {len(records)} requests simulated in {time.perf_counter() - t0:.1f} s "
            f"({len(sim.log)} policy notes)",
            flush=True,
        )
        if mode == "dynamic":
            (a.out / "dynamic-policy.log").write_text("".join(f"{t:9.3f} {n}\n" for t, n in sim.log))
            moves = transform_report(sim)
    report = [table(summary), ""]
    if any(r.blocks for r in reqs):  # (a workload with shared prefixes)
        hits = ", ".join(f"{system_name(m)} {v['hit_rate']:.3f}" for m, v in summary.items())
        report += [f"- prefix-cache hit rate (prompt tokens cached at start / served): {hits}", ""]
    if (a.trace or a.preset in SYNTHETIC) and "dynamic" in summary and len(summary) > 1:
        report += versus_best(summary)
    elif "dynamic" in summary:
        report += [target_line(*t) for t in targets(summary)]
    if "dynamic" in summary:
        report += ["", f"KV transformation in the dynamic run ({'on' if a.kv_transform else 'off'}):", *moves]
    if "shift" in sims:
        report += ["", "Shift Parallelism (SP over every engine, full-TP steps below the threshold):"]
        report += shift_report(sims["shift"])
    report += ["", "cost model calibration (model / published):"]
    report += [
        f"- {c.what}: {c.model:.3f} / {c.published:.3f}{'' if c.followed else ' (reported, not followed)'}"
        for c in calibration(base.cost)
    ]
    text = "\n".join(report)
    print(text)
    (a.out / "table.md").write_text(text + "\n")
    write_json(a.out / "summary.json", {"args": vars(a) | {"out": str(a.out)}, "summary": summary})
    t_end = max((s["t"][-1] + BUCKET_S for s in series.values() if s["t"]), default=0.0)
    bursts = [] if a.trace or a.preset in SYNTHETIC else burst_spans(a.low_s, a.burst_s, t_end)
    where = f"{a.nodes} nodes of {a.engines} engines" if a.nodes > 1 else f"{a.engines} engines"
    picture(sims, series, bursts, a.out / "timeline.png", f"simulated, {where}", a.dpi)
    return 0


def write_json(path: Path, doc: dict) -> None:
    """``doc`` as strict JSON: a metric not measured (NaN) is null."""
    path.write_text(json.dumps(finite(doc), indent=1, default=float))


def workload_args(a: argparse.Namespace) -> dict:
    """paper_workload's keyword arguments from the command line (all but the count and the seed): the paper's
    arrival rates times ``--nodes``."""
    (lo_in, hi_in), (lo_out, hi_out) = span(a.input), span(a.output, "--output")
    n = a.nodes
    return dict(
        low_s=a.low_s,
        burst_s=a.burst_s,
        input_tokens=(lo_in, hi_in),
        output_tokens=(lo_out, hi_out),
        high_share=a.high_share,
        long_share=a.long_share,
        low_rate=(LOW_RATE[0] * n, LOW_RATE[1] * n),
        burst_rate=(BURST_RATE[0] * n, BURST_RATE[1] * n),
    )


def seed_summary(job: tuple[int, int, dict, SimConfig, tuple[Mode, ...]]) -> dict[str, dict]:
    """One seed: every system's summary (a top-level function, for worker processes)."""
    seed, n, kw, base, modes = job
    reqs = paper_workload(n, seed, **kw)
    phase = lambda t: two_level_phase(t, kw["low_s"], kw["burst_s"])  # noqa: E731
    flat = lambda t: flat_period(t, kw["low_s"], kw["burst_s"])  # noqa: E731
    out: dict[str, dict] = {}
    for mode in modes:
        out[mode] = summarize(Simulator(dataclasses.replace(base, mode=mode), reqs).run(), phase, flat)
    return out


def seeds_main(a: argparse.Namespace, base: SimConfig) -> int:
    """``--seeds``: the targets over many seeds (seeds.md, seeds.json under ``--out``)."""
    try:
        seeds = parse_seeds(a.seeds)
    except ValueError as e:
        raise SystemExit(f"flying-sim: {e}") from None
    kw, modes = workload_args(a), tuple(typing.cast(Mode, m) for m in a.modes.split(","))
    jobs = {s: (s, a.requests * a.nodes, kw, base, modes) for s in seeds}
    t0 = time.perf_counter()
    if a.jobs > 1:
        with multiprocessing.Pool(a.jobs) as pool:
            done = dict(zip(seeds, pool.map(seed_summary, [jobs[s] for s in seeds])))
        run = done.__getitem__
    else:
        run = lambda s: seed_summary(jobs[s])  # noqa: E731
    results, summaries = over_seeds(seeds, run)
    took = time.perf_counter() - t0
    text = "\n".join(
        [seeds_table(results, seeds), "", f"{len(seeds)} seeds, {', '.join(modes)}: {took:.0f} s"]
    )
    print(text)
    (a.out / "seeds.md").write_text(text + "\n")
    write_json(
        a.out / "seeds.json",
        {"args": vars(a) | {"out": str(a.out)}, "summaries": {str(s): v for s, v in summaries.items()}},
    )
    return 0


def prefix_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "shared-prefix workload (--workload shared-prefix; --output sets the answers' lengths)"
    )
    g.add_argument(
        "--workload",
        choices=("paper", "shared-prefix"),
        default="paper",
        help="paper: the two-level workload; shared-prefix: system prompts and multi-turn sessions",
    )
    g.add_argument("--session-rate", type=float, default=2.0, help="sessions per second (Poisson)")
    g.add_argument(
        "--system-prompts", type=int, default=8, help="distinct system prompts (0: nothing shared)"
    )
    g.add_argument("--system-tokens", type=int, default=1500, help="tokens of each system prompt")
    g.add_argument("--max-turns", type=int, default=4, help="turns per session, uniform in 1..this")
    g.add_argument("--user", default="50:300", help="tokens of each user message lo:hi (uniform)")
    g.add_argument("--think-s", type=float, default=10.0, help="seconds between a session's turns (mean)")
    g.add_argument(
        "--dispatch",
        default="cache-aware,least-loaded",
        help="DP dispatch rules to compare (PolicyConfig.dispatch)",
    )


def prefix_problem(a: argparse.Namespace) -> str | None:
    """What is wrong with the shared-prefix workload's options (None: nothing)."""
    if not a.session_rate > 0:
        return f"--session-rate must be above 0, got {a.session_rate:g}"
    for name, low in (("system_prompts", 0), ("system_tokens", 0), ("max_turns", 1), ("think_s", 0)):
        if getattr(a, name) < low:
            return f"--{name.replace('_', '-')} must be at least {low}, got {getattr(a, name):g}"
    try:
        span(a.user, "--user")
    except ValueError as e:
        return str(e)
    return None


def prefix_main(a: argparse.Namespace, d: SimConfig) -> int:
    """Every system of ``--modes`` under every ``--dispatch`` rule on the shared-prefix workload: a table of hit
    rate, TTFT and throughput (table.md, summary.json)."""
    lo_out, hi_out = span(a.output, "--output")
    lo_user, hi_user = span(a.user, "--user")
    reqs = shared_prefix_workload(
        a.requests,
        a.seed,
        a.session_rate,
        a.system_prompts,
        a.system_tokens,
        a.max_turns,
        (lo_user, hi_user),
        (lo_out, hi_out),
        a.think_s,
    )
    rows: dict[tuple[str, str], dict] = {}
    for mode in a.modes.split(","):
        for dispatch in a.dispatch.split(","):
            changes, limits = policy_overrides(a.policy)
            policy = dataclasses.replace(d.policy, dispatch=dispatch, **changes)
            cfg = dataclasses.replace(
                d,
                limits=dataclasses.replace(d.limits, **limits),
                engines=a.engines,
                tp_width=a.tp_width,
                mode=mode,
                policy=policy,
                kv_transform=a.kv_transform,
                shift_threshold=a.shift_threshold,
            )
            t0 = time.perf_counter()
            sim = Simulator(cfg, reqs)
            rows[system_name(mode), dispatch] = summarize_prefix(sim, sim.run())
            print(f"{mode}, {dispatch}: {len(reqs)} requests in {time.perf_counter() - t0:.1f} s", flush=True)
    text = "\n".join([prefix_table(rows), "", *ratios(rows)])
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "table.md").write_text(text + "\n")
    summary = {f"{m} / {disp}": s for (m, disp), s in rows.items()}
    write_json(a.out / "summary.json", {"args": vars(a) | {"out": str(a.out)}, "summary": summary})
    return 0


def entry() -> None:
    raise SystemExit(main())


if __name__ == "__main__":
    entry()
