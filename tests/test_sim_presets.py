"""sim.presets: synthetic workloads shaped like the Azure 2023 and BurstGPT traces, and flying-sim --preset."""

from __future__ import annotations

import json

import numpy as np

from sim.cli import main
from sim.presets import PRESETS, preset_workload, rate_phase


def test_lengths_follow_the_published_medians():
    for name, lo, hi in (("azure", 1020, 129), ("azure-code", 1500, 13)):
        reqs = preset_workload(name, 4000, seed=1)
        assert abs(np.median([r.prompt for r in reqs]) / lo - 1) < 0.1, name
        assert abs(np.median([r.output for r in reqs]) / hi - 1) < 0.15, name
    bg = preset_workload("burstgpt", 4000, seed=1)
    prompts = np.array([r.prompt for r in bg])
    assert abs(np.median(prompts) / 600 - 1) < 0.1
    assert np.percentile(prompts, 99) > 10 * np.median(prompts)  # a power-law tail
    outputs = np.array([r.output for r in bg])
    assert ((outputs < 120).mean() > 0.3) and ((outputs > 250).mean() > 0.3)  # two modes


def test_arrivals_are_sorted_from_zero_bursty_and_scale_with_nodes():
    reqs = preset_workload("burstgpt", 3000, seed=2)
    t = np.array([r.at for r in reqs])
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    assert gaps.std() / gaps.mean() > 1.3  # burstier than Poisson (1.0)
    one = preset_workload("azure", 2000, seed=3)[-1].at
    four = preset_workload("azure", 2000, seed=3, nodes=4)[-1].at
    assert 0.15 < four / one < 0.35
    assert preset_workload("azure", 50, seed=4) == preset_workload("azure", 50, seed=4)
    assert all(p.follows for p in PRESETS.values())


def test_rate_phase_marks_dense_stretches_as_burst():
    times = (
        [float(i) for i in range(100)] + [100 + i / 10 for i in range(200)] + [120.0 + i for i in range(100)]
    )
    phase = rate_phase(times)
    assert phase(50.0) == "low" and phase(115.0) == "burst" and phase(210.0) == "low"


def test_flying_sim_runs_a_preset_and_compares_dynamic_with_the_best_other(tmp_path, capsys):
    assert (
        main(["--preset", "azure-code", "--requests", "300", "--modes", "dp,dynamic", "--out", str(tmp_path)])
        == 0
    )
    text = (tmp_path / "table.md").read_text()
    assert "dynamic / best other (static DP), mean TTFT" in text
    summary = json.loads((tmp_path / "summary.json").read_text())["summary"]
    assert summary["dynamic"]["served"] == summary["dp"]["served"] == 300


def test_flying_sim_reads_a_real_trace_with_the_presets_column_names(tmp_path):
    trace = tmp_path / "code.csv"
    rows = [f"2023-11-16 18:15:{i // 10:02d}.{i % 10}000000,{1000 + i},{10 + i % 7}" for i in range(60)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    out = tmp_path / "o"
    assert (
        main(["--trace", str(trace), "--preset", "azure-code", "--modes", "dp,dynamic", "--out", str(out)])
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())["summary"]
    assert summary["dp"]["served"] == 60
