"""The loadgen CLI end to end against the fast fake endpoint (a separate process), and its error paths."""

import csv
import json

import pytest

from flying.procs import free_port, stop
from loadgen.cli import main
from loadgen.fake_server import start_process


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    proc, url = start_process(tmp_path_factory.mktemp("fake") / "fake.log", itl_ms=1)
    yield url
    stop(proc)


def test_run_writes_json_csv_png_and_counts_every_token(fake, tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(
        [
            "run",
            "--url",
            fake,
            "-n",
            "40",
            "--rate",
            "200",
            "--output-tokens",
            "5",
            "--priority-mix",
            "high=0.25,normal=0.75",
            "--warmup",
            "2",
            "--slo",
            "ttft=1000,tpot=100",
            "--priority-slo",
            "high:ttft=2000",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    doc = json.loads((tmp_path / "run.json").read_text())
    s = doc["summary"]
    assert (s["requests"], s["completed"], s["failed"]) == (40, 40, 0)
    assert s["output_throughput"] * s["duration_s"] == pytest.approx(200)  # 40 x 5 tokens from usage
    assert s["itl_per_token_ms"]["n"] == 40 * 4  # per-chunk usage: every token gap is known
    assert s["queue_ms"]["p50"] == 0.5  # the X-Queue-Time-Ms header is read
    assert set(s["by_priority"]) == {"high", "normal"}
    assert s["goodput"] > 0 and set(s["goodput_by_priority"]) == {"high", "normal"}
    assert s["slo_ms_by_priority"] == {"high": {"ttft": 2000.0}}
    assert len(doc["records"]) == 42 and sum(r["warmup"] for r in doc["records"]) == 2
    rows = list(csv.DictReader((tmp_path / "run.csv").read_text().splitlines()))
    assert len(rows) == 42 and all(r["ok"] == "True" for r in rows)
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"
    assert "TTFT p50" in capsys.readouterr().out


def test_completions_api_without_per_chunk_usage(fake, tmp_path):
    out = tmp_path / "c"
    assert (
        main(
            [
                "run",
                "--url",
                fake,
                "--api",
                "completions",
                "-n",
                "5",
                "--rate",
                "inf",
                "--output-tokens",
                "3",
                "--no-continuous-usage",
                "--out",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    s = json.loads((tmp_path / "c.json").read_text())["summary"]
    assert s["completed"] == 5 and s["itl_ms"]["n"] == 10 and s["tokens_counted_client_side"] == 0


def test_compare_puts_runs_side_by_side(fake, tmp_path, capsys):
    for name, rate in (("slow", "20"), ("fast", "100")):
        main(
            [
                "run",
                "--url",
                fake,
                "-n",
                "10",
                "--rate",
                rate,
                "--output-tokens",
                "2",
                "--out",
                str(tmp_path / name),
                "--quiet",
            ]
        )
    capsys.readouterr()
    assert (
        main(
            [
                "compare",
                str(tmp_path / "slow.json"),
                str(tmp_path / "fast.json"),
                "--plot",
                str(tmp_path / "cmp.png"),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    header = text.splitlines()[0].split()
    assert header[-2:] == ["slow", "fast"] and "TTFT p90 ms" in text and "completed" in text
    assert (tmp_path / "cmp.png").exists()


def test_unreachable_server_is_counted_not_a_crash(tmp_path):
    out = tmp_path / "dead"
    rc = main(
        [
            "run",
            "--url",
            f"http://127.0.0.1:{free_port()}",
            "--model",
            "m",
            "-n",
            "3",
            "--rate",
            "inf",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    s = json.loads((tmp_path / "dead.json").read_text())["summary"]
    assert rc == 1 and s["failed"] == 3 and s["errors"] == {"transport": 3}


def test_http_errors_are_counted(fake, tmp_path):
    rc = main(
        [
            "run",
            "--url",
            fake + "/nope",
            "--model",
            "m",
            "-n",
            "2",
            "--rate",
            "inf",
            "--out",
            str(tmp_path / "e"),
            "--quiet",
        ]
    )
    s = json.loads((tmp_path / "e.json").read_text())["summary"]
    assert rc == 1 and s["errors"] == {"HTTP 404": 2}


def test_timeouts_are_counted(tmp_path, capsys):
    """...in the summary (with when they ended) and in the plotted series, which run to the failures' end, past
    the last arrival."""
    proc, url = start_process(tmp_path / "slow.log", ttft_ms=3000)
    try:
        assert (
            main(
                [
                    "run",
                    "--url",
                    url,
                    "-n",
                    "2",
                    "--rate",
                    "inf",
                    "--timeout",
                    "0.3",
                    "--bucket",
                    "0.1",
                    "--out",
                    str(tmp_path / "t"),
                    "--quiet",
                ]
            )
            == 1
        )
    finally:
        stop(proc)
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["summary"]["errors"] == {"timeout": 2}
    first, last = doc["summary"]["errors_span_s"]["timeout"]
    assert 0.3 <= first <= last < 1.0
    assert "errors: timeout x2 (ended 0.3-" in capsys.readouterr().out
    series = doc["series"]
    assert series["last_sent_s"] < 0.1 and series["t"][-1] >= 0.2  # the plot runs to the timeouts
    assert sum(series["failed_per_s"]["timeout"]) * 0.1 == pytest.approx(2)
    assert series["failed_per_s"]["timeout"][int(first // 0.1)] > 0


@pytest.mark.parametrize(
    "args",
    [
        ["--input-tokens", "9:3"],
        ["--priority-mix", "high"],
        ["--slo", "latency=3"],
        ["--priority-slo", "urgent:ttft=1"],
        ["--arrival", "weekly"],
    ],
)
def test_bad_arguments_exit_2(args, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--model", "m", *args])
    assert exc.value.code == 2


def test_bad_trace_file_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "t.csv").write_text("a,b\n1,2\n")
    assert main(["run", "--model", "m", "--trace", str(tmp_path / "t.csv")]) == 2
    assert "missing column" in capsys.readouterr().err


def test_sessions_record_cached_tokens_and_report_the_hit_rate(fake, tmp_path, capsys):
    out = tmp_path / "sessions"
    args = ["run", "--url", fake, "-n", "6", "--rate", "inf", "--max-concurrency", "2", "--input-tokens", "8",
            "--output-tokens", "4", "--system-prompts", "2", "--system-prompt-words", "200", "--turns", "2",
            "--out", str(out), "--quiet"]  # fmt: skip
    assert main(args) == 0
    s = json.loads(out.with_suffix(".json").read_text())["summary"]
    assert (s["requests"], s["completed"]) == (12, 12)
    rows = list(csv.DictReader(out.with_suffix(".csv").read_text().splitlines()))
    cached, prompt = sum(int(r["cached_tokens"]) for r in rows), sum(int(r["prompt_tokens"]) for r in rows)
    assert s["cached_tokens"] == cached and s["cache_hit_rate"] == pytest.approx(cached / prompt)
    assert s["cache_hit_rate"] > 0.5, "2 system prompts of 200 words shared by 6 sessions of 2 turns"
    assert f"prefix cache: {cached} of {prompt} prompt tokens cached" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, words",
    [
        (["--input-tokens", "512:64"], "argument --input-tokens: bad length spec '512:64': low > high"),
        (["--priority-mix", "foo"], "argument --priority-mix: bad priority mix 'foo'"),
        (["--slo", "ttft=abc"], "bad SLO 'ttft=abc': 'abc' is not a number of ms"),
        (["--low-rate", "a:b"], "argument --low-rate: bad rate range 'a:b'"),
        (["--tokenizer", "/nonexistent"], "--tokenizer /nonexistent: no tokenizer.json there"),
        (["--out", "/proc/forbidden/x"], "--out /proc/forbidden/x: cannot write there"),
    ],
)
def test_bad_arguments_say_what_is_wrong_before_anything_runs(args, words, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--url", "http://127.0.0.1:9", "-n", "1", *args])
    assert words in f"{exc.value.code} {capsys.readouterr().err}"


@pytest.mark.parametrize(
    "args, words",
    [
        (["--bucket", "0"], "argument --bucket: must be above 0, got 0"),
        (["--bucket", "-1"], "argument --bucket: must be above 0, got -1"),
        (["--timeout", "0"], "argument --timeout: must be above 0"),
        (["--timeout", "-1"], "argument --timeout: must be above 0"),
        (["--warmup", "-1"], "argument --warmup: must be at least 0"),
        (["--max-concurrency", "-1"], "argument --max-concurrency: must be at least 1"),
        (["--max-concurrency", "0"], "argument --max-concurrency: must be at least 1"),
        (["-n", "0"], "argument -n/--num-requests: must be at least 1"),
        (["--output-tokens", "0"], "bad length spec '0': at least 1 token"),
        (["--input-tokens", "0:64"], "bad length spec '0:64': at least 1 token"),
        (["--slo", "ttft=-5"], "bad SLO 'ttft=-5': a bound is above 0 ms"),
        (["--long-share", "1.5"], "argument --long-share: must be from 0 to 1, got 1.5"),
        (["--turns", "0"], "argument --turns: must be at least 1"),
        (["--trace-speed", "0"], "argument --trace-speed: must be above 0"),
        (["--priority-mix", "urgent=1"], "unknown class 'urgent' (the classes are high, normal, low)"),
    ],
)
def test_values_that_would_spoil_the_run_are_refused_when_parsed(args, words, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--url", "http://127.0.0.1:9", "--model", "m", *args])
    assert exc.value.code == 2 and words in capsys.readouterr().err


def test_trace_columns_without_a_trace_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--url", "http://127.0.0.1:9", "--model", "m", "--trace-columns", "burstgpt"])
    assert "--trace-columns describes a --trace file; none was given" in str(exc.value.code)


def test_a_trace_is_replayed_whole_unless_n_cuts_it(fake, tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text(
        "timestamp,input_tokens,output_tokens\n" + "".join(f"{i / 1000},4,2\n" for i in range(130))
    )
    base = ["run", "--url", fake, "--trace", str(trace), "--quiet"]
    assert main([*base, "--out", str(tmp_path / "all")]) == 0
    assert json.loads((tmp_path / "all.json").read_text())["summary"]["requests"] == 130  # more than -n's 100
    assert main([*base, "-n", "7", "--out", str(tmp_path / "cut")]) == 0
    assert json.loads((tmp_path / "cut.json").read_text())["summary"]["requests"] == 7


def test_a_trace_with_an_unknown_priority_names_the_row(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("timestamp,input_tokens,output_tokens,priority\n0,5,5,high\n1,5,5,urgent\n")
    assert main(["run", "--url", "http://127.0.0.1:9", "--model", "m", "--trace", str(trace)]) == 2
    assert f"loadgen: {trace}:3: unknown priority 'urgent'" in capsys.readouterr().err


def run_args(url: str, out, *more: str) -> list[str]:
    return ["run", "--url", url, "-n", "4", "--rate", "inf", "--output-tokens", "2", "--out", str(out), "--quiet", *more]  # fmt: skip


def test_a_failing_plot_or_report_after_the_run_keeps_its_results(fake, tmp_path, monkeypatch, capsys):
    from loadgen import cli, metrics

    def broken(*_a, **_k):
        raise RuntimeError("no plot today")

    monkeypatch.setattr(cli.plots, "timeline", broken)
    assert main(run_args(fake, tmp_path / "a")) == 0
    assert json.loads((tmp_path / "a.json").read_text())["summary"]["completed"] == 4
    assert len((tmp_path / "a.csv").read_text().splitlines()) == 5 and not (tmp_path / "a.png").exists()
    assert "a.png not drawn (RuntimeError('no plot today'))" in capsys.readouterr().err

    monkeypatch.setattr(metrics, "timeseries", broken)  # the report stage itself fails
    with pytest.raises(RuntimeError):
        main(run_args(fake, tmp_path / "b"))
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["series"] is None and len(doc["records"]) == 4 and doc["summary"]["completed"] == 4
    assert len((tmp_path / "b.csv").read_text().splitlines()) == 5
    assert main(["compare", str(tmp_path / "b.json")]) == 2
    assert "b.json: not a loadgen result (only the run's records" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, why",
    [
        ("{}", "no config, summary, series, records"),
        ('{"args": {}, "summary": {"dp": {}}}', "no config, series, records"),  # a flying-sim summary.json
        ("[1, 2]", "a JSON list"),
        ("index,priority\n0,high\n", "not JSON: Expecting value: line 1 column 1"),
    ],
)
def test_compare_says_which_file_is_not_a_loadgen_result(text, why, tmp_path, capsys):
    f = tmp_path / "x.json"
    f.write_text(text)
    assert main(["compare", str(f)]) == 2
    assert f"loadgen: {f}: not a loadgen result ({why}" in capsys.readouterr().err


def test_the_api_key_is_sent_from_the_option_or_the_environment_and_not_kept(tmp_path, monkeypatch, capsys):
    proc, url = start_process(tmp_path / "keyed.log", api_key="sk-test")
    try:
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        assert main(run_args(url, tmp_path / "none", "--model", "m")) == 1
        s = json.loads((tmp_path / "none.json").read_text())["summary"]
        assert s["errors"] == {"HTTP 401": 4}
        assert main(run_args(url, tmp_path / "opt", "--api-key", "sk-test")) == 0  # /v1/models too
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
        assert main(run_args(url, tmp_path / "env", "--api-key=sk-test", "--warmup", "1")) == 0
        assert main(run_args(url, tmp_path / "env")) == 0
    finally:
        stop(proc)
    for name in ("opt", "env"):
        text = (tmp_path / f"{name}.json").read_text()
        assert "sk-test" not in text and json.loads(text)["summary"]["completed"] == 4
    assert '"api_key": "***"' in (tmp_path / "opt.json").read_text()


def test_help_has_the_whole_description_and_every_default(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "report serving metrics; loadgen compare puts result files side by side." in text
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 1.0)", "(default: 32:256)", "(default: normal=1)", "(default: no limit)",
                    "(default: env OPENAI_API_KEY, else none)", "(default: 300.0)"):  # fmt: skip
        assert default in text


def test_an_openai_style_base_url_ending_in_v1_is_taken_as_the_server(fake, tmp_path):
    out = tmp_path / "v1"
    rc = main(
        ["run", "--url", fake + "/v1/", "-n", "4", "--rate", "inf", "--output-tokens", "3", "--out", str(out)]
    )
    assert rc == 0
    assert json.loads(out.with_suffix(".json").read_text())["summary"]["completed"] == 4


@pytest.mark.parametrize("url", ["notaurl", "localhost:8000", "ftp://host", "http://"])
def test_a_url_that_is_no_http_url_is_refused_before_anything_runs(url, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--url", url, "--model", "m", "-n", "1", "--out", str(tmp_path / "x")])
    assert exc.value.code == 2 and "--url: must be an http:// or https:// URL" in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "nothing written"
