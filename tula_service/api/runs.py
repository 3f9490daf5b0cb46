"""Runs: a training run that follows a done job's recommendation, reports telemetry, and asks for the
advice of its next interval (tula_service.runs.replan).

- POST /v1/runs starts a run at the job's recommended configuration (201; with an `Idempotency-Key`, a retry
  returns the same run: 200, `Idempotent-Replayed: true`; the same key for another request is a 422).
- GET /v1/runs/{id}/telemetry pages through the records in step order (at most 1000 a page).
- POST /v1/runs/{id}/telemetry stores a batch of records, idempotent by step and kept in step order
  (tula_service.store.run_store); a run past its bound refuses more with a 409, the advice still served.
- GET /v1/runs/{id}/plan re-plans from the telemetry and answers the configuration to train with now, why, and
  what it is based on. A change it decides is stored with the run (the run's current configuration and its
  decisions), so it holds across restarts and counts for the rate limit; asking again changes nothing more
  until the evidence does. The answer's ETag names its inputs: asked again with it (If-None-Match) before they
  change, the answer is 304, and an unchanged answer is not computed twice (tula_service.runs.plan_cache).
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Query, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field

from tula_service.api.deps import MetricsDep, PlansDep, StoreDep
from tula_service.dispatch.jobs import plan_inputs
from tula_service.plan.recommend import NotEnoughMeasurements
from tula_service.runs.plan_cache import matches, plan_version
from tula_service.runs.replan import advise, initial_config
from tula_service.runs.telemetry import MAX_RECORDS_PER_BATCH, RunRequest, TelemetryBatch
from tula_service.schemas import utc
from tula_service.store import run_store
from tula_service.store.db import Run
from tula_service.store.job_store import IdempotencyConflict, Store

IDEMPOTENCY_KEY_MAX_CHARS = 255
DECISIONS_SHOWN = 20

router = APIRouter(prefix="/v1/runs", tags=["runs"])


class RunView(BaseModel):
    id: str
    job_id: str
    options: dict[str, Any] = Field(description="hysteresis, min_steps_between_changes")
    config: dict[str, Any] = Field(description="the configuration to train with now: device_batch, devices, placement, "
                                   "accumulation, global_batch, lr, lr_multiplier, ags, since_step, source")
    records: int = Field(description="telemetry records stored")
    last_step: int | None
    decisions: list[dict[str, Any]] = Field(description=f"the latest {DECISIONS_SHOWN} changes, each with why")
    created_at: dt.datetime
    updated_at: dt.datetime
    links: dict[str, str]

    @classmethod
    def of(cls, run: Run) -> RunView:
        return cls(
            id=run.id, job_id=run.job_id, options=run.options, config=run.config, records=run.records, last_step=run.last_step,
            decisions=run.decisions[-DECISIONS_SHOWN:], created_at=utc(run.created_at), updated_at=utc(run.updated_at),
            links={"self": f"/v1/runs/{run.id}", "telemetry": f"/v1/runs/{run.id}/telemetry", "plan": f"/v1/runs/{run.id}/plan",
                   "job": f"/v1/jobs/{run.job_id}"},
        )  # fmt: skip


class TelemetryReceipt(BaseModel):
    accepted: int = Field(description="records of steps the run did not hold, now stored")
    duplicates: int = Field(description="records of steps it already held (a re-send), not stored again")
    records: int = Field(description="the run's records now")
    last_step: int | None


class RunPlan(BaseModel):
    run_id: str
    step: int | None = Field(description="the last step the telemetry reached")
    changed: bool = Field(description="this answer moved the run to a new configuration")
    config: dict[str, Any] = Field(description="the configuration to train with from now on")
    why: str
    predicted: dict[str, Any] = Field(description="time to the target of the current and the best configuration on the "
                                      "run's placement (each with its source and error), the gain, the share of the run left, the saving "
                                      "(gain x share left) the hysteresis asks of a move, and the rate limit")
    evidence: dict[str, Any] = Field(description="what the advice rests on: telemetry and gradient records, the noise scale "
                                     "with its evidence, the live steps the step-time model was refitted to")
    decisions: list[dict[str, Any]]


def _run_or_404(store: Store, run_id: str) -> Run:
    run = run_store.get_run(store, run_id)
    if run is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"run '{run_id}' not found")
    return run


@router.post("", status_code=status.HTTP_201_CREATED, response_model=RunView,
             responses={200: {"model": RunView, "description": "a retried request: the run made the first time"},
                        404: {"description": "no such job"}, 409: {"description": "the job has no recommendation yet"}})  # fmt: skip
def start_run(
    request: RunRequest,
    response: Response,
    store: StoreDep,
    idempotency_key: Annotated[str | None, Header(max_length=IDEMPOTENCY_KEY_MAX_CHARS, min_length=1)] = None,
) -> RunView:
    """Start a run at the job's recommended configuration (device batch, placement, accumulation, LR, AGS)."""
    job = store.get_job(request.job_id, measurements=False)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job '{request.job_id}' not found")
    if job.state != "done" or not job.recommendation:
        raise HTTPException(status.HTTP_409_CONFLICT, detail=f"job '{job.id}' is {job.state}: a run follows a done job's recommendation")
    options = request.model_dump(exclude={"job_id"})
    try:
        run, created = run_store.create_run(store, job.id, options, initial_config(job.recommendation), idempotency_key)
    except IdempotencyConflict as error:
        raise RequestValidationError([{"loc": ("header", "Idempotency-Key"), "msg": str(error), "type": "idempotency_key_reused"}]) from None
    if not created:
        response.status_code = status.HTTP_200_OK
        response.headers["Idempotent-Replayed"] = "true"
    response.headers["Location"] = f"/v1/runs/{run.id}"
    return RunView.of(run)


@router.get("/{run_id}", response_model=RunView, responses={404: {"description": "no such run"}})
def get_run(run_id: str, store: StoreDep) -> RunView:
    return RunView.of(_run_or_404(store, run_id))


@router.post("/{run_id}/telemetry", response_model=TelemetryReceipt,
             responses={404: {"description": "no such run"}, 409: {"description": "the run holds as many records as it may"}})  # fmt: skip
def post_telemetry(run_id: str, batch: TelemetryBatch, store: StoreDep) -> TelemetryReceipt:
    """Store a batch of telemetry records (at most 1000): a step already held is a duplicate, not stored twice."""
    _run_or_404(store, run_id)
    try:
        receipt = run_store.add_telemetry(store, run_id, [r.model_dump(mode="json", exclude_none=True) for r in batch.records])
    except run_store.RunFull as error:
        raise HTTPException(status.HTTP_409_CONFLICT, detail=str(error)) from None
    return TelemetryReceipt(**receipt)


class TelemetryPage(BaseModel):
    run_id: str
    records: list[dict[str, Any]] = Field(description="TelemetryRecords in step order")
    total: int
    limit: int
    offset: int
    next_offset: int | None = Field(description="null on the last page")


@router.get("/{run_id}/telemetry", response_model=TelemetryPage, responses={404: {"description": "no such run"}})
def get_telemetry(
    run_id: str, store: StoreDep, limit: Annotated[int, Query(ge=1, le=MAX_RECORDS_PER_BATCH)] = MAX_RECORDS_PER_BATCH,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> TelemetryPage:
    """A page of the run's telemetry records, in step order."""
    run = _run_or_404(store, run_id)
    records = run_store.telemetry(store, run_id, limit, offset)
    return TelemetryPage(run_id=run_id, records=records, total=run.records, limit=limit, offset=offset,
                         next_offset=offset + limit if offset + limit < run.records else None)  # fmt: skip


@router.get("/{run_id}/plan", response_model=RunPlan,
            responses={304: {"description": "If-None-Match named the current version: the answer the client holds stands"},
                       404: {"description": "no such run"}, 409: {"description": "the run's evidence cannot be planned from"}})  # fmt: skip
def get_run_plan(
    run_id: str, store: StoreDep, plans: PlansDep, metrics: MetricsDep, response: Response,
    if_none_match: Annotated[str | None, Header(max_length=1024)] = None,
) -> RunPlan | Response:
    """The configuration for the run's next interval, re-planned from its telemetry (tula_service.runs.replan).
    The answer's ETag names what it was computed from (tula_service.runs.plan_cache): asked again with it in
    If-None-Match before anything changed, the answer is 304 Not Modified, and an answer that would not differ
    is served again without re-planning."""
    run = _run_or_404(store, run_id)
    job = store.get_job(run.job_id, measurements=False)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job '{run.job_id}' of run '{run_id}' not found")
    version = plan_version(run, job)
    revalidate = {"ETag": version, "Cache-Control": "no-cache"}
    if matches(if_none_match, version):
        metrics.run_plan_answers.labels("not_modified").inc()
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers=revalidate)
    if (kept := plans.get(run_id, version)) is not None:
        metrics.run_plan_answers.labels("cached").inc()
        response.headers.update(revalidate)
        return kept
    measured = store.get_job(run.job_id)
    if measured is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job '{run.job_id}' of run '{run_id}' not found")
    measurements, failed = plan_inputs(measured)
    try:
        advice = advise(job.spec, measurements, failed, run.options, run.config, run_store.telemetry(store, run_id), run.last_step)
    except (NotEnoughMeasurements, ValueError, ArithmeticError) as error:
        raise HTTPException(status.HTTP_409_CONFLICT, detail=f"cannot re-plan run '{run_id}': {error}") from None
    if advice["change"] is not None:
        decision = {"step": advice["step"], "from": _brief(run.config), "to": _brief(advice["change"]), "why": advice["why"],
                    "gain": advice["predicted"]["gain"], "at": utc(dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)).isoformat()}  # fmt: skip
        run = run_store.record_decision(store, run_id, advice["change"], decision)
    answer = RunPlan(run_id=run.id, step=advice["step"], changed=advice["change"] is not None, config=run.config, why=advice["why"],
                     predicted=advice["predicted"], evidence=advice["evidence"], decisions=run.decisions[-DECISIONS_SHOWN:])  # fmt: skip
    metrics.run_plan_answers.labels("computed").inc()
    if advice["change"] is None:  # a change moved the run to a new version, whose own answer says changed: false
        plans.put(run_id, version, answer)
        response.headers.update(revalidate)
    return answer


def _brief(config: dict[str, Any]) -> dict[str, Any]:
    return {key: config.get(key) for key in ("device_batch", "accumulation", "global_batch", "placement")}
