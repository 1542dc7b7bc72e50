"""loadgen.config: ``loadgen run``'s flags are generated from RunSettings, and read back into it."""

from __future__ import annotations

import argparse

import pytest

from flying.cli import HelpFormatter
from flying.config import add_flags, from_flags
from loadgen.config import DESCRIPTIONS, RunSettings
from loadgen.workload import Lengths


def run(*argv: str) -> RunSettings:
    p = argparse.ArgumentParser(prog="loadgen run", formatter_class=HelpFormatter)
    add_flags(p, RunSettings, DESCRIPTIONS)
    return from_flags(RunSettings, p.parse_args(list(argv)))


def test_no_flags_make_the_defaults():
    assert run() == RunSettings()
    assert (run().low_rate, run().input_tokens, run().priority_mix) == ((2.0, 5.0), Lengths.parse("32:256"), {"normal": 1.0})  # fmt: skip


def test_the_flags_are_read_into_the_settings():
    s = run("-n", "7", "--url", "http://h:1/v1", "--respect-eos", "--no-continuous-usage", "--quiet")
    assert (s.num_requests, s.url, s.ignore_eos, s.continuous_usage, s.quiet) == (7, "http://h:1", False, False, True)  # fmt: skip
    s = run("--priority-slo", "high:ttft=5", "--priority-slo", "low:e2el=9", "--slo", "ttft=1")
    assert s.priority_slo == (("high", {"ttft": 5.0}), ("low", {"e2el": 9.0})) and s.slo == {"ttft": 1.0}


def test_a_value_out_of_range_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        run("--low-rate", "x:y")
    assert "bad rate range 'x:y'" in capsys.readouterr().err
