"""Lifecycle log lines: one line per event of a job or a point, as key=value pairs, on the logger
`tula.lifecycle` (INFO), so `grep event=point_failed` or any log shipper can follow a job:

    event=job_submitted job=3f2a... name=small-cnn-example points=6
    event=point_started job=3f2a... point=4 kind=grid batch=32 attempt=1 worker=local:host:123 pid=456 path=warm
    event=point_done job=3f2a... point=4 kind=grid batch=32 attempt=1 state=done duration_s=2.41
    event=point_failed job=3f2a... point=5 kind=grid batch=64 attempt=3 duration_s=0.2 error="..."
    event=point_retried job=3f2a... point=5 kind=grid batch=64 attempt=1 duration_s=0.2 reason="..."
    event=job_finished job=3f2a... state=done seconds=24.8 points=6

A value with a space, a quote, an `=` or a newline is written as a JSON string, so every event stays
one line. Nothing here touches the store: callers pass what they have.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from tula_service.store.db import Job, Point

log = logging.getLogger("tula.lifecycle")
ERROR_CHARS = 300  # an error's head; the point's full error is in the API


def format_line(event: str, **fields: Any) -> str:
    """`event=EVENT key=value ...`, None values left out, floats to 3 significant decimals."""
    parts = [f"event={event}"]
    for key, value in fields.items():
        if value is None:
            continue
        if isinstance(value, float):
            text = f"{value:.3f}".rstrip("0").rstrip(".") if abs(value) < 1e6 else f"{value:.6g}"
        else:
            text = str(value)
        if not text or any(c in text for c in ' "=\n\r\t'):
            text = json.dumps(text)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def emit(event: str, **fields: Any) -> None:
    log.info(format_line(event, **fields))


def _point_fields(point: Point) -> dict[str, Any]:
    return {"job": point.job_id, "point": point.id, "kind": point.kind, "batch": point.batch_size, "attempt": point.attempts}


def job_submitted(job: Job) -> None:
    emit("job_submitted", job=job.id, name=job.name, points=len(job.points))


def point_started(point: Point, worker: str, pid: int | None, path: str) -> None:
    """`path`: how the child was started: "warm" (forked from the warm worker), "cold" (a fresh python)
    or "ray" (a Ray task; its pid is not known here)."""
    emit("point_started", **_point_fields(point), worker=worker, pid=pid, path=path)


def point_finished(point: Point, state: str, duration_s: float, error: str | None) -> None:
    """A point that will not run again: point_done (measured or out of memory) or point_failed."""
    if state == "failed":
        emit("point_failed", **_point_fields(point), duration_s=duration_s, error=(error or "")[:ERROR_CHARS])
    else:
        emit("point_done", **_point_fields(point), state=state, duration_s=duration_s)


def point_retried(point: Point, duration_s: float, reason: str | None) -> None:
    emit("point_retried", **_point_fields(point), duration_s=duration_s, reason=(reason or "")[:ERROR_CHARS])


def job_finished(job: Job | None) -> None:
    """The job as it ended (done, failed or cancelled); nothing for a job still active or gone."""
    if job is None or job.finished_at is None:
        return
    seconds = (job.finished_at - job.created_at).total_seconds() if job.created_at else None
    error = (job.error or "")[:ERROR_CHARS] if job.state == "failed" else None
    emit("job_finished", job=job.id, state=job.state, seconds=seconds, points=len(job.points), error=error)


def job_cancelled(job_id: str, running_points: int) -> None:
    emit("job_finished", job=job_id, state="cancelled", running_points_stopped=running_points)
