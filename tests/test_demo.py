"""flying-demo's arguments: every one checked before anything starts (the cluster takes most of a minute)."""

import pytest

from devstack import demo


@pytest.fixture
def nothing_starts(monkeypatch):
    def started(*_a, **_k):
        raise AssertionError("started something before checking the arguments")

    monkeypatch.setattr(demo, "ensure", started)
    monkeypatch.setattr(demo, "Cluster", started)
    monkeypatch.setattr(demo, "SentinelSet", started)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--engines", "0"], "argument --engines: must be at least 1, got 0"),
        (["--rate", "0", "--quiet-requests", "0"], "argument --rate: must be above 0, got 0"),
        (["--requests", "0"], "argument --requests: must be at least 1, got 0"),
        (["--quiet-rate", "0"], "argument --quiet-rate: must be above 0, got 0"),
        (["--quiet-requests", "-1"], "argument --quiet-requests: must be at least 0"),
        (["--rate", "fast"], "argument --rate: not a number: 'fast'"),
        (["--redis-url", "http://x"], "flying-demo: error: "),
        (["--quiet-tokens", "many"], "--quiet-tokens: expected lo:hi token counts, got 'many'"),
        (["--quiet-tokens", "3000:5000"], "--quiet-tokens: expected 1 <= lo <= hi <= 4088, got '3000:5000'"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(args, words, nothing_starts, capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(args)
    assert exc.value.code == 2 and words in capsys.readouterr().err


def test_the_workloads_are_made_from_the_arguments():
    quiet, burst = demo.workloads(demo.parser().parse_args(["--quiet-requests", "0", "--requests", "7"]))
    assert quiet is None and burst.num_requests == 7 and burst.arrivals.rate == 8.0
    quiet, _ = demo.workloads(demo.parser().parse_args(["--quiet-tokens", "2000:2500"]))
    assert (quiet.input_tokens.a, quiet.input_tokens.b, quiet.num_requests) == (2000, 2500, 4)


def test_help_has_the_whole_description_and_every_default(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "stops everything it started." in text
    for default in ("(default: 2)", "(default: 100)", "(default: 8.0)", "(default: 4)", "(default: 0.25)"):
        assert default in text
