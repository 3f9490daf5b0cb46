"""Gradient-statistics records from a file: what `profiler.reference_logger` writes, read without torch.

Two layouts: JSONL (one JSON object per line; blank lines are skipped), or one JSON list of objects
(a file whose first character, after white space, is `[`). Each record is checked against the spec's
own contract, `tula_service.spec.job_spec.GradientStatsRecord` (strictly: a number is a JSON number, a count a
whole one), so a file that reads here is one the server accepts. Mistakes name the line (or the list
item) and the field:

    stats.jsonl line 7: 'grad_sqr' must be a finite number
    stats.jsonl line 9: unknown keys 'lr' (known: samples, batch, grad_sqr, ...)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from tula_service.fit.perfmodel.noise_trajectory import statistics_position
from tula_service.spec.job_spec import GradientStatsRecord
from tula_service.spec.specfile import read_limited

# Larger than a spec may be: the CLI merges a long file into the windows a spec holds.
MAX_FILE_BYTES = 64 * 2**20
MAX_FILE_RECORDS = 200_000
MAX_PROBLEMS_SHOWN = 20
KNOWN_KEYS = tuple(GradientStatsRecord.model_fields)


def coarsen_records(records: list[dict[str, Any]], max_records: int) -> list[dict[str, Any]]:
    """At most max_records records, merging runs of consecutive ones (in the order their statistics were taken:
    noise_trajectory.statistics_position) into one window each: |G|^2, tr(Sigma), their preconditioned pair and the
    loss are window-steps-weighted means (numerators and denominators pooled as the estimator pools them, so the
    noise scale of a window is unchanged); samples the largest, step and metric the last record's,
    statistics_samples the window-steps-weighted mean of where the records' statistics were taken, window_steps the sum, variability the median, stability_headroom and
    stability_lr those of the most restrictive measurement (the smallest headroom x LR: the LR cap is the most
    restrictive point measured; where a record has no stability_lr, the smallest headroom, without an LR)."""
    ordered = sorted(records, key=statistics_position)
    if len(ordered) <= max_records:
        return ordered
    merged = []
    for group in np.array_split(np.arange(len(ordered)), max_records):
        rows = [ordered[i] for i in group]
        weights = np.array([r.get("window_steps") or 1 for r in rows], dtype=float)
        record: dict[str, Any] = {"samples": max(r["samples"] for r in rows), "batch": int(np.median([r["batch"] for r in rows])),
                                  "window_steps": int(weights.sum()),
                                  "statistics_samples": round(float(np.average([statistics_position(r) for r in rows], weights=weights)))}  # fmt: skip
        for key in ("grad_sqr", "trace_sigma", "precond_grad_sqr", "precond_trace_sigma", "loss"):
            pairs = [(w, r[key]) for w, r in zip(weights, rows) if r.get(key) is not None]
            if pairs:
                record[key] = float(sum(w * v for w, v in pairs) / sum(w for w, _ in pairs))
        for key in ("step", "metric"):
            last = next((r[key] for r in reversed(rows) if r.get(key) is not None), None)
            if last is not None:
                record[key] = last
        variability = [r["variability"] for r in rows if r.get("variability") is not None]
        if variability:
            record["variability"] = float(np.median(variability))
        measured = [r for r in rows if r.get("stability_headroom") is not None]
        if measured:
            with_lr = all(r.get("stability_lr") is not None for r in measured)
            tightest = min(measured, key=lambda r: r["stability_headroom"] * (r["stability_lr"] if with_lr else 1.0))
            record["stability_headroom"] = float(tightest["stability_headroom"])
            if with_lr:
                record["stability_lr"] = float(tightest["stability_lr"])
        merged.append(record)
    return merged


class GradientStatsFileError(ValueError):
    """A records file that cannot be used: `problems` holds one line per mistake."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = problems[:MAX_PROBLEMS_SHOWN]
        more = len(problems) - len(shown)
        super().__init__("\n".join(shown + ([f"... and {more} more"] if more else [])))


def read_gradient_stats(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSONL or JSON-list file, each checked; raises GradientStatsFileError (a
    ValueError) naming every bad line and field, FileRefused (a ValueError) for a file that is not a
    regular one or is over MAX_FILE_BYTES, OSError when the file cannot be opened."""
    path = Path(path)
    try:
        text = read_limited(path, MAX_FILE_BYTES, "a gradient-statistics file").decode("utf-8")
    except UnicodeDecodeError as error:
        raise GradientStatsFileError([f"{path}: not UTF-8 text (byte {error.start}: {error.reason})"]) from None
    items = _json_list(path, text) if text.lstrip().startswith("[") else _json_lines(text)
    if not items:
        raise GradientStatsFileError([f"{path}: no records (expected one JSON object per line, or a JSON list of them)"])
    if len(items) > MAX_FILE_RECORDS:
        raise GradientStatsFileError([
            f"{path}: {len(items)} records, more than the {MAX_FILE_RECORDS} a records file may have: "
            "log less often (GradientStatsLogger(every=...))"
        ])  # fmt: skip
    records, problems = [], []
    for where, item in items:
        record, mistakes = _checked(item)
        problems += [f"{path} {where}: {m}" for m in mistakes]
        if record is not None:
            records.append(record)
    if problems:
        raise GradientStatsFileError(problems)
    return records


class _NotJson:
    def __init__(self, error: json.JSONDecodeError):
        self.message = f"not JSON ({error.msg} at column {error.colno})"


def _json_lines(text: str) -> list[tuple[str, Any]]:
    items = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                items.append((f"line {number}", json.loads(line)))
            except json.JSONDecodeError as error:
                items.append((f"line {number}", _NotJson(error)))
    return items


def _json_list(path: Path, text: str) -> list[tuple[str, Any]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise GradientStatsFileError([f"{path} line {error.lineno}: not JSON ({error.msg} at column {error.colno})"]) from None
    if not isinstance(data, list):
        raise GradientStatsFileError([f"{path}: a JSON file of records is a list of objects, got {_json_type(data)}"])
    return [(f"item {index}", item) for index, item in enumerate(data, start=1)]


def _checked(item: Any) -> tuple[dict[str, Any] | None, list[str]]:
    if isinstance(item, _NotJson):
        return None, [item.message]
    if not isinstance(item, dict):
        return None, [f"a record is a JSON object, got {_json_type(item)}"]
    unknown = [key for key in item if key not in KNOWN_KEYS]
    mistakes = [f"unknown keys {', '.join(repr(k) for k in unknown)} (known: {', '.join(KNOWN_KEYS)})"] if unknown else []
    try:
        record = GradientStatsRecord.model_validate({k: v for k, v in item.items() if k in KNOWN_KEYS}, strict=True)
    except ValidationError as error:
        return None, mistakes + [_message(e) for e in error.errors()]
    return (None if mistakes else record.model_dump(exclude_unset=True)), mistakes


def _message(error: dict[str, Any]) -> str:
    field = ".".join(str(part) for part in error["loc"]) or "record"
    kind, context = error["type"], error.get("ctx") or {}
    if kind == "missing":
        return f"'{field}' is missing"
    if kind in ("finite_number", "float_type", "float_parsing"):
        return f"'{field}' must be a finite number"
    if kind in ("int_type", "int_from_float", "int_parsing"):
        return f"'{field}' must be a whole number"
    if kind == "greater_than_equal":
        return f"'{field}' must be at least {context['ge']:g}"
    if kind == "greater_than":
        bound = context["gt"]
        return f"'{field}' must be at least {bound + 1}" if isinstance(bound, int) else f"'{field}' must be greater than {bound:g}"
    return f"'{field}': {error['msg']}"


def _json_type(value: Any) -> str:
    return {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), type(value).__name__)
