"""Step measurements from a CSV table, as trainers and traces log them (Pollux's placements.csv and
scalability.csv, for instance): one row per (placement, per-GPU batch) with its step and sync seconds.

Two layouts, told apart by their header (other columns are ignored):

    placement,local_bsz,step_time,sync_time                   placement: GPUs on each node, "22" or "8+8"
    num_nodes,num_replicas,local_bsz,step_time,sync_time      the replicas dealt out evenly over the nodes

step_time and sync_time are seconds per step (sync_time: the part spent in the gradient all-reduce; it may be
empty). Each row becomes a StepMeasurement record (tula_service.measurement) with origin "csv". A bad row is
a CsvRowError naming the row (1 = the first row under the header) and the column.
"""

from __future__ import annotations

import csv
import io
import math
import re
from typing import Any

from pydantic import ValidationError

from tula_service.measurement import StepMeasurement

LAYOUTS: dict[str, tuple[str, ...]] = {
    "placement": ("placement", "local_bsz", "step_time", "sync_time"),
    "replicas": ("num_nodes", "num_replicas", "local_bsz", "step_time", "sync_time"),
}
OPTIONAL_COLUMNS = {"sync_time"}
COLUMN_OF_FIELD = {"device_batch": "local_bsz", "step_time_s": "step_time", "sync_time_s": "sync_time"}
PLACEMENT_SEPARATORS = re.compile(r"[+x/ -]")
MAX_ROWS = 100_000


class CsvRowError(ValueError):
    """A row (1-based, under the header) or the header (row 0) that cannot be read; `column` names the column."""

    def __init__(self, row: int, column: str | None, message: str):
        self.row, self.column = row, column
        where = "the header" if row == 0 else f"row {row}" + (f", column '{column}'" if column else "")
        super().__init__(f"{where}: {message}")


def layout_of(header: list[str]) -> str:
    """The layout whose required columns the header has; CsvRowError(0, ...) naming what is missing."""
    names = {name.strip() for name in header}
    for layout, columns in LAYOUTS.items():
        if all(column in names for column in columns if column not in OPTIONAL_COLUMNS):
            return layout
    missing = {layout: [c for c in columns if c not in names and c not in OPTIONAL_COLUMNS] for layout, columns in LAYOUTS.items()}
    described = "; ".join(f"'{','.join(LAYOUTS[layout])}' lacks {', '.join(columns)}" for layout, columns in missing.items())
    raise CsvRowError(0, None, f"no known layout ({described})")


def parse_placement(text: str) -> list[int]:
    """'22' -> [2, 2] (a digit per node); '8+8' -> [8, 8] (any of + x / - or space between nodes)."""
    text = text.strip()
    parts = [p for p in PLACEMENT_SEPARATORS.split(text) if p] if PLACEMENT_SEPARATORS.search(text) else list(text)
    if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"a placement lists the GPUs on each node, each >= 1 ('22' or '8+8'), got {text!r}")
    return [int(p) for p in parts]


def dealt_evenly(replicas: int, nodes: int) -> list[int]:
    """`replicas` GPUs over `nodes` nodes, as evenly as possible: 6 over 4 -> [2, 2, 1, 1]."""
    return [replicas // nodes + (1 if i < replicas % nodes else 0) for i in range(nodes)]


def _number(row: dict[str, str], column: str, index: int, *, integer: bool = False, positive: bool = True) -> float | int | None:
    text = (row.get(column) or "").strip()
    if not text:
        if column in OPTIONAL_COLUMNS:
            return None
        raise CsvRowError(index, column, "is empty")
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        raise CsvRowError(index, column, f"must be {'a whole number' if integer else 'a number'}, got {text!r}") from None
    if not math.isfinite(value) or (value <= 0 if positive else value < 0):
        raise CsvRowError(index, column, f"must be {'positive' if positive else '>= 0'} and finite, got {text!r}")
    return value


def steps_from_csv(text: str) -> list[dict[str, Any]]:
    """The StepMeasurement records of a CSV table in either layout (module docstring)."""
    try:
        return _steps(text)
    except csv.Error as error:  # a NUL byte, an unclosed quote at the end
        raise CsvRowError(0, None, f"not a CSV table: {error}") from None


def _steps(text: str) -> list[dict[str, Any]]:
    reader = csv.DictReader(io.StringIO(text.lstrip("\ufeff")))
    if not reader.fieldnames:
        raise CsvRowError(0, None, "the table is empty: expected a header row")
    layout = layout_of(reader.fieldnames)
    reader.fieldnames = [name.strip() for name in reader.fieldnames]
    records = []
    for index, row in enumerate(reader, start=1):
        if index > MAX_ROWS:
            raise CsvRowError(index, None, f"more than {MAX_ROWS} rows")
        if layout == "placement":
            try:
                placement = parse_placement(row.get("placement") or "")
            except ValueError as error:
                raise CsvRowError(index, "placement", str(error)) from None
        else:
            nodes = _number(row, "num_nodes", index, integer=True)
            replicas = _number(row, "num_replicas", index, integer=True)
            if replicas < nodes:
                raise CsvRowError(index, "num_replicas", f"{replicas} replicas cannot use {nodes} nodes (each node holds at least one)")
            placement = dealt_evenly(replicas, nodes)
        step_time = _number(row, "step_time", index)
        sync_time = _number(row, "sync_time", index, positive=False)
        if sync_time is not None and sync_time >= step_time:
            raise CsvRowError(index, "sync_time", f"{sync_time} must be below step_time ({step_time})")
        record = {
            "kind": "step", "placement": placement, "device_batch": _number(row, "local_bsz", index, integer=True),
            "step_time_s": step_time, "sync_time_s": sync_time, "origin": "csv",
        }  # fmt: skip
        try:
            StepMeasurement.model_validate(record)  # the contract's bounds, named by the CSV's column
        except ValidationError as error:
            first = error.errors(include_url=False)[0]
            field = str(first["loc"][0]) if first["loc"] else None
            column = {"placement": "placement" if layout == "placement" else "num_replicas"}.get(field, COLUMN_OF_FIELD.get(field))
            raise CsvRowError(index, column, first["msg"]) from None
        records.append(record)
    if not records:
        raise CsvRowError(1, None, "the table has a header but no rows")
    return records
