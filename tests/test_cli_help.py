"""Every option of flying-gateway, flying-router and flying-worker says what it does and its default."""

from __future__ import annotations

import argparse

import pytest

from flying.cli import help_line
from gateway.main import parser as gateway_parser
from router.main import POLICY_HELP
from router.main import parser as router_parser
from router.policy import PolicyConfig
from worker_ext.launch import parser as worker_parser


@pytest.mark.parametrize(
    "make", [gateway_parser, router_parser, worker_parser], ids=["gateway", "router", "worker"]
)
def test_every_option_has_a_help_line_with_its_default(make):
    p = make()
    options = [a for a in p._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    assert options
    for action in options:
        text = help_line(p, action)
        assert action.help, f"{action.option_strings[0]} has no help"
        assert action.required or "default" in text, f"{action.option_strings[0]}: no default in {text!r}"
        if action.required:
            assert "required" in text, f"{action.option_strings[0]}: say it is required"
    assert "(default: " in p.format_help()


def test_every_policy_field_has_a_help_line():
    fields = {f.name for f in __import__("dataclasses").fields(PolicyConfig)}
    assert set(POLICY_HELP) == fields


def test_help_renders_with_the_defaults():
    text = router_parser().format_help()
    assert "--max-width MAX_WIDTH" in text and "(default: 8)" in text
    assert "--log-format {text,json}" in gateway_parser().format_help()
