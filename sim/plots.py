"""``flying-sim``'s picture: what each simulated system did over time, Figure-8 style.

Panels, top to bottom: the dynamic run's *mode track* (engines by mode: DP, binding, TP at each width, releasing;
the DP requests paused under a group; the router's bind and release decisions, coloured by reason), the shift run's
share of time in full-TP and in sequence-parallel steps, then one line per system: requests in flight, P90 TTFT,
P90 TTFT by priority, P90 queue time, output tokens/s. Burst phases are shaded on every panel.

The series are computed by the functions here (tested); :func:`plot` only draws them.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from pathlib import Path

from sim.simulator import SimDecision

STATE_ORDER = ("dp", "binding", "tp2", "tp4", "tp8", "releasing")
STATE_COLORS = {
    "dp": "#9ecae1",
    "binding": "#fdae6b",
    "tp2": "#31a354",
    "tp4": "#006d2c",
    "tp8": "#00441b",
    "releasing": "#de2d26",
}
REASON_COLORS = {"load": "#3182bd", "priority": "#e6550d", "long": "#756bb1", "manual": "#636363"}


def _spread(
    series: list[float], start: float, end: float, weight: float, bucket_s: float, t_end: float
) -> None:
    """Add ``weight`` for the time in [start, end) to each bucket it overlaps, as a share of the bucket's length
    (the last bucket ends at ``t_end``)."""
    k = int(start // bucket_s)
    while k < len(series) and k * bucket_s < end:
        lo, hi = max(start, k * bucket_s), min(end, (k + 1) * bucket_s, t_end)
        width = min((k + 1) * bucket_s, t_end) - k * bucket_s
        if hi > lo and width > 0:
            series[k] += weight * (hi - lo) / width
        k += 1


def buckets(t_end: float, bucket_s: float) -> int:
    return max(1, math.ceil(t_end / bucket_s))


def mode_counts(
    track: Sequence[tuple[float, tuple[str, ...], int]], t_end: float, bucket_s: float
) -> dict[str, list[float]]:
    """The mode track per bucket: the mean number of engines in each state (time-weighted: they add up to the
    engine count) and, under "paused", the most DP requests paused at once. ``track`` is :attr:`Simulator.track`."""
    n = buckets(t_end, bucket_s)
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0] * n)
    out["paused"] = [0.0] * n
    ends = [t for t, _, _ in track[1:]] + [t_end]
    for (start, states, paused), end in zip(track, ends):
        for state, count in collections.Counter(states).items():
            _spread(out[state], start, end, count, bucket_s, t_end)
        for k in range(int(start // bucket_s), min(n, math.ceil(end / bucket_s))):
            out["paused"][k] = max(out["paused"][k], paused)
    return dict(out)


def shift_share(
    steps: Sequence[tuple[float, float, bool]], t_end: float, bucket_s: float
) -> dict[str, list[float]]:
    """Share of each bucket's time the shift scheduler spent in full-TP steps and in sequence-parallel steps (the
    rest it was idle). ``steps`` is :attr:`Simulator.shift_steps`."""
    n = buckets(t_end, bucket_s)
    out = {"full TP": [0.0] * n, "SP": [0.0] * n}
    for at, secs, shifted in steps:
        _spread(out["full TP" if shifted else "SP"], at, at + secs, 1.0, bucket_s, t_end)
    return out


def burst_spans(low_s: float, burst_s: float, t_end: float) -> list[tuple[float, float]]:
    """The two-level workload's burst phases up to ``t_end`` (each cycle: ``low_s`` low, then ``burst_s`` burst)."""
    cycle = low_s + burst_s
    return [
        (k * cycle + low_s, min((k + 1) * cycle, t_end))
        for k in range(math.ceil(t_end / cycle))
        if k * cycle + low_s < t_end
    ]


def decision_label(d: SimDecision) -> str:
    return f"bind ({d.reason})" if d.kind == "bind" else f"release: {d.cause}"


def _shade(ax, bursts: Sequence[tuple[float, float]], edges: bool = False) -> None:
    """Shade the burst phases; ``edges``: also mark their boundaries above what a panel fills (the mode track)."""
    for a, b in bursts:
        ax.axvspan(a, b, color="#fee0d2", alpha=0.5, linewidth=0, zorder=0)
        for x in (a, b) if edges else ():
            ax.axvline(x, color="#a50f15", linestyle=":", linewidth=0.8, zorder=5)


def _mode_panel(ax, track: dict[str, list[float]], decisions: Sequence[SimDecision], bucket_s: float) -> None:
    n = len(track["paused"])
    t = [k * bucket_s for k in range(n)]
    states = [s for s in STATE_ORDER if s in track] + sorted(
        s for s in track if s not in STATE_ORDER + ("paused",)
    )
    ax.stackplot(
        t,
        *[track[s] for s in states],
        labels=states,
        step="post",
        colors=[STATE_COLORS.get(s, "#bbbbbb") for s in states],
        alpha=0.9,
    )
    engines = round(sum(track[s][0] for s in states))
    ax.set_ylim(0, engines * 1.7)
    ax.set_yticks(range(0, engines + 1, max(1, engines // 4)))
    ax.set_ylabel("dynamic: engines")
    twin = ax.twinx()
    twin.plot(
        t, track["paused"], color="black", linewidth=1.0, drawstyle="steps-post", label="paused DP requests"
    )
    twin.set_ylabel("paused DP requests")
    twin.set_ylim(0, max(1.0, max(track["paused"])) * 1.7)
    seen: set[str] = set()
    cmap = {"release": "v", "bind": "^"}
    for d in decisions:
        label = decision_label(d)
        color = REASON_COLORS.get(d.reason, "#636363") if d.kind == "bind" else _cause_color(str(d.cause))
        ax.plot(
            [d.at],
            [engines * (1.06 if d.kind == "bind" else 1.16)],
            cmap[d.kind],
            color=color,
            markersize=5,
            label=None if label in seen else label,
            linestyle="none",
        )
        seen.add(label)
    handles, labels = ax.get_legend_handles_labels()
    h2, l2 = twin.get_legend_handles_labels()
    ax.legend(handles + h2, labels + l2, loc="upper left", fontsize="x-small", ncol=5, framealpha=0.9)


CAUSE_COLORS = ("#d62728", "#8c564b", "#7f7f7f", "#bcbd22", "#17becf")
_causes: dict[str, str] = {}


def _cause_color(cause: str) -> str:
    return _causes.setdefault(cause, CAUSE_COLORS[len(_causes) % len(CAUSE_COLORS)])


def _lines(ax, runs: dict[str, dict], key: str, label: str, log: bool = False) -> None:
    for name, s in runs.items():
        ax.plot(
            s["t"],
            [math.nan if v is None else v for v in s[key]],
            label=name,
            linewidth=1.0,
            drawstyle="steps-post",
        )
    ax.set_ylabel(label)
    if log:
        ax.set_yscale("log")


def _priority_lines(ax, runs: dict[str, dict]) -> None:
    styles = {"high": "-", "normal": ":", "low": "--"}
    for i, (name, s) in enumerate(runs.items()):
        for prio, values in sorted(s.get("ttft_p90_ms_by_priority", {}).items()):
            ax.plot(
                s["t"],
                values,
                styles.get(prio, "-."),
                color=f"C{i}",
                linewidth=1.0,
                drawstyle="steps-post",
                label=f"{name}, {prio}",
            )
    ax.set_ylabel("P90 TTFT by priority (ms)")
    ax.set_yscale("log")
    ax.legend(loc="upper right", fontsize="x-small", ncol=2)


def plot(
    runs: dict[str, dict],
    out: Path,
    *,
    track: dict[str, list[float]] | None = None,
    decisions: Sequence[SimDecision] = (),
    shift: dict[str, list[float]] | None = None,
    bursts: Sequence[tuple[float, float]] = (),
    bucket_s: float = 5.0,
    title: str = "",
    dpi: int = 80,
) -> Path:
    """Draw the picture; ``runs`` maps a system's name to its :func:`loadgen.metrics.timeseries`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = (
        (["mode"] if track else []) + (["shift"] if shift else []) + ["conc", "ttft", "prio", "queue", "tput"]
    )
    heights = {"mode": 1.6, "shift": 0.8}
    fig, axes = plt.subplots(
        len(rows),
        1,
        figsize=(10, sum(heights.get(r, 1.0) for r in rows) * 1.9),
        sharex=True,
        gridspec_kw={"height_ratios": [heights.get(r, 1.0) for r in rows]},
    )
    for ax, row in zip(axes, rows):
        _shade(ax, bursts, edges=row in ("mode", "shift"))
        ax.grid(alpha=0.3)
        if row == "mode":
            _mode_panel(ax, track, decisions, bucket_s)  # type: ignore[arg-type]
        elif row == "shift":
            t = [k * bucket_s for k in range(len(shift["SP"]))]  # type: ignore[index]
            ax.stackplot(
                t,
                [100 * x for x in shift["full TP"]],  # type: ignore[index]
                [100 * x for x in shift["SP"]],  # type: ignore[index]
                labels=["full-TP steps", "SP steps"],
                colors=["#31a354", "#9ecae1"],
                step="post",
            )
            ax.set_ylim(0, 100)
            ax.set_ylabel("shift: % of time")
            ax.legend(loc="upper right", fontsize="x-small")
        elif row == "conc":
            _lines(ax, runs, "concurrency", "requests in flight")
            ax.legend(loc="upper right", fontsize="x-small", ncol=len(runs))
        elif row == "ttft":
            _lines(ax, runs, "ttft_p90_ms", "P90 TTFT (ms)", log=True)
        elif row == "prio":
            _priority_lines(ax, runs)
        elif row == "queue":
            _lines(ax, runs, "queue_p90_ms", "P90 queue time (ms)", log=True)
        else:
            _lines(ax, runs, "output_tokens_per_s", "output tokens/s")
    axes[-1].set_xlabel("time (s); shaded: burst phases")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out
