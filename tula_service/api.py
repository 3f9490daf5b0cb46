"""The FastAPI app: thin routes over the store and the executor."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Query, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from models.registry import ALLOWED_MODULES_ENV, DATASETS, MODELS
from tula_service.db import make_engine, make_session_factory
from tula_service.executor import LocalExecutor
from tula_service.jobs import plan_inputs
from tula_service.recommend import NotEnoughMeasurements, plan
from tula_service.schemas import JobList, JobView
from tula_service.spec import JobSpec, allowed_model_modules
from tula_service.specfile import load_spec_file
from tula_service.store import Store
from tula_service.whatif import WhatIf, merged_spec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settings:
    database_url: str = "sqlite:///var/tula.db"
    executor: str = "local"
    workers: int = 1
    seed_example: Path | None = None


def _seed_if_empty(store: Store, executor: LocalExecutor, example: Path | None) -> None:
    if example is None or store.count_jobs() > 0:
        return
    job = store.create_job(JobSpec.model_validate(load_spec_file(example)))
    log.info("empty database: submitted the example spec %s as job %s", example, job.id)
    executor.notify()


def create_app(settings: Settings = Settings()) -> FastAPI:
    if settings.executor != "local":
        raise ValueError(f"executor '{settings.executor}' is not available; known: local")
    if settings.database_url.startswith("sqlite:///"):
        Path(settings.database_url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    store = Store(make_session_factory(make_engine(settings.database_url)))
    executor = LocalExecutor(store, workers=settings.workers)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        executor.start()
        _seed_if_empty(store, executor, settings.seed_example)
        yield
        executor.stop()

    app = FastAPI(
        title="Tula",
        version="0.1.0",
        summary="Batch-size optimizer: profile, model, and pick the knee of the time/cost Pareto curve.",
        lifespan=lifespan,
    )
    app.state.store = store
    app.state.executor = executor

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/catalog/models")
    def catalog_models() -> dict[str, Any]:
        return {"models": [asdict(info) for info in sorted(MODELS.values(), key=lambda i: i.name)],
                "user_models": {"allowed_module_prefixes": allowed_model_modules(), "env": ALLOWED_MODULES_ENV}}

    @app.get("/v1/catalog/datasets")
    def catalog_datasets() -> dict[str, Any]:
        return {"datasets": [asdict(info) for info in sorted(DATASETS.values(), key=lambda i: i.name)]}

    @app.post("/v1/jobs", status_code=status.HTTP_202_ACCEPTED, response_model=JobView)
    def submit_job(spec: JobSpec, response: Response) -> JobView:
        job = store.create_job(spec)
        executor.notify()
        response.headers["Location"] = f"/v1/jobs/{job.id}"
        return JobView.of(job)

    @app.get("/v1/jobs", response_model=JobList)
    def list_jobs(limit: int = Query(50, ge=1, le=500), offset: int = Query(0, ge=0)) -> JobList:
        return JobList(jobs=[JobView.of(j) for j in store.list_jobs(limit, offset)], total=store.count_jobs())

    def _job_or_404(job_id: str):
        job = store.get_job(job_id)
        if job is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job '{job_id}' not found")
        return job

    @app.get("/v1/jobs/{job_id}", response_model=JobView)
    def get_job(job_id: str) -> JobView:
        return JobView.of(_job_or_404(job_id))

    @app.get("/v1/jobs/{job_id}/recommendation")
    def get_recommendation(job_id: str) -> dict[str, Any]:
        job = _job_or_404(job_id)
        if job.state == "failed":
            raise HTTPException(status.HTTP_409_CONFLICT, detail=f"job failed: {job.error}")
        if job.recommendation is None:
            view = JobView.of(job)
            raise HTTPException(
                status.HTTP_409_CONFLICT,
                detail=f"job is {job.state} ({view.progress.points_done}/{view.progress.points_total} points); "
                "the recommendation exists once it is done",
            )
        return {"job_id": job.id, **job.recommendation}

    @app.post("/v1/jobs/{job_id}/plan")
    def what_if(job_id: str, what_if: WhatIf) -> dict[str, Any]:
        """Re-plan the job's stored measurements for another cluster, pricing or objective (no profiling)."""
        job = _job_or_404(job_id)
        if job.state != "done":
            raise HTTPException(status.HTTP_409_CONFLICT, detail=f"job is {job.state}: what-if needs its measurements")
        try:
            spec = merged_spec(job.spec, what_if)
        except ValidationError as error:
            raise RequestValidationError(
                [{**e, "loc": ("body", *e["loc"])} for e in error.errors(include_url=False, include_context=False)]
            ) from None
        measurements, failed = plan_inputs(job)
        try:
            return {"job_id": job.id, "what_if": what_if.model_dump(exclude_none=True), **plan(spec, measurements, failed)}
        except NotEnoughMeasurements as error:
            raise HTTPException(status.HTTP_409_CONFLICT, detail=str(error)) from None

    return app
