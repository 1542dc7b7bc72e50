"""PNG plots like the paper's Figure 8, one column per run (``loadgen compare``: runs side by side, each row on one
y scale): requests in flight, P90 TTFT overall and per priority, P90 queue time, output tokens/s and failed
requests per second by kind, over the whole run (to the last request's end, failures included; a dashed line marks
the last arrival)."""

from __future__ import annotations

import math
from pathlib import Path

Line = tuple[list[float], list[float]]

PANELS = (
    ("concurrency", "requests in flight"),
    ("ttft", "P90 TTFT (ms)"),
    ("queue", "P90 queue time (ms)"),
    ("tokens", "output tokens/s"),
    ("failed", "failed requests/s"),
)


def _values(xs: list) -> list[float]:
    """A series' values, the last one repeated: drawn as steps, each value spans its bucket, the last one too."""
    vals = [math.nan if v is None else float(v) for v in xs]
    return vals + vals[-1:]  # (none: none)


def panel_lines(series: dict) -> dict[str, dict[str, Line]]:
    """What each panel draws for one run: panel -> line label -> (t, values), from
    :func:`loadgen.metrics.timeseries` (or a result file's copy of it; older files have no per-priority or failure
    series, and those lines are missing)."""
    t = list(series["t"])
    if t:
        t.append(t[-1] + (t[-1] - t[-2] if len(t) > 1 else 1.0))  # the last bucket's end
    ttft = {"all": (t, _values(series["ttft_p90_ms"]))}
    by_prio = series.get("ttft_p90_ms_by_priority", {})
    if len(by_prio) > 1:
        ttft |= {p: (t, _values(v)) for p, v in by_prio.items()}
    return {
        "concurrency": {"in flight": (t, _values(series["concurrency"]))},
        "ttft": ttft,
        "queue": {"all": (t, _values(series["queue_p90_ms"]))},
        "tokens": {"output": (t, _values(series["output_tokens_per_s"]))},
        "failed": {kind: (t, _values(v)) for kind, v in series.get("failed_per_s", {}).items()},
    }


def timeline(runs: dict[str, dict], out: Path, title: str = "") -> Path:
    """``runs`` maps a label to a time series from :func:`loadgen.metrics.timeseries`; one column each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = len(runs)
    fig, axes = plt.subplots(
        len(PANELS),
        cols,
        figsize=(min(6.5 * cols, 20), 2.1 * len(PANELS)),
        sharex=True,
        sharey="row",
        squeeze=False,
    )
    for c, (name, s) in enumerate(runs.items()):
        lines = panel_lines(s)
        for r, (key, label) in enumerate(PANELS):
            ax = axes[r][c]
            for i, (line, (t, v)) in enumerate(lines[key].items()):
                style = "-" if line == "all" or key != "ttft" else "--"
                ax.plot(t, v, style, label=line, linewidth=1.1, drawstyle="steps-post", color=f"C{i}")
            if key == "failed" and not lines[key]:
                ax.text(0.5, 0.5, "no failures", transform=ax.transAxes, ha="center", va="center")
            if "last_sent_s" in s:
                ax.axvline(s["last_sent_s"], color="grey", linestyle="--", linewidth=0.8)
            if len(lines[key]) > 1 or key == "failed" and lines[key]:
                ax.legend(loc="upper right", fontsize="x-small")
            ax.grid(alpha=0.3)
            if c == 0:
                ax.set_ylabel(label)
        axes[0][c].set_title(name, fontsize="medium")
        axes[-1][c].set_xlabel("time since start of run (s); dashed: last arrival")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
