"""The engine's crash report: the scheduler hooks (worker_ext.sglang_patches.crash) over a small stand-in of SGLang's
event loop, and the report they make written to a real Redis (worker_ext.crash_report)."""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import time
from collections import deque
from types import SimpleNamespace

import pytest

from flying.keys import Keys
from flying.messages import CrashReport, decode
from worker_ext.crash_report import WRITE_TIMEOUT_S, CrashReporter
from worker_ext.sglang_patches import crash


def batch(*rids: str) -> SimpleNamespace:
    return SimpleNamespace(
        reqs=[SimpleNamespace(rid=r, sampling_params=SimpleNamespace(stop_strs=[])) for r in rids]
    )


class Scheduler:
    """SGLang's event loop in small: ``steps`` are (batch, what raises: "run", "process" or "step"); the hooks wrap
    its run_batch, process_batch_result and run_event_loop as SGLang's HookRegistry would."""

    def __init__(self, steps, before=None) -> None:
        self.steps = steps
        self.running_batch, self.last_batch, self.chunked_req = batch(), None, None
        self.waiting_queue = batch("w~0").reqs
        self._run = crash.noting(before)
        self._process = crash.noting(None)
        self.fails: str | None = None

    def run_batch(self, b):
        return self._run(lambda s, b: self._raise_if(b, "run"), self, b)

    def process_batch_result(self, b, result):
        return self._process(lambda s, b, r: self._raise_if(b, "process"), self, b, result)

    def _raise_if(self, b, where: str) -> None:
        if self.fails == where:
            raise RuntimeError(f"boom in {where}")

    def loop(self) -> None:
        for b, fails in self.steps:
            self.fails = fails
            if fails == "step":
                raise ValueError("boom between batches")
            self.running_batch = b
            self.process_batch_result(b, self.run_batch(b))
            self.last_batch = b


def crash_of(scheduler: Scheduler) -> tuple[BaseException, list]:
    """Run the scheduler's loop under the crash hook; what the hook was called with (and re-raised)."""
    seen = []
    loop = crash.crashing(lambda s, exc, batches: seen.append((exc, batches)))
    with pytest.raises(Exception) as raised:
        loop(lambda s: s.loop(), scheduler)
    assert seen and seen[0][0] is raised.value, "the crash goes on to SGLang's handler"
    return seen[0]


@pytest.mark.parametrize("where", ["run", "process"])
def test_the_batch_whose_run_or_output_raised_is_the_crashing_batch(where):
    first, second = batch("a~0", "b~0"), batch("c~0")
    _, batches = crash_of(Scheduler([(first, None), (second, where)]))
    assert batches == [second]
    assert crash.batch_rids(batches) == ["c~0"]


def test_a_crash_between_batches_names_none():
    """Raised elsewhere in the loop (taking requests in, scheduling): no batch is to blame."""
    _, batches = crash_of(Scheduler([(batch("a~0"), None), (None, "step")]))
    assert batches == []


def test_an_exception_a_batch_raised_and_sglang_caught_is_not_a_later_crash():
    scheduler = Scheduler([(batch("a~0"), "run")])
    with pytest.raises(RuntimeError):
        scheduler.loop()  # (raised, noted, and caught before the loop's end)
    scheduler.steps = [(None, "step")]
    assert crash_of(scheduler)[1] == []


def test_under_overlap_scheduling_the_batches_whose_output_is_pending_are_named_too():
    launched, crashing = batch("a~0"), batch("b~0")
    scheduler = Scheduler([(crashing, "run")])
    scheduler.result_queue = deque([(launched, object())])
    assert crash_of(scheduler)[1] == [crashing, launched]


def test_a_crash_raised_by_the_before_batch_hook_names_its_batch():
    """The tests' poison hook raises before the batch runs: that batch is the crashing one."""
    marked = batch("p~0")
    marked.reqs[0].sampling_params.stop_strs = ["<x>"]

    def before(scheduler, b):
        if crash.stop_strings_in(b, "<x>"):
            raise RuntimeError("poison")

    _, batches = crash_of(Scheduler([(batch("a~0"), None), (marked, None)], before=before))
    assert batches == [marked]


def test_a_report_that_fails_leaves_the_crash_as_it_was(caplog):
    def broken(scheduler, exc, batches):
        raise AttributeError("a field SGLang no longer has")

    loop = crash.crashing(broken)
    with pytest.raises(ValueError, match="between batches"):
        loop(lambda s: s.loop(), Scheduler([(None, "step")]))
    assert "could not be reported" in caplog.text


def test_held_rids_are_every_request_the_scheduler_holds_once():
    scheduler = Scheduler([])
    scheduler.running_batch, scheduler.last_batch = batch("a~0", "b~0"), batch("b~0")
    scheduler.chunked_req = SimpleNamespace(rid="c~0")
    assert crash.held_rids(scheduler, [batch("d~0")]) == ["d~0", "a~0", "b~0", "c~0", "w~0"]


def test_sglangs_scheduler_has_what_the_hooks_wrap():
    """The hooks take the batch as the first argument of run_batch and process_batch_result (read from SGLang's
    source: importing its scheduler wants a device driver)."""
    spec = importlib.util.find_spec("sglang.srt.managers.scheduler")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(pathlib.Path(spec.origin).read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler"]
    methods = {f.name: [a.arg for a in f.args.args] for f in cls.body if isinstance(f, ast.FunctionDef)}
    assert methods["run_batch"][:2] == methods["process_batch_result"][:2] == ["self", "batch"]
    assert methods["run_event_loop"] == ["self"]


def test_the_report_is_in_redis_when_the_crash_goes_on(sync_redis, keys, redis_server):
    reporter = CrashReporter(3, redis_server.url, keys, launch_id="L")
    scheduler = Scheduler([(batch("a~0"), None), (batch("p~1"), "run")])
    exc, batches = crash_of(scheduler)
    written = reporter.report(scheduler, exc, batches)
    raw = sync_redis.get(keys.crash(3))
    assert raw is not None and decode(raw, CrashReport) == written
    assert written.batch == ("p~1",) and written.launch_id == "L"
    assert written.held == ("p~1", "a~0", "w~0"), "the crashing batch, the last one, the waiting queue"
    assert written.error == "RuntimeError: boom in run"


def test_a_report_that_cannot_be_written_is_logged_and_the_crash_goes_on(caplog):
    reporter = CrashReporter(0, "redis://127.0.0.1:1/0", Keys("t"))
    t0 = time.monotonic()
    reporter.report(Scheduler([]), RuntimeError("boom"), [batch("a~0")])
    assert time.monotonic() - t0 < 3 * WRITE_TIMEOUT_S
    assert "crash report not written" in caplog.text
