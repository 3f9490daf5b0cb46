"""Job and point persistence: every state change is one short transaction."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, selectinload, sessionmaker

from tula_service.db import Job, Point, utcnow
from tula_service.spec import JobSpec

TERMINAL_POINT_STATES = ("done", "oom", "failed")
TERMINAL_JOB_STATES = ("done", "failed")


class Store:
    def __init__(self, sessions: sessionmaker):
        self._sessions = sessions

    def session(self) -> Session:
        return self._sessions()

    def create_job(self, spec: JobSpec) -> Job:
        job = Job(
            id=uuid.uuid4().hex,
            name=spec.name,
            state="queued",
            spec=spec.model_dump(mode="json"),
            points=[Point(kind="grid", batch_size=b, state="queued") for b in spec.batch_sizes]
            + ([Point(kind="comm", state="queued")] if spec.measures_communication() else []),
        )
        with self.session() as session, session.begin():
            session.add(job)
        return self.get_job(job.id)

    def get_job(self, job_id: str) -> Job | None:
        with self.session() as session:
            return session.scalars(
                select(Job).where(Job.id == job_id).options(selectinload(Job.points))
            ).one_or_none()

    def list_jobs(self, limit: int = 100, offset: int = 0) -> list[Job]:
        with self.session() as session:
            return list(
                session.scalars(
                    select(Job)
                    .options(selectinload(Job.points))
                    .order_by(Job.created_at.desc(), Job.id)
                    .limit(limit)
                    .offset(offset)
                )
            )

    def count_jobs(self) -> int:
        with self.session() as session:
            return int(session.scalar(select(func.count()).select_from(Job)))

    def claim_next_point(self) -> Point | None:
        """Mark the oldest queued point running and return it (None when the queue is empty)."""
        with self.session() as session, session.begin():
            point = session.scalars(
                select(Point).where(Point.state == "queued").order_by(Point.id).limit(1)
            ).one_or_none()
            if point is None:
                return None
            claimed = session.execute(
                update(Point)
                .where(Point.id == point.id, Point.state == "queued")
                .values(state="running", attempts=Point.attempts + 1, started_at=utcnow())
            ).rowcount
            if not claimed:
                return None
            session.execute(
                update(Job).where(Job.id == point.job_id, Job.state == "queued").values(state="profiling")
            )
        return self.get_point(point.id)

    def add_point(self, job_id: str, kind: str, batch_size: int | None) -> None:
        with self.session() as session, session.begin():
            session.add(Point(job_id=job_id, kind=kind, batch_size=batch_size, state="queued"))

    def get_point(self, point_id: int) -> Point:
        with self.session() as session:
            return session.get(Point, point_id)

    def finish_point(self, point_id: int, state: str, measurement: dict[str, Any] | None, error: str | None, duration_s: float) -> None:
        with self.session() as session, session.begin():
            session.execute(
                update(Point)
                .where(Point.id == point_id)
                .values(state=state, measurement=measurement, error=error, finished_at=utcnow(), duration_s=duration_s)
            )

    def job_points_finished(self, job_id: str) -> bool:
        with self.session() as session:
            open_points = session.scalar(
                select(func.count())
                .select_from(Point)
                .where(Point.job_id == job_id, Point.state.not_in(TERMINAL_POINT_STATES))
            )
            return open_points == 0

    def set_job_state(self, job_id: str, state: str, *, recommendation: dict[str, Any] | None = None, error: str | None = None) -> None:
        values: dict[str, Any] = {"state": state}
        if recommendation is not None:
            values["recommendation"] = recommendation
        if error is not None:
            values["error"] = error
        if state in TERMINAL_JOB_STATES:
            values["finished_at"] = utcnow()
        with self.session() as session, session.begin():
            session.execute(update(Job).where(Job.id == job_id).values(**values))

    def requeue_interrupted(self) -> int:
        """Points left running by a server that died go back to the queue; returns how many."""
        with self.session() as session, session.begin():
            return session.execute(
                update(Point).where(Point.state == "running").values(state="queued", started_at=None)
            ).rowcount

    def jobs_awaiting_fit(self) -> list[str]:
        """Jobs whose points are all finished but which never got a result (server died while fitting)."""
        with self.session() as session:
            candidates = session.scalars(select(Job.id).where(Job.state.in_(("queued", "profiling", "fitting"))))
            return [job_id for job_id in candidates if self.job_points_finished(job_id)]
