"""API response shapes (requests are `tula_service.spec.job_spec.JobSpec` and `tula_service.plan.whatif.WhatIf`).

The typed client (`tula_service.client`) parses responses into these same models.
"""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from tula_service.store.states import JOB_STATES, TERMINAL_POINT_STATES

if TYPE_CHECKING:  # only the API builds these views from stored rows; the client needs no SQLAlchemy
    from tula_service.store.db import Job, Point

# the job states as a type: a query parameter of this type is documented as an enum in
# OpenAPI and refused with FastAPI's own 422 for any other value.
JobState = Literal[JOB_STATES]  # type: ignore[valid-type]


def utc(moment: dt.datetime | None) -> dt.datetime | None:
    """Stored times are naive UTC (SQLite keeps no offset); the API says so (RFC 3339 with +00:00)."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=dt.timezone.utc)


class Progress(BaseModel):
    points_done: int = Field(description="points finished: measured, out of memory, failed or cancelled")
    points_measured: int = Field(0, description="points that produced a measurement (done, or out of memory: the memory limit)")
    points_total: int
    points_failed: int
    points_retried: int = Field(0, description="points whose worker died at least once and were re-queued")
    step: str = Field("", description="what the job is doing now, in words")


class PointView(BaseModel):
    id: int
    kind: str = Field(description="grid | search | retime (a noisy point timed again) | comm | pilot | step (a data-parallel step) | given (a supplied measurement)")
    batch_size: int | None
    placement: list[int] | None = Field(None, description="a step point's GPUs used on each node")
    state: str = Field(description="queued | running | done | oom | failed | cancelled")
    attempts: int = Field(description="times a worker started this point")
    duration_s: float | None = Field(None, description="wall time of the last attempt, measured")
    error: str | None = None
    worker: str | None = Field(None, description="where the last attempt ran: local:HOST:PID or ray:NODE")
    attempt_errors: list[str] = Field(default_factory=list, description="why each earlier attempt died")
    started_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None

    @classmethod
    def of(cls, point: Point) -> PointView:
        return cls(
            id=point.id, kind=point.kind, batch_size=point.batch_size, placement=point.placement, state=point.state, attempts=point.attempts,
            duration_s=point.duration_s, error=point.error, worker=point.worker,
            attempt_errors=point.attempt_errors or [], started_at=utc(point.started_at), finished_at=utc(point.finished_at),
        )  # fmt: skip


def _point_noun(kind: str, batch_size: int | None) -> str:
    nouns = {"comm": "all-reduce", "pilot": f"pilot training at batch {batch_size}", "retime": f"batch {batch_size} again",
             "step": f"a data-parallel step at batch {batch_size}"}  # fmt: skip
    return nouns.get(kind, f"batch {batch_size}")


def _step(job: Job) -> str:
    if job.state == "profiling" or job.state == "queued":
        running = [p for p in job.points if p.state == "running"]
        if running:
            return "; ".join(
                f"profiling {_point_noun(p.kind, p.batch_size)}"
                + (f" (attempt {p.attempts})" if p.attempts > 1 else "")
                + (f" on {p.worker}" if p.worker else "")
                for p in running
            )
        queued = sum(p.state == "queued" for p in job.points)
        return f"waiting for a worker ({queued} points queued)"
    if job.state == "fitting":
        return "fitting the performance model and planning"
    if job.state == "failed":
        return "failed: " + (job.error or "")
    return job.state


def _progress(job: Job) -> Progress:
    return Progress(
        points_done=sum(p.state in TERMINAL_POINT_STATES for p in job.points),
        points_measured=sum(p.state in ("done", "oom") for p in job.points),
        points_total=len(job.points),
        points_failed=sum(p.state == "failed" for p in job.points),
        points_retried=sum(bool(p.attempt_errors) for p in job.points),
        step=_step(job),
    )


def _links(job_id: str) -> dict[str, str]:
    return {
        "self": f"/v1/jobs/{job_id}",
        "recommendation": f"/v1/jobs/{job_id}/recommendation",
        "points": f"/v1/jobs/{job_id}/points",
        "measurements": f"/v1/jobs/{job_id}/measurements",
        "cancel": f"/v1/jobs/{job_id}/cancel",
        "plan": f"/v1/jobs/{job_id}/plan",
    }


class ClusterSummary(BaseModel):
    nodes: int
    gpus_per_node: int
    gpu_type: str | None = None
    device_memory_gib: float | None = None


def next_offset(offset: int, limit: int, total: int) -> int | None:
    """The offset of the page after [offset, offset + limit) of `total` items; None on the last page."""
    return offset + limit if offset + limit < total else None


class JobSummary(BaseModel):
    """A job in the job list: its state and counts, not its points or spec (GET /v1/jobs/{id} has those),
    so a page of jobs stays small whatever the jobs hold."""

    id: str
    name: str | None
    state: str = Field(description="queued | profiling | fitting | done | failed | cancelled")
    progress: Progress
    model: str
    dataset: str
    cluster: ClusterSummary
    created_at: dt.datetime
    finished_at: dt.datetime | None
    error: str | None
    chosen: dict[str, Any] | None = Field(description="the recommended configuration once done")
    links: dict[str, str]

    @classmethod
    def of(cls, job: Job) -> JobSummary:
        cluster = job.spec["cluster"]
        return cls(
            id=job.id, name=job.name, state=job.state, progress=_progress(job), model=job.spec["model"],
            dataset=job.spec["dataset"]["name"],
            cluster=ClusterSummary(nodes=cluster.get("nodes", 1), gpus_per_node=cluster.get("gpus_per_node", 1),
                                   gpu_type=cluster.get("gpu_type"), device_memory_gib=cluster.get("device_memory_gib")),
            created_at=utc(job.created_at), finished_at=utc(job.finished_at), error=job.error,
            chosen=job.recommendation["chosen"] if job.recommendation else None, links=_links(job.id),
        )  # fmt: skip


class JobDetail(JobSummary):
    """A job with its validated spec, not its points (GET /v1/jobs/{id}?points=false): what to poll for
    a job's state and progress, with GET /v1/jobs/{id}/points for its points a page at a time."""

    spec: dict[str, Any] = Field(description="the validated job spec, defaults filled in")

    @classmethod
    def of(cls, job: Job) -> JobDetail:
        return cls(**JobSummary.of(job).model_dump(), spec=job.spec)


class JobView(JobDetail):
    """A job with its validated spec and every point (the measurements are at links.measurements)."""

    points: list[PointView]

    @classmethod
    def of(cls, job: Job) -> JobView:
        return cls(**JobDetail.of(job).model_dump(), points=[PointView.of(p) for p in job.points])


class JobList(BaseModel):
    jobs: list[JobSummary]
    total: int = Field(description="jobs matching the filter, over all pages")
    limit: int
    offset: int
    next_offset: int | None = Field(None, description="offset of the next page; null on the last page")


class PointList(BaseModel):
    """A page of one job's points, in the order they were made."""

    job_id: str
    points: list[PointView]
    total: int = Field(description="the job's points, over all pages")
    limit: int
    offset: int
    next_offset: int | None = Field(None, description="offset of the next page; null on the last page")


class MeasurementView(PointView):
    measurement: dict[str, Any] | None = Field(
        None, description="the worker's record (profiler schema): measured values, or the out-of-memory error"
    )

    @classmethod
    def of(cls, point: Point) -> MeasurementView:
        return cls(**PointView.of(point).model_dump(), measurement=point.measurement)


class MeasurementList(BaseModel):
    job_id: str
    points: list[MeasurementView]


class Problem(BaseModel):
    """application/problem+json (RFC 9457)."""

    type: str
    title: str
    status: int
    detail: str
    instance: str | None = None
    errors: list[dict[str, Any]] | None = Field(None, description="per field: {field, message, type}")
