"""Logging for the three processes (``flying-gateway``, ``flying-router``, ``flying-worker``): one setup, two formats.

``text``: ``<time> <logger> <LEVEL> <message>``. ``json``: one object per line with ``ts`` (ISO 8601, UTC, ms),
``level``, ``logger``, ``msg``, then any ``extra`` fields the call passed: ``request_id`` (one request) or
``request_ids`` (a router round), the gateway's ``status``, ``priority``, ``engine``, ``queue_ms``,
``duration_ms``; ``exc`` holds a traceback. Messages that concern one request name its id in the text as well, so
``grep <id>`` finds them in either format.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
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


def handler(fmt: LogFormat, stream: Any = None) -> logging.Handler:
    h = logging.StreamHandler(stream or sys.stderr)
    h.setFormatter(formatter(fmt))
    return h


def setup(fmt: LogFormat = "text", level: int = logging.INFO) -> None:
    """The root logger of a flying process: ``fmt`` lines on stderr at ``level`` (replaces earlier handlers).
    httpx's line per HTTP call is left out below WARNING (the gateway's own request line says what it says)."""
    logging.basicConfig(level=level, handlers=[handler(fmt)], force=True)
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


def add_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text",
        help="log lines as text or as one JSON object per line (ts, level, logger, msg, request_id)",
    )
