"""API response shapes (requests are `tula_service.spec.JobSpec`)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from pydantic import BaseModel

from tula_service.db import Job


class Progress(BaseModel):
    points_done: int
    points_total: int
    points_failed: int


class PointView(BaseModel):
    kind: str
    batch_size: int | None
    state: str
    attempts: int
    duration_s: float | None
    error: str | None


class JobView(BaseModel):
    id: str
    name: str | None
    state: str
    progress: Progress
    model: str
    dataset: str
    created_at: dt.datetime
    finished_at: dt.datetime | None
    error: str | None
    chosen: dict[str, Any] | None
    points: list[PointView]
    links: dict[str, str]

    @classmethod
    def of(cls, job: Job) -> JobView:
        finished = [p for p in job.points if p.state in ("done", "oom", "failed")]
        chosen = job.recommendation["chosen"] if job.recommendation else None
        return cls(
            id=job.id,
            name=job.name,
            state=job.state,
            progress=Progress(
                points_done=len(finished),
                points_total=len(job.points),
                points_failed=sum(p.state == "failed" for p in job.points),
            ),
            model=job.spec["model"],
            dataset=job.spec["dataset"]["name"],
            created_at=job.created_at,
            finished_at=job.finished_at,
            error=job.error,
            chosen=chosen,
            points=[PointView.model_validate(p, from_attributes=True) for p in job.points],
            links={"self": f"/v1/jobs/{job.id}", "recommendation": f"/v1/jobs/{job.id}/recommendation"},
        )


class JobList(BaseModel):
    jobs: list[JobView]
    total: int
