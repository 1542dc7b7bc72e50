"""flying.config: a frozen dataclass's settings make its flags, and the parsed flags make the dataclass."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Literal

import pytest

from flying import cli
from flying.cli import help_line
from flying.config import add_flags, describe, from_flags, require, setting


def _pair(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(":")
    return float(lo), float(hi or lo)


@dataclass(frozen=True, kw_only=True)
class Example:
    path: str = setting(help="a directory (required)")
    width: int = setting(8, "engines a group takes")
    rate: float = setting(1.5, "requests per second")
    mode: Literal["fast", "slow"] = setting("fast", "how it runs")
    check: bool = setting(True, "check as it goes")
    quiet: bool = setting(False, "no progress line", flag="--quiet")
    eager: bool = setting(True, "only later", flag="--no-eager")
    limit: int | None = setting(None, "at most this many (default: none)")
    port: int = setting(8000, "a TCP port", type=cli.port)
    span: tuple[float, float] = setting("2:5", "a range, low:high", type=_pair)
    count: int = setting(20, "how many", flag="-n", metavar="N", group="listing")
    tags: tuple[str, ...] = setting((), "a tag (repeat)")
    internal: int = 3  # no help: not a setting, no flag

    def __post_init__(self) -> None:
        require(self.width >= 1, f"width must be >= 1, got {self.width}")


def parser() -> argparse.ArgumentParser:
    p = cli.parser("example", "an example")
    add_flags(p, Example)
    return p


def flag(name: str) -> argparse.Action:
    return next(a for a in parser()._actions if name in a.option_strings)


def test_every_setting_is_a_flag_named_after_its_field_with_its_help_and_default():
    assert flag("--width").type is int and flag("--width").default == 8
    assert flag("--rate").type is float and flag("--width").help == "engines a group takes"
    assert flag("--path").required
    assert not any("--internal" in a.option_strings for a in parser()._actions)
    assert describe(Example)["width"] == "engines a group takes" and "internal" not in describe(Example)
    assert "(default: 8)" in parser().format_help()


def test_a_bool_is_a_pair_of_flags_or_one_switch_to_the_other_value():
    assert flag("--check").option_strings == ["--check", "--no-check"]
    assert parse("--no-check").check is False
    assert (parse().quiet, parse("--quiet").quiet) == (False, True)
    assert (parse().eager, parse("--no-eager").eager) == (True, False)
    assert "--no-quiet" not in parser().format_help()
    assert help_line(parser(), flag("--no-eager")).endswith("(default: False)"), "not given unless given"


def test_a_literal_is_a_choice():
    assert flag("--mode").choices == ("fast", "slow")
    assert parse("--mode", "slow").mode == "slow"
    with pytest.raises(SystemExit):
        parse("--mode", "medium")


def test_an_optional_setting_takes_its_type_and_is_none_unset():
    assert parse().limit is None and parse("--limit", "4").limit == 4
    assert "(default: none)" in parser().format_help() and "(default: None)" not in parser().format_help()


def test_a_flag_type_parses_the_value_and_a_text_default_shows_as_given():
    assert parse("--port", "80").port == 80
    with pytest.raises(SystemExit):
        parse("--port", "70000")
    assert parse().span == (2.0, 5.0) == Example(path="p").span
    assert parse("--span", "1:3").span == (1.0, 3.0)
    assert "(default: 2:5)" in parser().format_help()


def test_a_flag_name_metavar_and_group_where_given():
    assert parse("-n", "3").count == 3
    assert "-n N" in parser().format_help() and "listing:" in parser().format_help()


def test_a_tuple_setting_is_a_repeated_flag():
    assert parse().tags == () and parse("--tags", "a", "--tags", "b").tags == ("a", "b")


def test_parsing_no_flags_makes_the_defaults():
    assert parse() == Example(path="p")


def test_a_value_out_of_range_is_a_value_error_naming_the_setting():
    with pytest.raises(ValueError, match="^width must be >= 1, got 0$"):
        parse("--width", "0")
    with pytest.raises(ValueError, match="width must be >= 1"):
        dataclasses.replace(Example(path="p"), width=-1)


def test_others_are_taken_as_given():
    assert from_flags(Example, parser().parse_args(["--path", "p"]), internal=5, width=2).internal == 5


def parse(*argv: str) -> Example:
    return from_flags(Example, parser().parse_args(["--path", "p", *argv]))
