"""loadgen against the real stack: the demo cluster's gateway and a stock SGLang server."""

from __future__ import annotations

import json

import pytest

from loadgen.cli import main

pytestmark = pytest.mark.e2e


def run(url, tmp_path, *extra):
    out = tmp_path / "r"
    main(
        [
            "run",
            "--url",
            url,
            "-n",
            "12",
            "--rate",
            "6",
            "--input-tokens",
            "20:60",
            "--output-tokens",
            "8:16",
            "--priority-mix",
            "high=0.5,normal=0.5",
            "--out",
            str(out),
            "--quiet",
            *extra,
        ]
    )
    return json.loads((tmp_path / "r.json").read_text())


def test_against_the_gateway(cluster, tiny_model, tmp_path):
    doc = run(cluster.config.gateway_url, tmp_path, "--tokenizer", str(tiny_model), "--warmup", "1")
    s, recs = doc["summary"], [r for r in doc["records"] if not r["warmup"]]
    assert (s["completed"], s["failed"]) == (12, 0)
    assert s["queue_ms"]["n"] == 12  # the gateway's X-Queue-Time-Ms
    assert all(8 <= r["output_tokens"] <= 16 for r in recs)  # ignore_eos: exactly what was asked
    # per-chunk usage relayed by the gateway: each event's token count is known (a chunk may carry several) ...
    assert all(sum(r["event_tokens"]) == r["output_tokens"] for r in recs)
    # ... so every token after the first event has its own gap
    assert s["itl_per_token_ms"]["n"] == sum(r["output_tokens"] - r["event_tokens"][0] for r in recs)
    assert s["tokens_counted_client_side"] == 0


def test_against_a_stock_sglang_server(stock_server, tmp_path):
    s = run(stock_server, tmp_path, "--api", "completions")["summary"]
    assert (s["completed"], s["failed"]) == (12, 0)
    assert s["queue_ms"]["n"] == 0  # no gateway, no queue header
    assert s["tpot_ms"]["p50"] > 0 and s["output_throughput"] > 0
