"""flying.logs: the text and JSON formats; SGLang's JSON request lines lifted into ours (worker_ext)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import re
import threading
from datetime import datetime

import pytest

from flying import logs


def emit(fmt: str, *args, **kw) -> str:
    out = io.StringIO()
    log = logging.getLogger("flying.test_logs")
    log.handlers, log.propagate = [logs.handler(fmt, out)], False
    log.setLevel(logging.INFO)
    try:
        log.info(*args, **kw)
    finally:
        log.handlers, log.propagate = [], True
    return out.getvalue()


def test_json_is_one_object_per_line_with_the_request_id():
    line = emit("json", "request %s done\nin two lines", "r-1", extra={"request_id": "r-1", "queue_ms": 1.5})
    assert line.count("\n") == 1
    rec = json.loads(line)
    assert rec["level"] == "INFO" and rec["logger"] == "flying.test_logs"
    assert rec["msg"] == "request r-1 done\nin two lines"
    assert rec["request_id"] == "r-1" and rec["queue_ms"] == 1.5
    assert rec["ts"].endswith("+00:00") and "T" in rec["ts"]
    assert set(rec) == {"ts", "level", "logger", "msg", "request_id", "queue_ms"}


def test_json_carries_the_traceback_and_serializes_anything():
    out = io.StringIO()
    log = logging.getLogger("flying.test_logs.exc")
    log.handlers, log.propagate = [logs.handler("json", out)], False
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed", extra={"obj": object()})
    rec = json.loads(out.getvalue())
    assert "ValueError: boom" in rec["exc"] and rec["obj"].startswith("<object")


def test_text_names_the_id_in_the_message():
    line = emit("text", "request %s done", "r-2", extra={"request_id": "r-2"})
    assert "flying.test_logs INFO request r-2 done" in line


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="log format must be one of text, json, got 'xml'"):
        logs.formatter("xml")  # type: ignore[arg-type]


def test_sglang_json_request_lines_become_ours():
    """The worker's plugin gives SGLang's request logger our JSON handler before SGLang makes it; SGLang adds no
    handler of its own to a logger that has one, and its JSON line's rid becomes request_id."""
    from sglang.srt.utils import log_utils, request_logger

    from worker_ext import sglang_patches

    assert f"{request_logger.__name__}.stdout" == sglang_patches.REQUEST_LOGGER
    out = io.StringIO()
    log = logging.getLogger(sglang_patches.REQUEST_LOGGER)
    saved = log.handlers[:], log.filters[:], log.propagate
    log.handlers, log.filters = [], []
    try:
        sglang_patches.apply_request_log_handler(logs.handler("json", out))
        [target] = log_utils.create_log_targets(targets=None, name_prefix=request_logger.__name__)
        assert target is log and len(log.handlers) == 1
        log_utils.log_json(
            target, "request.finished", {"rid": "abc", "out": {"meta_info": {"e2e_latency": 0.1}}}
        )
        log_utils.log_json(target, "request.received", {"rid": "abc~1"})  # the gateway's second dispatch
        log_utils.log_json(target, "request.received", {"rid": ["n2~0_0", "n2~0_1"]})  # n choices
    finally:
        log.handlers, log.filters, log.propagate = saved[0], saved[1], saved[2]
    rec, again, choices = (json.loads(line) for line in out.getvalue().splitlines())
    assert rec["request_id"] == "abc" and rec["msg"] == "request.finished abc" and "attempt" not in rec
    assert rec["sglang"]["out"]["meta_info"]["e2e_latency"] == 0.1
    assert (again["request_id"], again["attempt"], again["msg"]) == ("abc", 1, "request.received abc~1")
    assert (choices["request_id"], choices["attempt"]) == ("n2", 0)


def test_setup_replaces_the_root_handler_and_quiets_httpx():
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.setup("json")
        assert isinstance(root.handlers[0].formatter, logs.JsonFormatter) and len(root.handlers) == 1
        assert logging.getLogger("httpx").getEffectiveLevel() == logging.WARNING
    finally:
        root.handlers, root.level = saved
        logging.getLogger("httpx").setLevel(logging.NOTSET)


@contextlib.contextmanager
def root_handler(fmt: str):
    """The root's one handler a LogHandler on a StringIO, as ``setup`` leaves it; the root restored after."""
    root, out = logging.getLogger(), io.StringIO()
    saved = root.handlers[:], root.level
    root.handlers, root.level = [logs.handler(fmt, out)], logging.INFO
    try:
        yield out
    finally:
        root.handlers, root.level = saved


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_direct_line_is_what_logging_writes(fmt):
    """LogHandler.line writes what the logger's info(msg, extra=...) writes through the same handler, time aside."""
    log = logging.getLogger("flying.test_logs.direct")
    fields = {"request_id": "r-3", "status": 200, "engine": None, "queue_ms": 0.5}
    with root_handler(fmt) as out:
        direct = logs.direct(log)
        assert direct is not None
        log.info("request %s done", "r-3", extra=fields)
        direct.line(log.name, "request r-3 done", fields)
    via_logging, via_line = out.getvalue().splitlines()
    if fmt == "json":
        a, b = json.loads(via_logging), json.loads(via_line)
        assert (
            abs(datetime.fromisoformat(a.pop("ts")) - datetime.fromisoformat(b.pop("ts"))).total_seconds() < 1
        )
        assert list(a.items()) == list(b.items())
    else:
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", via_line[:24])
        assert via_logging[24:] == via_line[24:] == "flying.test_logs.direct INFO request r-3 done"


def test_direct_lines_of_one_loop_turn_leave_together_and_before_later_records():
    log = logging.getLogger("flying.test_logs.turn")

    async def turn(out: io.StringIO) -> tuple[str, str]:
        direct = logs.direct(log)
        assert direct is not None
        direct.line(log.name, "first", {})
        direct.line(log.name, "second", {})
        held = out.getvalue()  # not written yet: the turn's lines leave at its end
        log.warning("third")  # a record through the handler: the lines before it go first
        await asyncio.sleep(0)
        return held, out.getvalue()

    with root_handler("text") as out:
        held, written = asyncio.run(turn(out))
    assert held == ""
    assert [line.split(" ", 4)[-1] for line in written.splitlines()] == ["first", "second", "third"]


def test_no_direct_lines_where_a_record_would_go_elsewhere():
    """A handler or filter on the way, a level that drops INFO, or a root handler of another kind: log as usual."""
    log = logging.getLogger("flying.test_logs.elsewhere")
    with root_handler("text"):
        assert logs.direct(log) is not None
        log.addFilter(lambda r: True)
        assert logs.direct(log) is None
        log.filters.clear()
        logging.getLogger("flying.test_logs").addHandler(extra := logging.NullHandler())
        assert logs.direct(log) is None
        logging.getLogger("flying.test_logs").removeHandler(extra)
        log.setLevel(logging.WARNING)
        assert logs.direct(log) is None
        log.setLevel(logging.NOTSET)
        logging.getLogger().handlers.append(logging.NullHandler())  # pytest's caplog adds its own like this
        assert logs.direct(log) is None


def test_direct_lines_and_records_from_many_threads_are_all_written_whole():
    log = logging.getLogger("flying.test_logs.threads")

    def write(i: int) -> None:
        direct = logs.direct(log)
        assert direct is not None
        for k in range(300):
            direct.line(log.name, f"line {i} {k}", {})
            log.warning("record %d %d", i, k)

    with root_handler("text") as out:
        threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    got = [line.split(" ", 4)[-1] for line in out.getvalue().splitlines()]
    assert sorted(got) == sorted(
        f"{kind} {i} {k}" for kind in ("line", "record") for i in range(4) for k in range(300)
    )
    for i in range(4):  # one thread's lines and records in the order it wrote them
        mine = [g for g in got if g.split()[1] == str(i)]
        assert mine == [f"{kind} {i} {k}" for k in range(300) for kind in ("line", "record")]
