"""GatewayConfig refuses a setting out of its range with a ValueError naming the setting; the CLI reports it as a
usage error."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from gateway.config import GatewayConfig
from gateway.main import parse_args


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("max_queue", 0, "max_queue must be >= 1, got 0"),
        ("queue_timeout_s", 0.0, "queue_timeout_s must be > 0, got 0.0"),
        ("request_timeout_s", -1.0, "request_timeout_s must be > 0, got -1.0"),
        ("default_max_tokens", 0, "default_max_tokens must be >= 1, got 0"),
        ("max_attempts", 0, "max_attempts must be >= 1, got 0"),
        ("max_wait_s", -1.0, r"max_wait_s must be >= 0 \(0: no bound by wait\), got -1.0"),
        ("redis_max_connections", 3, "redis_max_connections must be >= 4, got 3"),
        ("reconcile_s", 0.0, "reconcile_s must be > 0, got 0.0"),
        ("monitor_s", 0.0, "monitor_s must be > 0, got 0.0"),
        ("wait_budget_high_s", 0.0, "wait_budget_high_s must be > 0, got 0.0"),
        ("wait_budget_low_s", -1.0, "wait_budget_low_s must be > 0, got -1.0"),
    ],
)
def test_a_setting_out_of_range_is_a_value_error_naming_it(setting, value, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        GatewayConfig(model_path="m", **{setting: value})


def test_the_bounds_themselves_are_accepted():
    GatewayConfig(model_path="m", max_queue=1, default_max_tokens=1, max_attempts=1, max_wait_s=0, redis_max_connections=4)  # fmt: skip


def test_the_cli_reports_a_setting_out_of_range_as_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(["--model-path", "m", "--max-queue", "0"])
    assert exited.value.code == 2
    assert "max_queue must be >= 1, got 0" in capsys.readouterr().err


def test_each_class_waits_its_budget_capped_by_max_wait_and_queue_timeout():
    c = GatewayConfig(model_path="m", max_wait_s=30, queue_timeout_s=40)
    assert [c.wait_budget_s(p) for p in ("high", "normal", "low")] == [5.0, 20.0, 30.0]
    assert c.queue_wait_s("low") == 30.0
    off = GatewayConfig(model_path="m", max_wait_s=0, queue_timeout_s=40)
    assert off.wait_budget_s("high") is None and off.queue_wait_s("high") == 40.0
    parsed = parse_args(["--model-path", "m", "--wait-budget-high-s", "2", "--wait-budget-low-s", "90"])
    budgets = (parsed.wait_budget_high_s, parsed.wait_budget_normal_s, parsed.wait_budget_low_s)
    assert budgets == (2.0, 20.0, 90.0)


def test_a_gateway_that_cannot_start_says_why_before_it_starts(redis_server, tmp_path):
    """A missing model directory, or a Redis that does not answer (retried for a while: it may be starting beside
    the gateway), ends the gateway with one line saying so, not a traceback from inside the server."""
    from gateway.main import startable

    ok = GatewayConfig(model_path=str(tmp_path), redis_url=redis_server.url)
    startable(ok)
    with pytest.raises(SystemExit, match="--model-path /nonexistent: no such directory"):
        startable(dataclasses.replace(ok, model_path="/nonexistent"))
    with pytest.raises(SystemExit, match=r"Redis at redis://127.0.0.1:1/0 did not answer for 0 s"):
        startable(dataclasses.replace(ok, redis_url="redis://:secret@127.0.0.1:1/0"), redis_wait_s=0.1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot serve on 127.0.0.1:{port}: Address already in use"):
            startable(dataclasses.replace(ok, host="127.0.0.1", port=port))
        startable(
            dataclasses.replace(ok, host="127.0.0.1", port=port, reuse_port=True)
        )  # (gateways share it)


def test_an_api_key_file_that_cannot_be_read_is_a_usage_error(capsys, tmp_path):
    from gateway.main import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(["--model-path", str(tmp_path), "--api-key-file", str(tmp_path / "none")])
    assert exited.value.code == 2 and "--api-key-file" in capsys.readouterr().err
