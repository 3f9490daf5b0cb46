"""The jobs: submit (or create from measurements taken anywhere, profiling only what they miss), list, read
(with or without points, the points a page at a time, the measurements, the recommendation), cancel,
delete, and re-plan (what-if) without profiling again."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from tula_service import lifecycle
from tula_service.api.deps import ExecutorDep, StoreDep
from tula_service.api.errors import what_if_conflict
from tula_service.api.plan import JobFromMeasurements, parsed_measurements, plan_or_conflict
from tula_service.dispatch.jobs import plan_inputs
from tula_service.plan.recommend import NotEnoughMeasurements, plan
from tula_service.plan.recommendation import JobRecommendation, WhatIfPlan
from tula_service.plan.whatif import WhatIf, replan
from tula_service.schemas import (
    JobDetail,
    JobList,
    JobState,
    JobSummary,
    JobView,
    MeasurementList,
    MeasurementView,
    PointList,
    PointView,
    next_offset,
)
from tula_service.spec.job_spec import JobSpec, allowed_model_modules
from tula_service.spec.points_wanted import Profile, points_wanted
from tula_service.spec.user_code_check import checked_submission, client_submission
from tula_service.store.db import Job
from tula_service.store.job_store import IdempotencyConflict, Store

IDEMPOTENCY_KEY_MAX_CHARS = 255

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


def _not_found(job_id: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job '{job_id}' not found")


def _job_or_404(store: Store, job_id: str):
    job = store.get_job(job_id)
    if job is None:
        raise _not_found(job_id)
    return job


@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=JobView,
          responses={200: {"model": JobView, "description": "a retried submission: the job made the first time"}},
          dependencies=[Depends(client_submission)])
def submit_job(
    spec: JobSpec,
    response: Response,
    store: StoreDep,
    executor: ExecutorDep,
    idempotency_key: Annotated[str | None, Header(max_length=IDEMPOTENCY_KEY_MAX_CHARS, min_length=1)] = None,
) -> JobView:
    """Submit a job. With an `Idempotency-Key` header, a retried submission returns the same job
    (200, `Idempotent-Replayed: true`); the same key with a different spec is a 422."""
    spec = _checked_spec(spec, ("body",))
    job, created = _create(store, spec, idempotency_key)
    if created:
        executor.notify()
    return _accepted(job, created, response)


@router.post("/from-measurements", status_code=status.HTTP_202_ACCEPTED, response_model=JobView,
             responses={200: {"model": JobView, "description": "a retried submission: the job made the first time"},
                        409: {"description": "nothing was left to profile and the measurements cannot be planned from: what is missing"}},
             dependencies=[Depends(client_submission)])  # fmt: skip
def submit_job_from_measurements(
    request: JobFromMeasurements,
    response: Response,
    store: StoreDep,
    executor: ExecutorDep,
    idempotency_key: Annotated[str | None, Header(max_length=IDEMPOTENCY_KEY_MAX_CHARS, min_length=1)] = None,
) -> JobView:
    """Create a job from measurements taken anywhere (records and/or a CSV of steps, as POST /v1/plan takes
    them); they become the job's points of kind "given". With `profile` "missing" (the default) the job
    profiles only what they do not cover (tula_service.spec.points_wanted); with "none", nothing.
    When nothing is left to profile the job is planned now and comes back done, or, when the measurements
    cannot be planned from, nothing is stored and the answer is a 409 saying what is missing.
    `Idempotency-Key` as for POST /v1/jobs."""
    spec = _checked_spec(request.spec, ("body", "spec"))
    measurements = parsed_measurements(request)
    if not measurements:
        raise RequestValidationError([{
            "loc": ("body", "measurements"), "type": "value_error",
            "msg": "no measurements supplied (records or measurements_csv): POST /v1/jobs profiles a job from scratch",
        }])  # fmt: skip
    nothing_to_profile = not points_wanted(spec, measurements, request.profile)
    planned = plan_or_conflict(spec, measurements) if nothing_to_profile else None
    job, created = _create(store, spec, idempotency_key, measurements, request.profile)
    if created and planned is not None:
        store.set_job_state(job.id, "done", recommendation=planned)
        job = store.get_job(job.id)
        lifecycle.job_finished(job)
    elif created:
        executor.notify()
    return _accepted(job, created, response)


def _checked_spec(spec: JobSpec, loc: tuple[str, ...]) -> JobSpec:
    """The spec with its user code checked (here, in this worker thread, not while the event loop validated
    the body); a 422 at `loc` + the field otherwise."""
    try:
        return checked_submission(spec, allowed_model_modules())
    except ValidationError as error:
        raise RequestValidationError(
            [{**e, "loc": (*loc, *e["loc"])} for e in error.errors(include_url=False, include_context=False)]
        ) from None


def _create(
    store: Store, spec: JobSpec, idempotency_key: str | None, supplied: list[Any] | None = None, profile: Profile = "missing"
) -> tuple[Job, bool]:
    try:
        return store.create_job(spec, idempotency_key, supplied or (), profile)
    except IdempotencyConflict as error:
        raise RequestValidationError(
            [{"loc": ("header", "Idempotency-Key"), "msg": str(error), "type": "idempotency_key_reused"}]
        ) from None


def _accepted(job: Job, created: bool, response: Response) -> JobView:
    if not created:
        response.status_code = status.HTTP_200_OK
        response.headers["Idempotent-Replayed"] = "true"
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return JobView.of(job)

@router.get("", response_model=JobList)
def list_jobs(
    store: StoreDep,
    state: Annotated[list[JobState], Query(description="filter: one or more states, repeated (`?state=done&state=failed`)")] = [],  # noqa: B006
    limit: int = Query(50, ge=1, le=500),
    offset: int = Query(0, ge=0, le=10**9),
) -> JobList:
    total = store.count_jobs(state)
    jobs = [JobSummary.of(j) for j in store.list_jobs(state, limit, offset)]
    return JobList(jobs=jobs, total=total, limit=limit, offset=offset, next_offset=next_offset(offset, limit, total))

@router.get("/{job_id}", response_model=JobView | JobDetail)
def get_job(
    job_id: str,
    store: StoreDep,
    points: Annotated[bool, Query(description="false: the job without its points (a JobDetail), for polling "
                                  "its state and progress; GET /v1/jobs/{job_id}/points pages the points")] = True,
) -> JobView | JobDetail:
    """The job with its spec and, unless `points=false`, every point."""
    job = store.get_job(job_id, measurements=False)  # neither view shows a measurement record
    if job is None:
        raise _not_found(job_id)
    return JobView.of(job) if points else JobDetail.of(job)

@router.get("/{job_id}/points", response_model=PointList)
def get_points(
    job_id: str,
    store: StoreDep,
    limit: int = Query(50, ge=1, le=500),
    offset: int = Query(0, ge=0, le=10**9),
) -> PointList:
    """A page of the job's points, in the order they were made: what to poll for them while the job
    runs (the measurements are at /v1/jobs/{job_id}/measurements)."""
    page = store.job_points(job_id, limit, offset)
    if page is None:
        raise _not_found(job_id)
    total, points = page
    return PointList(job_id=job_id, points=[PointView.of(p) for p in points], total=total, limit=limit,
                     offset=offset, next_offset=next_offset(offset, limit, total))

@router.post("/{job_id}/cancel", response_model=JobView)
def cancel_job(job_id: str, store: StoreDep, executor: ExecutorDep) -> JobView:
    """Cancel a queued or running job: its running points are stopped, the rest never run.
    Cancelling a cancelled job is a no-op; a done or failed job is a 409."""
    job = _job_or_404(store, job_id)
    if job.state in ("done", "failed"):
        raise HTTPException(status.HTTP_409_CONFLICT, detail=f"job is already {job.state}; nothing to cancel")
    executor.cancel(store.cancel_job(job_id))
    return JobView.of(_job_or_404(store, job_id))

@router.delete("/{job_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_job(job_id: str, store: StoreDep, executor: ExecutorDep) -> Response:
    """Delete a job and its measurements (an active job is cancelled first)."""
    _job_or_404(store, job_id)
    executor.cancel(store.cancel_job(job_id))
    store.delete_job(job_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)

@router.get("/{job_id}/measurements", response_model=MeasurementList)
def get_measurements(job_id: str, store: StoreDep) -> MeasurementList:
    """Every profiling point with its attempts, timings, errors and the worker's raw record."""
    job = _job_or_404(store, job_id)
    return MeasurementList(job_id=job.id, points=[MeasurementView.of(p) for p in job.points])

# A recommendation's optional fields are the ones an answer may lack (plan() leaves some out): unset, they stay out.
@router.get("/{job_id}/recommendation", response_model=JobRecommendation, response_model_exclude_unset=True)
def get_recommendation(job_id: str, store: StoreDep) -> dict[str, Any]:
    job = _job_or_404(store, job_id)
    if job.state in ("failed", "cancelled"):
        raise HTTPException(status.HTTP_409_CONFLICT, detail=f"job {job.state}" + (f": {job.error}" if job.error else ""))
    if job.recommendation is None:
        view = JobView.of(job)
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            detail=f"job is {job.state} ({view.progress.points_done}/{view.progress.points_total} points); "
            "the recommendation exists once it is done",
        )
    return served_recommendation(job)


def served_recommendation(job: Job) -> dict[str, Any]:
    """The stored recommendation, or, when an older server stored one this server's contract no longer
    describes (a field added since), the job's stored measurements planned again by this server, which
    is what the stored one would be now (planning is a pure function of spec and measurements)."""
    stored = {"job_id": job.id, **job.recommendation}
    try:
        JobRecommendation.model_validate(stored)
    except ValidationError:
        measurements, failed = plan_inputs(job)
        return {"job_id": job.id, **plan(job.parsed_spec, measurements, failed)}
    return stored

@router.post("/{job_id}/plan", response_model=WhatIfPlan, response_model_exclude_unset=True)
def what_if(job_id: str, what_if: WhatIf, store: StoreDep) -> dict[str, Any]:
    """Re-plan the job's stored measurements for another cluster, GPU type, pricing, objective,
    deadline, budget or reference run (no profiling). Fields left out keep their stored values. A
    what-if outside its schema is a 422; one that does not fit the stored spec (a rule between
    fields, e.g. max_lr below the stored reference_lr) is a 409 naming the fields."""
    job = _job_or_404(store, job_id)
    if job.state != "done":
        raise HTTPException(status.HTTP_409_CONFLICT, detail=f"job is {job.state}: what-if needs its measurements")
    measurements, failed = plan_inputs(job)
    try:
        planned = replan(job.spec, measurements, what_if, failed)
    except ValidationError as error:
        raise what_if_conflict(job.id, error) from None
    except NotEnoughMeasurements as error:
        raise HTTPException(status.HTTP_409_CONFLICT, detail=str(error)) from None
    return {"job_id": job.id, "what_if": what_if.given(), **planned}
