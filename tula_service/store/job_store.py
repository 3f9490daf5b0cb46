"""Job and point persistence: every state change is one short transaction.

State changes are conditional updates (`... WHERE state = 'running'`), so two writers never both
win: a point cancelled while its worker was running stays cancelled when the worker reports back.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, defer, selectinload, sessionmaker

from tula_service import lifecycle
from tula_service.spec.job_spec import JobSpec
from tula_service.spec.points_wanted import Profile, points_wanted
from tula_service.store.db import Job, Point, utcnow
from tula_service.store.states import (
    ACTIVE_JOB_STATES,
    ACTIVE_POINT_STATES,
    PROFILING_JOB_STATES,
    TERMINAL_JOB_STATES,
    TERMINAL_POINT_STATES,
)


class IdempotencyConflict(ValueError):
    """An Idempotency-Key already used for a different request (a job's spec, a run's request)."""

    def __init__(self, key: str, job_id: str, what: str = "job", request: str = "spec"):
        super().__init__(f"Idempotency-Key '{key}' was already used for {what} {job_id} with a different {request}")
        self.job_id = job_id


def spec_digest(spec: JobSpec) -> str:
    """SHA-256 of the spec's canonical JSON (sorted keys): equal specs, equal digests."""
    return submission_digest(spec, [])


def submission_digest(spec: JobSpec, given: list[dict[str, Any]], profile: Profile = "missing") -> str:
    """SHA-256 of the spec's canonical JSON (sorted keys), and of the supplied measurements and what to profile
    when measurements were supplied (the same spec with other measurements is another submission)."""
    content: Any = spec.model_dump(mode="json")
    if given:
        content = {"spec": content, "measurements": given, "profile": profile}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _record_batch(record: dict[str, Any]) -> int | None:
    """The batch a supplied record was measured at: a compute point's batch, a step's per-device batch."""
    return record.get("batch_size") or record.get("device_batch")


class Store:
    def __init__(self, sessions: sessionmaker):
        self._sessions = sessions

    def session(self) -> Session:
        return self._sessions()

    # --- jobs -------------------------------------------------------------------------------

    def create_job(
        self, spec: JobSpec, idempotency_key: str | None = None, supplied: Sequence[Any] = (), profile: Profile = "missing"
    ) -> tuple[Job, bool]:
        """Insert a job with its points: the supplied measurements (parsed Measurements) as finished points of
        kind "given", then the points they leave to profile (tula_service.spec.points_wanted). With an
        idempotency key already used for the same spec and measurements, returns that job and False instead;
        for another, raises IdempotencyConflict."""
        given = [m.model_dump(mode="json", exclude_none=True) for m in supplied]
        digest = submission_digest(spec, given, profile)
        if idempotency_key is not None:
            existing = self._job_by_key(idempotency_key, digest)
            if existing is not None:
                return existing, False
        now, queued = utcnow(), points_wanted(spec, supplied, profile)
        job = Job(
            id=uuid.uuid4().hex,
            name=spec.name,
            state="queued",
            spec=spec.model_dump(mode="json"),
            idempotency_key=idempotency_key,
            spec_sha256=digest,
            points=[
                Point(kind="given", batch_size=_record_batch(record), state="done", measurement=record,
                      worker="supplied", started_at=now, finished_at=now, duration_s=0.0)
                for record in given
            ] + [Point(kind=kind, batch_size=batch, placement=placement, state="queued") for kind, batch, placement in queued],
        )  # fmt: skip
        try:
            with self.session() as session, session.begin():
                session.add(job)
        except IntegrityError:  # the same key raced in from a concurrent request
            existing = self._job_by_key(idempotency_key, digest) if idempotency_key else None
            if existing is None:
                raise
            return existing, False
        created = self.get_job(job.id)
        lifecycle.job_submitted(created)
        return created, True

    def _job_by_key(self, key: str, digest: str) -> Job | None:
        with self.session() as session:
            job_id, job_digest = session.execute(
                select(Job.id, Job.spec_sha256).where(Job.idempotency_key == key)
            ).one_or_none() or (None, None)
        if job_id is None:
            return None
        if job_digest != digest:
            raise IdempotencyConflict(key, job_id)
        return self.get_job(job_id)

    def get_job(self, job_id: str, *, measurements: bool = True) -> Job | None:
        """A job with its points; `measurements=False` leaves the points' measurement records unread
        (a record is kilobytes, and a job's state and progress need none of them)."""
        points = selectinload(Job.points) if measurements else selectinload(Job.points).defer(Point.measurement)
        with self.session() as session:
            return session.scalars(select(Job).where(Job.id == job_id).options(points)).one_or_none()

    def list_jobs(self, states: Sequence[str] = (), limit: int = 100, offset: int = 0) -> list[Job]:
        """A page of jobs, newest first, with their points' states but not their measurements (the
        job list shows counts; a measurement is kilobytes)."""
        points = selectinload(Job.points).load_only(
            Point.id, Point.job_id, Point.kind, Point.batch_size, Point.placement, Point.state, Point.attempts, Point.attempt_errors,
            Point.worker,
        )  # fmt: skip
        query = select(Job).options(points).order_by(Job.created_at.desc(), Job.id)
        if states:
            query = query.where(Job.state.in_(states))
        with self.session() as session:
            return list(session.scalars(query.limit(limit).offset(offset)))

    def count_jobs(self, states: Sequence[str] = ()) -> int:
        query = select(func.count()).select_from(Job)
        if states:
            query = query.where(Job.state.in_(states))
        with self.session() as session:
            return int(session.scalar(query))

    def jobs_by_state(self) -> dict[str, int]:
        with self.session() as session:
            return dict(session.execute(select(Job.state, func.count()).group_by(Job.state)).all())

    def set_job_state(self, job_id: str, state: str, *, recommendation: dict[str, Any] | None = None, error: str | None = None) -> bool:
        """Move an active job to `state`; a job already done, failed or cancelled is left alone."""
        values: dict[str, Any] = {"state": state, "updated_at": utcnow()}
        if recommendation is not None:
            values["recommendation"] = recommendation
        if error is not None:
            values["error"] = error
        if state in TERMINAL_JOB_STATES:
            values["finished_at"] = utcnow()
        with self.session() as session, session.begin():
            return bool(
                session.execute(
                    update(Job).where(Job.id == job_id, Job.state.in_(ACTIVE_JOB_STATES)).values(**values)
                ).rowcount
            )

    def cancel_job(self, job_id: str) -> list[Point]:
        """Cancel an active job and its unfinished points; returns the points that were running
        (their workers must be stopped). Raises KeyError for an unknown job."""
        with self.session() as session, session.begin():
            job = session.get(Job, job_id)
            if job is None:
                raise KeyError(job_id)
            if job.state not in ACTIVE_JOB_STATES:
                return []
            running = list(session.scalars(select(Point).where(Point.job_id == job_id, Point.state == "running")))
            now = utcnow()
            session.execute(
                update(Point)
                .where(Point.job_id == job_id, Point.state.in_(ACTIVE_POINT_STATES))
                .values(state="cancelled", error="job cancelled", finished_at=now)
                .execution_options(synchronize_session=False)  # callers get the points as they were running
            )
            session.execute(
                update(Job).where(Job.id == job_id).values(state="cancelled", finished_at=now, updated_at=now)
            )
            return running

    def delete_job(self, job_id: str) -> bool:
        with self.session() as session, session.begin():
            session.execute(delete(Point).where(Point.job_id == job_id))
            return bool(session.execute(delete(Job).where(Job.id == job_id)).rowcount)

    # --- points -----------------------------------------------------------------------------

    def job_points(self, job_id: str, limit: int = 100, offset: int = 0) -> tuple[int, list[Point]] | None:
        """How many points the job has and a page of them in the order they were made, without their
        measurement records (GET /v1/jobs/{id}/measurements has those); None for an unknown job."""
        with self.session() as session:
            if session.scalar(select(Job.id).where(Job.id == job_id)) is None:
                return None
            total = session.scalar(select(func.count()).select_from(Point).where(Point.job_id == job_id))
            page = session.scalars(
                select(Point).where(Point.job_id == job_id).options(defer(Point.measurement))
                .order_by(Point.id).limit(limit).offset(offset)
            )  # fmt: skip
            return int(total), list(page)

    def claim_next_point(self, worker: str | None = None) -> Point | None:
        """Mark the oldest queued point of an active job running and return it (None when idle)."""
        with self.session() as session, session.begin():
            point = session.scalars(
                select(Point)
                .join(Job, Job.id == Point.job_id)
                .where(Point.state == "queued", Job.state.in_(PROFILING_JOB_STATES))
                .order_by(Point.id)
                .limit(1)
            ).one_or_none()
            if point is None:
                return None
            claimed = session.execute(
                update(Point)
                .where(Point.id == point.id, Point.state == "queued")
                .values(state="running", attempts=Point.attempts + 1, started_at=utcnow(), worker=worker, worker_pid=None)
            ).rowcount
            if not claimed:
                return None
            session.execute(
                update(Job).where(Job.id == point.job_id, Job.state == "queued").values(state="profiling")
            )
        return self.get_point(point.id)

    def add_point(self, job_id: str, kind: str, batch_size: int | None, placement: list[int] | None = None) -> None:
        with self.session() as session, session.begin():
            session.add(Point(job_id=job_id, kind=kind, batch_size=batch_size, placement=placement, state="queued"))

    def get_point(self, point_id: int) -> Point | None:
        with self.session() as session:
            return session.get(Point, point_id)

    def set_point_worker(self, point_id: int, worker: str, pid: int | None = None) -> None:
        with self.session() as session, session.begin():
            session.execute(
                update(Point).where(Point.id == point_id, Point.state == "running").values(worker=worker, worker_pid=pid)
            )

    def finish_point(self, point_id: int, state: str, measurement: dict[str, Any] | None, error: str | None, duration_s: float) -> bool:
        """Finish a running point; False when it is no longer running (cancelled, deleted)."""
        with self.session() as session, session.begin():
            return bool(
                session.execute(
                    update(Point)
                    .where(Point.id == point_id, Point.state == "running")
                    .values(state=state, measurement=measurement, error=error, finished_at=utcnow(), duration_s=duration_s, worker_pid=None)
                ).rowcount
            )

    def retry_point(self, point_id: int, reason: str) -> bool:
        """Put a running point whose worker died back in the queue, keeping why in its history."""
        with self.session() as session, session.begin():
            point = session.get(Point, point_id)
            if point is None or point.state != "running":
                return False
            point.state = "queued"
            point.error = reason
            point.attempt_errors = [*(point.attempt_errors or []), reason]
            point.started_at = None
            point.worker_pid = None
            return True

    def job_points_finished(self, job_id: str) -> bool:
        with self.session() as session:
            open_points = session.scalar(
                select(func.count())
                .select_from(Point)
                .where(Point.job_id == job_id, Point.state.not_in(TERMINAL_POINT_STATES))
            )
            return open_points == 0

    def queued_points(self) -> int:
        with self.session() as session:
            return int(
                session.scalar(
                    select(func.count())
                    .select_from(Point)
                    .join(Job, Job.id == Point.job_id)
                    .where(Point.state == "queued", Job.state.in_(PROFILING_JOB_STATES))
                )
            )

    def running_points(self) -> list[Point]:
        with self.session() as session:
            return list(session.scalars(select(Point).where(Point.state == "running")))

    def requeue_interrupted(self) -> list[Point]:
        """Points left running by a server that died go back to the queue; returns them as they
        were (with the dead server's worker and pid, so the caller can reap orphans)."""
        with self.session() as session, session.begin():
            interrupted = list(session.scalars(select(Point).where(Point.state == "running")))
            for point in interrupted:
                reason = f"attempt {point.attempts} on {point.worker or 'a worker'}: interrupted (server stopped)"
                session.execute(
                    update(Point)
                    .where(Point.id == point.id, Point.state == "running")
                    .values(
                        state="queued",
                        started_at=None,
                        worker_pid=None,
                        attempt_errors=[*(point.attempt_errors or []), reason],
                    )
                    .execution_options(synchronize_session=False)  # callers need the dead server's pids
                )
            return interrupted

    def jobs_awaiting_fit(self) -> list[str]:
        """Active jobs whose points are all finished (the server died before fitting them)."""
        with self.session() as session:
            candidates = list(session.scalars(select(Job.id).where(Job.state.in_(ACTIVE_JOB_STATES))))
        return [job_id for job_id in candidates if self.job_points_finished(job_id)]
