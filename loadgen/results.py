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
    path: Path, config: dict, summary: dict | None, series: dict | None, records: list[RequestRecord]
) -> tuple[Path, Path]:
    """Write ``path`` (.json) and its .csv sibling, the raw records first (the CSV); return both paths. A summary
    or series that could not be made is None (null): the records are kept whatever failed after the run."""
    path = Path(path).with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    csv_path = path.with_suffix(".csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        w.writerows(csv_row(r) for r in records)
    doc = {
        "config": config,
        "summary": summary,
        "series": series,
        "records": [asdict(r) for r in records],  # NaN times (never sent, end unknown) become null
    }
    path.write_text(json.dumps(finite(doc), indent=1, allow_nan=False, default=str))
    return path, csv_path


def finite(x):
    """NaN (an empty statistic) becomes null and an infinite rate "inf", so the file is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else str(x)
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite(v) for v in x]
    return x


class NotAResult(ValueError):
    """A file ``loadgen compare`` cannot read as a result of ``loadgen run``."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: not a loadgen result ({why})")


KEYS = ("config", "summary", "series", "records")
SUMMARY_KEYS = ("completed", "failed", "ttft_ms", "tpot_ms", "by_priority")  # some of what compare shows


def read(path: Path) -> dict:
    """A result file with its records rebuilt as :class:`RequestRecord`; :class:`NotAResult` saying why when it
    is not one (not JSON, another tool's JSON, a run whose summary could not be made)."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise NotAResult(path, f"cannot read it: {exc.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotAResult(path, f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or (missing := [k for k in KEYS if k not in doc]):
        what = "no " + ", ".join(missing) if isinstance(doc, dict) else f"a JSON {type(doc).__name__}"
        raise NotAResult(path, f"{what}; expected the .json that loadgen run --out writes")
    if doc["summary"] is None or doc["series"] is None:
        raise NotAResult(path, "only the run's records: its summary or time series could not be made")
    if not all(isinstance(doc[k], dict) for k in KEYS[:3]) or not isinstance(doc["records"], list):
        raise NotAResult(path, "config, summary and series are not objects, or records not a list")
    if missing := [k for k in SUMMARY_KEYS if k not in doc["summary"]]:
        raise NotAResult(path, f"its summary has no {', '.join(missing)}")
    try:
        doc["records"] = [_record(r) for r in doc["records"]]
    except (TypeError, KeyError, AttributeError) as exc:
        raise NotAResult(path, f"a record cannot be read: {exc!r}") from None
    return doc


def _record(r: dict) -> RequestRecord:
    names = {f.name for f in fields(RequestRecord)}
    return RequestRecord(
        **{
            **{k: v for k, v in r.items() if k in names},
            "sent_at": r["sent_at"] if r["sent_at"] is not None else math.nan,
            "ended_at": r["ended_at"] if r.get("ended_at") is not None else math.nan,
        }
    )
