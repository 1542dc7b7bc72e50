"""PNG plots like the paper's Figure 8: concurrency, P90 TTFT and P90 queue time over time, one line per run."""

from __future__ import annotations

import math
from pathlib import Path


def timeline(runs: dict[str, dict], out: Path, title: str = "") -> Path:
    """``runs`` maps a label to a time series from :func:`loadgen.metrics.timeseries`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("concurrency", "mean requests in flight"),
        ("ttft_p90_ms", "P90 TTFT (ms)"),
        ("queue_p90_ms", "P90 queue time (ms)"),
        ("output_tokens_per_s", "output tokens/s"),
    )
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.3 * len(panels)), sharex=True)
    for ax, (key, label) in zip(axes, panels):
        for name, s in runs.items():
            ax.plot(
                s["t"],
                [math.nan if v is None else v for v in s[key]],
                label=name,
                linewidth=1.2,
                drawstyle="steps-post",
            )
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("time since start of run (s)")
    if len(runs) > 1:
        axes[0].legend(loc="upper right", fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
