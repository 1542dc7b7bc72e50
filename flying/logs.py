"""Logging for the three processes (``flying-gateway``, ``flying-router``, ``flying-worker``): one setup, two formats.

``text``: ``<time> <logger> <LEVEL> <message>``. ``json``: one object per line with ``ts`` (ISO 8601, UTC, ms),
``level``, ``logger``, ``msg``, then any ``extra`` fields the call passed: ``request_id`` (one request) or
``request_ids`` (a router round), the gateway's ``status``, ``priority``, ``engine``, ``queue_ms``,
``duration_ms``; ``exc`` holds a traceback. Messages that concern one request name its id in the text as well, so
``grep <id>`` finds them in either format.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import sys
import time
from typing import Any, Literal

LogFormat = Literal["text", "json"]
FORMATS: tuple[LogFormat, ...] = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in the message are escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update((k, v) for k, v in vars(record).items() if k not in _STANDARD)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return json.dumps(out, default=str, ensure_ascii=False)


def formatter(fmt: LogFormat) -> logging.Formatter:
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)


class LogHandler(logging.StreamHandler[Any]):
    """A flying process's handler: log records in ``fmt``, and a hot logger's INFO lines (:meth:`line`, one per
    request) formatted here the same way without a LogRecord; both leave in their order, and lines of one
    event-loop turn leave in one write."""

    def __init__(self, fmt: LogFormat, stream: Any = None) -> None:
        super().__init__(stream or sys.stderr)
        self.setFormatter(formatter(fmt))
        self.fmt = fmt
        self._pending: list[str] = []
        self._second = -1  # the second ``_stamp`` is of
        self._stamp = ""

    def line(self, name: str, msg: str, fields: dict[str, Any]) -> None:
        """What ``logging.getLogger(name).info(msg, extra=fields)`` writes through this handler."""
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            if self.fmt == "json":
                self._stamp = datetime.datetime.fromtimestamp(second, datetime.UTC).isoformat()[:19]
            else:
                self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        ms = int((now - second) * 1000)
        if self.fmt == "json":
            doc = {
                "ts": f"{self._stamp}.{ms:03d}+00:00",
                "level": "INFO",
                "logger": name,
                "msg": msg,
                **fields,
            }
            text = json.dumps(doc, default=str, ensure_ascii=False)
        else:
            text = f"{self._stamp},{ms:03d} {name} INFO {msg}"
        with self.lock or contextlib.nullcontext():  # (records may come from other threads)
            self._pending.append(text + self.terminator)
            first = len(self._pending) == 1
        if first:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no event loop: at once
                self.flush()

    def emit(self, record: logging.LogRecord) -> None:
        if self._pending:
            self.flush()  # the lines before it first
        super().emit(record)

    def flush(self) -> None:
        with self.lock or contextlib.nullcontext():  # (an RLock: emit holds it already)
            if self._pending:
                text = "".join(self._pending)
                self._pending.clear()
                try:
                    self.stream.write(text)
                except Exception:  # noqa: BLE001 - as logging does: a log line never fails its caller
                    if logging.raiseExceptions:
                        with contextlib.suppress(Exception):
                            sys.stderr.write("--- flying.logs: a log write failed\n")
            super().flush()


def handler(fmt: LogFormat, stream: Any = None) -> LogHandler:
    return LogHandler(fmt, stream)


def direct(log: logging.Logger) -> LogHandler | None:
    """The handler to give ``log``'s INFO lines to directly (:meth:`LogHandler.line`): where the record would
    reach only the root's one :class:`LogHandler` (set by :func:`setup`), with no filter on the way. None
    otherwise (another handler, a filter, a level that drops INFO: then log as usual)."""
    if not log.isEnabledFor(logging.INFO):
        return None
    node: logging.Logger | None = log
    while node is not None and node is not logging.root:
        if node.handlers or node.filters or not node.propagate:
            return None
        node = node.parent
    root = logging.root
    if root.filters or len(root.handlers) != 1:
        return None
    h = root.handlers[0]
    if type(h) is not LogHandler or h.filters or h.level > logging.INFO:
        return None
    return h


def setup(fmt: LogFormat = "text", level: int = logging.INFO) -> None:
    """The root logger of a flying process: ``fmt`` lines on stderr at ``level`` (replaces earlier handlers).
    httpx's line per HTTP call is left out below WARNING (the gateway's own request line says what it says)."""
    logging.basicConfig(level=level, handlers=[handler(fmt)], force=True)
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


FORMAT_HELP = "log lines as text or as one JSON object per line (ts, level, logger, msg, request_id)"


def add_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-format", choices=FORMATS, default="text", help=FORMAT_HELP)
