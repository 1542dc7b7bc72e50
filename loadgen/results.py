"""Result files: JSON (config, summary, time series and every request record) and CSV (one row per request)."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, fields
from pathlib import Path

from loadgen.metrics import RequestRecord

CSV_COLUMNS = (
    "index",
    "priority",
    "warmup",
    "scheduled_at",
    "sent_at",
    "dispatch_lag_ms",
    "status",
    "ok",
    "error",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
    "tokens_from_usage",
    "queue_ms",
    "ttft_ms",
    "tpot_ms",
    "e2el_ms",
    "events",
    "ended_at",
)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 3)


def csv_row(r: RequestRecord) -> dict:
    return {
        "index": r.index,
        "priority": r.priority,
        "warmup": r.warmup,
        "scheduled_at": round(r.scheduled_at, 6),
        "sent_at": None if math.isnan(r.sent_at) else round(r.sent_at, 6),
        "dispatch_lag_ms": None if math.isnan(r.sent_at) else _ms(r.dispatch_lag),
        "status": r.status,
        "ok": r.ok,
        "error": r.error,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "output_tokens": r.output_tokens,
        "tokens_from_usage": r.tokens_from_usage,
        "queue_ms": r.queue_ms,
        "ttft_ms": _ms(r.ttft) if r.ok else None,
        "tpot_ms": _ms(r.tpot) if r.ok else None,
        "e2el_ms": _ms(r.e2el) if r.ok else None,
        "events": len(r.event_times),
        "ended_at": None if math.isnan(r.ended_at) else round(r.ended_at, 6),
    }


def write(
    path: Path, config: dict, summary: dict, series: dict, records: list[RequestRecord]
) -> tuple[Path, Path]:
    """Write ``path`` (.json) and its .csv sibling; return both paths."""
    path = Path(path).with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "config": config,
        "summary": summary,
        "series": series,
        "records": [asdict(r) for r in records],  # NaN times (never sent, end unknown) become null
    }
    path.write_text(json.dumps(_finite(doc), indent=1, allow_nan=False))
    csv_path = path.with_suffix(".csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        w.writerows(csv_row(r) for r in records)
    return path, csv_path


def _finite(x):
    """NaN (an empty statistic) becomes null and an infinite rate "inf", so the file is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def read(path: Path) -> dict:
    """A result file with its records rebuilt as :class:`RequestRecord`."""
    doc = json.loads(Path(path).read_text())
    names = {f.name for f in fields(RequestRecord)}
    doc["records"] = [
        RequestRecord(
            **{
                **{k: v for k, v in r.items() if k in names},
                "sent_at": r["sent_at"] if r["sent_at"] is not None else math.nan,
                "ended_at": r["ended_at"] if r.get("ended_at") is not None else math.nan,
            }
        )
        for r in doc["records"]
    ]
    return doc
