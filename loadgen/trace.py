"""Trace replay: arrival times and lengths from a CSV file.

The native columns are ``timestamp,input_tokens,output_tokens[,priority]``. Public traces are mapped by column
name: ``--trace-columns burstgpt`` / ``azure`` or an explicit ``timestamp=TIMESTAMP,input_tokens=ContextTokens,...``.
Timestamps may be numbers (seconds, or ``time_unit="ms"``) or ISO date-times; they are made relative to the first.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path


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
        has_priority = columns.priority is not None and columns.priority in (reader.fieldnames or [])
        for line, rec in enumerate(reader, start=2):
            try:
                rows.append(
                    TraceRow(
                        at=_seconds(rec[columns.timestamp], time_unit),
                        input_tokens=max(1, int(float(rec[columns.input_tokens]))),
                        output_tokens=max(1, int(float(rec[columns.output_tokens]))),
                        priority=(rec[columns.priority] or None) if has_priority else None,
                    )
                )
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line}: {exc}") from None
    if not rows:
        raise ValueError(f"{path}: no rows")
    rows.sort(key=lambda r: r.at)
    t0 = rows[0].at
    rows = [replace(r, at=(r.at - t0) / speed) for r in rows]
    return rows[:limit] if limit else rows
