"""Runs and their telemetry in the database: every change is one short transaction, as for jobs.

- A run is created once per Idempotency-Key: the same key with the same request returns the run it made,
  with another request raises IdempotencyConflict.
- Telemetry is idempotent and ordered by step: a record whose step the run already holds is a duplicate
  (counted, not stored again; the unique (run_id, step) constraint makes that hold under concurrent posts),
  and records are read back in step order whatever order they came in.
- Telemetry is bounded: a batch that would take the run past MAX_RECORDS_PER_RUN records is refused whole
  (RunFull), so what is stored is always a prefix of what was accepted.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from tula_service.runs.telemetry import MAX_RECORDS_PER_RUN
from tula_service.store.db import Run, RunTelemetry, utcnow
from tula_service.store.job_store import IdempotencyConflict, Store

MAX_DECISIONS_KEPT = 200  # a run's decisions list keeps the latest ones


class RunFull(ValueError):
    """The run holds as many telemetry records as it may."""


def request_digest(request: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(request, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def create_run(store: Store, job_id: str, options: dict[str, Any], config: dict[str, Any], idempotency_key: str | None) -> tuple[Run, bool]:
    """Insert a run of job `job_id` starting at `config`; (run, created)."""
    digest = request_digest({"job_id": job_id, **options})
    if idempotency_key is not None:
        existing = _run_by_key(store, idempotency_key, digest)
        if existing is not None:
            return existing, False
    run = Run(id=uuid.uuid4().hex, job_id=job_id, options=options, config=config, decisions=[], records=0,
              idempotency_key=idempotency_key, request_sha256=digest)  # fmt: skip
    try:
        with store.session() as session, session.begin():
            session.add(run)
    except IntegrityError:  # the same key raced in from a concurrent request
        existing = _run_by_key(store, idempotency_key, digest) if idempotency_key else None
        if existing is None:
            raise
        return existing, False
    return get_run(store, run.id), True


def _run_by_key(store: Store, key: str, digest: str) -> Run | None:
    with store.session() as session:
        run = session.scalars(select(Run).where(Run.idempotency_key == key)).one_or_none()
    if run is not None and run.request_sha256 != digest:
        raise IdempotencyConflict(key, run.id, what="run", request="request")
    return run


def get_run(store: Store, run_id: str) -> Run | None:
    with store.session() as session:
        return session.get(Run, run_id)


def add_telemetry(store: Store, run_id: str, records: list[dict[str, Any]]) -> dict[str, int | None]:
    """Store the records of steps the run does not hold yet; {"accepted", "duplicates", "records", "last_step"}.
    Raises RunFull (nothing stored) when they would take the run past MAX_RECORDS_PER_RUN."""
    by_step: dict[int, dict[str, Any]] = {}
    for record in records:
        by_step.setdefault(int(record["step"]), record)  # the first of a step sent twice in one batch
    for _ in range(2):  # a concurrent post of the same steps: read again and retry once
        try:
            return _insert_new(store, run_id, by_step, len(records))
        except IntegrityError:
            continue
    return _insert_new(store, run_id, by_step, len(records))


def _insert_new(store: Store, run_id: str, by_step: dict[int, dict[str, Any]], sent: int) -> dict[str, int | None]:
    with store.session() as session, session.begin():
        run = session.get(Run, run_id, with_for_update=True)
        held = set(session.scalars(select(RunTelemetry.step).where(RunTelemetry.run_id == run_id, RunTelemetry.step.in_(list(by_step)))))
        new = {step: record for step, record in by_step.items() if step not in held}
        if run.records + len(new) > MAX_RECORDS_PER_RUN:
            raise RunFull(f"run {run_id} holds {run.records} telemetry records; {len(new)} more would pass the limit of {MAX_RECORDS_PER_RUN}")
        session.add_all(RunTelemetry(run_id=run_id, step=step, record=record) for step, record in new.items())
        last_step = max([*new, *([run.last_step] if run.last_step is not None else [])], default=None)
        records = run.records + len(new)
        session.execute(update(Run).where(Run.id == run_id).values(records=Run.records + len(new), last_step=last_step, updated_at=utcnow()))
        return {"accepted": len(new), "duplicates": sent - len(new), "records": records, "last_step": last_step}


def telemetry(store: Store, run_id: str, limit: int | None = None, offset: int = 0) -> list[dict[str, Any]]:
    """The run's records in step order (a page of them with `limit`)."""
    query = select(RunTelemetry.record).where(RunTelemetry.run_id == run_id).order_by(RunTelemetry.step).offset(offset)
    with store.session() as session:
        return list(session.scalars(query.limit(limit) if limit is not None else query))


def record_decision(store: Store, run_id: str, config: dict[str, Any], decision: dict[str, Any]) -> Run:
    """Move the run to `config` and keep why (the latest MAX_DECISIONS_KEPT decisions)."""
    with store.session() as session, session.begin():
        run = session.get(Run, run_id, with_for_update=True)
        run.config = config
        run.decisions = [*run.decisions, decision][-MAX_DECISIONS_KEPT:]
        run.updated_at = utcnow()
    return get_run(store, run_id)
