"""flying-sim --seeds: parsing the seeds and judging the targets over them."""

from __future__ import annotations

import math

import pytest

from sim.seeds import TARGETS, over_seeds, parse_seeds, seeds_table


def test_seeds_are_a_range_or_a_list():
    assert parse_seeds("0-3") == [0, 1, 2, 3] and parse_seeds("1,4,7") == [1, 4, 7]
    assert parse_seeds("0-1,5") == [0, 1, 5]
    with pytest.raises(ValueError, match="FROM-TO"):
        parse_seeds("a-b")


def summary(low: float, flat: float, burst: float, peak: float) -> dict[str, dict]:
    """Dynamic's ratios ``low``, ``flat`` (over shift), ``burst``, ``peak`` (over static DP)."""
    keys = ("ttft_p90_low_ms", "ttft_mean_flat_ms", "ttft_p90_burst_ms", "peak_tokens_per_s")
    base = dict.fromkeys(keys, 100.0)
    dyn = dict(zip(keys, (100 * low, 100 * flat, 100 * burst, 100 * peak)))
    return {"dp": base, "shift": base, "dynamic": dyn}


def test_a_target_is_met_by_its_mean_and_by_every_seed():
    runs = {0: summary(0.9, 0.95, 0.96, 1.02), 1: summary(1.05, 1.2, 1.04, 0.99)}
    results, summaries = over_seeds([0, 1], runs.__getitem__)
    low, flat, burst, peak = results
    assert summaries == runs and [r.target for r in results] == list(TARGETS)
    assert low.met_seeds == 2 and math.isclose(low.mean, 0.975) and low.worst == 1.05 and low.met
    assert flat.met_seeds == 1 and flat.worst == 1.2 and not flat.met  # one seed above 1.10
    assert burst.met and math.isclose(burst.mean, 1.00)
    assert peak.worst == 0.99 and math.isclose(peak.mean, 1.005) and peak.met  # higher is better
    table = seeds_table(results, [0, 1])
    assert (
        "| mean TTFT in flat periods, dynamic / shift | <= 1.00 / <= 1.10 | 1 of 2 | 1.075 | 1.200 | no |"
        in table
    )


def test_a_target_no_seed_could_measure_is_said_so_not_failed():
    """A short run reaches no burst: its burst target is not measured (NaN), not missed."""
    runs = {
        0: summary(0.9, 0.95, math.nan, 1.02),
        1: summary(1.0, 1.0, math.nan, 1.0),
        2: summary(1.0, 1.0, 1.0, 1.0),
    }
    results, _ = over_seeds([0, 1], runs.__getitem__)
    table = seeds_table(results, [0, 1])
    assert (
        "| P90 TTFT at burst, dynamic / static DP | <= 1.00 / <= 1.10 | not measured | - | - | not measured |"
        in table
    )
    assert "nan" not in table
    some, _ = over_seeds([0, 2], runs.__getitem__)
    assert "| 1 of 2 (1 not measured) | 1.000 | 1.000 | no |" in seeds_table(some, [0, 2])


def test_flying_sim_seeds_writes_the_targets_table(tmp_path, capsys):
    from sim.cli import main

    args = ["--seeds", "0-1", "--requests", "60", "--modes", "dp,shift,dynamic", "--long-share", "0"]
    assert main([*args, "--low-s", "20", "--burst-s", "5", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "seeds.md").read_text()
    assert "| target (2 seeds) |" in table and "| peak throughput, dynamic / static DP |" in table
    assert (tmp_path / "seeds.json").exists() and "2 seeds" in capsys.readouterr().out


def test_the_summary_reports_long_requests_apart_from_the_rest():
    from sim.cli import summarize
    from sim.config import SimConfig
    from sim.simulator import Simulator
    from sim.workload import SimRequest

    reqs = [SimRequest(0.0, "normal", 200_000, 8), SimRequest(0.1, "normal", 100, 8)]
    records = Simulator(SimConfig(engines=2), reqs).run()
    s = summarize(records, lambda t: "burst")
    assert s["long_served"] == 1 and s["long_ttft_p50_ms"] == records[0].ttft * 1000
    assert s["rest_ttft_p90_burst_ms"] == records[1].ttft * 1000  # the long request left out
