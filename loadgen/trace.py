"""Trace replay: arrival times and lengths from a CSV file, or from Mooncake's JSONL with shared prefixes.

The native columns are ``timestamp,input_tokens,output_tokens[,priority]``. Public traces are mapped by column
name: ``--trace-columns burstgpt`` / ``azure`` or an explicit ``timestamp=TIMESTAMP,input_tokens=ContextTokens,...``.
Timestamps may be numbers (seconds, or ``time_unit="ms"``) or ISO date-times; they are made relative to the first.

Mooncake's traces (FAST '25) are JSON lines ``{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids":
[...]}``, one hash id per :data:`MOONCAKE_BLOCK` prompt tokens, equal ids where prompts share a prefix
(:func:`read_mooncake`).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import TypeVar

PRIORITIES = ("high", "normal", "low")  # the gateway's X-Priority classes (flying.messages.Priority)


@dataclass(frozen=True)
class TraceColumns:
    timestamp: str = "timestamp"
    input_tokens: str = "input_tokens"
    output_tokens: str = "output_tokens"
    priority: str | None = "priority"


PRESETS = {
    "native": TraceColumns(),
    "burstgpt": TraceColumns("Timestamp", "Request tokens", "Response tokens", None),
    "azure": TraceColumns("TIMESTAMP", "ContextTokens", "GeneratedTokens", None),
}


@dataclass(frozen=True)
class TraceRow:
    at: float
    input_tokens: int
    output_tokens: int
    priority: str | None = None


MOONCAKE_BLOCK = 512  # prompt tokens per hash id in Mooncake's traces


@dataclass(frozen=True)
class MooncakeRow:
    at: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]  # one per MOONCAKE_BLOCK prompt tokens (the last may be partial)


def read_mooncake(path: str | Path, speed: float = 1.0, limit: int | None = None) -> list[MooncakeRow]:
    """Mooncake's JSONL trace, sorted by time, relative to the first request, ``speed`` times faster. Bad lines raise
    ValueError naming the line."""
    if speed <= 0:
        raise ValueError("trace speed must be positive")
    rows: list[MooncakeRow] = []
    with open(path) as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                rec = json.loads(text)
                rows.append(
                    MooncakeRow(
                        at=float(rec["timestamp"]) / 1000.0,
                        input_tokens=_tokens(rec["input_length"], "input_length"),
                        output_tokens=_tokens(rec["output_length"], "output_length"),
                        hash_ids=tuple(int(h) for h in rec.get("hash_ids", ())),
                    )
                )
            except (KeyError, TypeError, ValueError) as exc:
                what = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
                raise ValueError(f"{path}:{line}: {what}") from None
    return _replayed(rows, path, speed, limit)


Row = TypeVar("Row", TraceRow, MooncakeRow)


def _replayed(rows: list[Row], path: str | Path, speed: float, limit: int | None) -> list[Row]:
    """A trace's rows sorted by time, relative to the first, ``speed`` times faster, the first ``limit``."""
    if not rows:
        raise ValueError(f"{path}: no rows")
    rows.sort(key=lambda r: r.at)
    t0 = rows[0].at
    rows = [replace(r, at=(r.at - t0) / speed) for r in rows]
    return rows[:limit] if limit else rows


def parse_columns(spec: str) -> TraceColumns:
    """``burstgpt`` | ``azure`` | ``native`` | ``timestamp=A,input_tokens=B,output_tokens=C[,priority=D]``."""
    if spec in PRESETS:
        return PRESETS[spec]
    fields = dict(TraceColumns().__dict__)
    for part in spec.split(","):
        key, sep, col = part.partition("=")
        if not sep or key.strip() not in fields:
            raise ValueError(f"bad trace column mapping {part!r}; keys are {', '.join(fields)}")
        fields[key.strip()] = col.strip()
    return replace(TraceColumns(), **fields)


def _seconds(value: str, time_unit: str) -> float:
    try:
        x = float(value)
    except ValueError:
        v = value.strip().replace("Z", "+00:00")
        head, dot, frac = v.partition(".")
        if dot:  # Python's parser takes at most 6 fractional digits (Azure writes 7)
            digits = "".join(c for c in frac if c.isdigit())
            v = f"{head}.{digits[:6]}{frac[len(digits) :]}"
        return datetime.fromisoformat(v).timestamp()
    return x / 1000.0 if time_unit == "ms" else x


def _tokens(value: str | float, column: str) -> int:
    """A token count of at least 1 (a zero-length response still asks for one token); ValueError when negative."""
    n = int(float(value))
    if n < 0:
        raise ValueError(f"{column} is {n}: a token count cannot be negative")
    return max(1, n)


def _priority(value: str | None) -> str | None:
    """A priority class, or None where the cell is empty (the workload's mix decides)."""
    if not value:
        return None
    if value not in PRIORITIES:
        raise ValueError(f"unknown priority {value!r} (the classes are {', '.join(PRIORITIES)})")
    return value


def read_trace(
    path: str | Path,
    columns: TraceColumns = TraceColumns(),
    time_unit: str = "s",
    speed: float = 1.0,
    limit: int | None = None,
) -> list[TraceRow]:
    """Rows sorted by time, relative to the first; ``speed`` > 1 replays faster. Bad rows raise ValueError
    naming the line."""
    if speed <= 0:
        raise ValueError("trace speed must be positive")
    rows: list[TraceRow] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        need = [columns.timestamp, columns.input_tokens, columns.output_tokens]
        missing = [c for c in need if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing}; found {reader.fieldnames}")
        prio = columns.priority if columns.priority in (reader.fieldnames or []) else None
        for line, rec in enumerate(reader, start=2):
            try:
                rows.append(
                    TraceRow(
                        at=_seconds(rec[columns.timestamp], time_unit),
                        input_tokens=_tokens(rec[columns.input_tokens], columns.input_tokens),
                        output_tokens=_tokens(rec[columns.output_tokens], columns.output_tokens),
                        priority=_priority(rec[prio]) if prio else None,
                    )
                )
            except (TypeError, ValueError, OverflowError) as exc:
                raise ValueError(f"{path}:{line}: {exc}") from None
    return _replayed(rows, path, speed, limit)
