"""The FastAPI app: thin routes over the store and the executor.

Errors are application/problem+json (tula_service.problems); bodies are capped by
tula_service.limits; the Host allowlist and the security headers are tula_service.security;
/metrics is Prometheus text (tula_service.metrics).
"""

from __future__ import annotations

import logging
import os
import re
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from sqlalchemy import text
from starlette.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from models.registry import ALLOWED_MODULES_ENV, DATASETS, MODELS
from tula_service.auth import TokenAuth
from tula_service.catalogs import gpu_catalog_listing
from tula_service.dashboard import mount_api_docs, mount_dashboard
from tula_service.db import make_engine, make_session_factory
from tula_service.executor import LocalExecutor, NoExecutor
from tula_service.jobs import plan_inputs
from tula_service.limits import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimit
from tula_service.metrics import CONTENT_TYPE, Metrics
from tula_service.migrate import current_revision, head_revision
from tula_service.problems import ProblemError, field_errors, problem_response
from tula_service.recommend import NotEnoughMeasurements, plan
from tula_service.schemas import (JobDetail, JobList, JobState, JobSummary, JobView, MeasurementList, MeasurementView,
                                  PointList, PointView, Problem, next_offset)
from tula_service.security import (DEFAULT_CSP, IN_PROCESS_ALLOWED_HOSTS, STATIC_SECURITY_HEADERS, HostAllowlist,
                                   SecurityHeaders)
from tula_service.spec import JobSpec, allowed_model_modules
from tula_service.specfile import load_spec_file
from tula_service.store import IdempotencyConflict, Store
from tula_service.submission_schema import publish_job_submission
from tula_service.user_code_check import checked_submission, client_submission
from tula_service.whatif import WhatIf, merged_spec

log = logging.getLogger(__name__)

EXECUTORS = ("local", "ray", "none")
DATABASE_URL_ENV = "TULA_DATABASE_URL"
IDEMPOTENCY_KEY_MAX_CHARS = 255
PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": Problem, "content": {"application/problem+json": {}}} for code in (400, 401, 404, 409, 413, 422)
}


def default_database_url() -> str:
    return os.environ.get(DATABASE_URL_ENV) or "sqlite:///var/tula.db"


@dataclass(frozen=True)
class Settings:
    database_url: str = "sqlite:///var/tula.db"
    executor: str = "local"  # local | ray | none (API only: another process on the database dispatches)
    workers: int | None = None  # local executor: default one per local GPU, one on a host without GPUs
    ray_address: str | None = None
    seed_example: Path | None = None
    public_reads: bool = False  # with tokens configured, GETs under /v1 need no token
    require_token: bool = False  # refuse /v1 even when every token was revoked (non-loopback servers)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # Host names the server answers to (tula_service.security); `tula serve` sets the bound address,
    # the loopback names and --allowed-host / TULA_ALLOWED_HOSTS.
    allowed_hosts: tuple[str, ...] = IN_PROCESS_ALLOWED_HOSTS


def _seed_if_empty(store: Store, executor, example: Path | None) -> None:
    if example is None or store.count_jobs() > 0:
        return
    job, _ = store.create_job(JobSpec.model_validate(load_spec_file(example)))
    log.info("empty database: submitted the example spec %s as job %s", example, job.id)
    executor.notify()


def _make_executor(settings: Settings, store: Store, metrics: Metrics):
    if settings.executor == "local":
        return LocalExecutor(store, workers=settings.workers, on_finished=metrics.observe_point)
    if settings.executor == "ray":
        from tula_service.ray_executor import RayExecutor

        return RayExecutor(store, address=settings.ray_address, on_finished=metrics.observe_point)
    return NoExecutor()


# How a route's body is named in the message for a body sent without a JSON Content-Type.
BODY_NAMES = {"submit_job": "the job spec", "what_if": "the what-if"}
JSON_CONTENT_TYPE = re.compile(r"application/([\w.+-]+\+)?json\s*(;.*)?", re.IGNORECASE)


def allowed_methods(request: Request) -> list[str]:
    """Every method the request's path has a route for: a 405's Allow header (RFC 9110, 15.5.6)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    return sorted(methods)


def _json_position(document: str, position: int) -> str:
    """`line L column C` (from 1) of a character offset, as json.JSONDecodeError counts them."""
    line = document.count("\n", 0, position) + 1
    column = position - document.rfind("\n", 0, position)
    return f"line {line} column {column}"


def _readable_errors(request: Request, error: RequestValidationError) -> list[dict[str, Any]]:
    """The validation errors, with the two that name no field a user would know said in words: a body
    that is not JSON, and a body sent without a JSON Content-Type (FastAPI then reads it as bytes)."""
    errors = field_errors(list(error.errors()))
    content_type = request.headers.get("content-type")
    for raw, readable in zip(error.errors(), errors):
        loc = tuple(raw.get("loc", ()))
        if raw.get("type") == "json_invalid" and isinstance(error.body, str) and len(loc) == 2:
            reason = (raw.get("ctx") or {}).get("error", "JSON decode error")
            readable.update(field="body", message=f"request body is not valid JSON: {reason} at {_json_position(error.body, loc[1])}")
        elif loc == ("body",) and not (content_type and JSON_CONTENT_TYPE.fullmatch(content_type)):
            route = request.scope.get("route")
            name = BODY_NAMES.get(getattr(route, "name", ""), "the request body")
            sent = f"Content-Type: {content_type}" if content_type else "no Content-Type"
            readable.update(message=f"send {name} as JSON with Content-Type: application/json (this request had {sent})",
                            type="content_type")
    return errors


def _install_problem_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_problem(request: Request, error: StarletteHTTPException):
        headers = dict(error.headers or {})
        if error.status_code == status.HTTP_405_METHOD_NOT_ALLOWED:
            headers["Allow"] = ", ".join(allowed_methods(request))
        return problem_response(error.status_code, str(error.detail), request.url.path, headers=headers or None)

    @app.exception_handler(RequestValidationError)
    async def validation_problem(request: Request, error: RequestValidationError):
        errors = _readable_errors(request, error)
        if len(errors) == 1 and errors[0]["type"] in ("json_invalid", "content_type"):
            detail = errors[0]["message"]
        else:
            fields = ", ".join(e["field"] for e in errors[:5])
            detail = f"invalid request: {fields}" if fields else "invalid request"
        return problem_response(422, detail, request.url.path, title="Invalid request", errors=errors)

    @app.exception_handler(ProblemError)
    async def raised_problem(request: Request, error: ProblemError):
        return problem_response(error.status, error.detail, request.url.path, **error.kwargs)

    @app.exception_handler(Exception)
    async def internal_problem(request: Request, error: Exception):
        # Answered outside the middleware stack (Starlette's ServerErrorMiddleware): the headers are added here.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return problem_response(500, f"internal error ({type(error).__name__}); see the server log", request.url.path,
                                headers={"Content-Security-Policy": DEFAULT_CSP, **STATIC_SECURITY_HEADERS})


def _what_if_conflict(job_id: str, error: ValidationError) -> ProblemError:
    """A what-if that is well formed but does not fit the job's stored spec (max_lr below its
    reference_lr, objective 'deadline' without a deadline, ...): a 409 naming the fields, as a 422 would."""
    errors = field_errors([{**e, "loc": ("body", *e["loc"])} for e in error.errors(include_url=False)])
    fields = ", ".join(dict.fromkeys(e["field"] for e in errors[:5]))
    return ProblemError(409, f"the what-if does not fit job '{job_id}': its stored spec with the what-if applied "
                        f"is invalid at {fields}", kind="what-if-does-not-fit", title="What-if does not fit the job",
                        errors=errors)


PYDANTIC_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def standard_bounds(schema: Any) -> Any:
    """The OpenAPI document with JSON Schema's names for numeric bounds, in place. pydantic writes a bound
    that follows a validator in an Annotated type (`Annotated[int, BeforeValidator(...), Field(ge=1)]`,
    as tula_service.spec's counts are) as `ge`/`le`/`gt`/`lt`, which JSON Schema does not know, so
    clients and schemathesis would take `batch: 0` for valid."""
    if isinstance(schema, list):
        for item in schema:
            standard_bounds(item)
    elif isinstance(schema, dict):
        if schema.get("type") in ("integer", "number"):
            for pydantic_name, json_schema_name in PYDANTIC_BOUNDS.items():
                if pydantic_name in schema:
                    schema.setdefault(json_schema_name, schema.pop(pydantic_name))
        for value in schema.values():
            standard_bounds(value)
    return schema


def create_app(settings: Settings = Settings()) -> FastAPI:
    if settings.executor not in EXECUTORS:
        raise ValueError(f"executor '{settings.executor}' is not available; known: {', '.join(EXECUTORS)}")
    if settings.database_url.startswith("sqlite:///"):
        Path(settings.database_url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = make_engine(settings.database_url)
    sessions = make_session_factory(engine)
    store = Store(sessions)
    metrics = Metrics(store)
    executor = _make_executor(settings, store, metrics)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        executor.start()
        _seed_if_empty(store, executor, settings.seed_example)
        yield
        executor.stop()

    app = FastAPI(
        title="Tula",
        version="0.2.0",
        summary="Batch-size optimizer: profile, model, and pick the knee of the time/cost Pareto curve.",
        lifespan=lifespan,
        responses=PROBLEM_RESPONSES,
        docs_url=None,  # served from the installed fastapi-offline package by mount_api_docs, not a CDN
        redoc_url=None,
    )
    app.state.store = store
    app.state.executor = executor
    app.state.settings = settings
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    # Each added outside the one before: a request without a valid token is refused before its body is
    # read, one for another Host before its token is looked up, and every answer gets the security headers.
    app.add_middleware(TokenAuth, sessions=sessions, public_reads=settings.public_reads,
                       require_token=settings.require_token)
    app.add_middleware(HostAllowlist, allowed_hosts=settings.allowed_hosts)
    app.add_middleware(SecurityHeaders)
    _install_problem_handlers(app)

    @app.get("/healthz", tags=["operations"])
    def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["operations"], responses={503: PROBLEM_RESPONSES[422]})
    def readyz() -> Response:
        """Readiness: the database answers, its schema is the newest, and the executor's workers live."""
        checks: dict[str, str] = {}
        try:
            with engine.connect() as connection:
                connection.execute(text("SELECT 1"))
                revision = current_revision(connection)
            checks["database"] = "ok"
            checks["schema"] = revision if revision == head_revision() else f"{revision} (expected {head_revision()})"
        except Exception as error:  # noqa: BLE001 - any database failure means not ready
            checks["database"] = f"unreachable: {type(error).__name__}"
        checks["executor"] = f"{settings.executor}: " + ("running" if executor.alive() else "stopped")
        ready = checks["database"] == "ok" and checks.get("schema") == head_revision() and executor.alive()
        if not ready:
            return problem_response(503, "not ready: " + "; ".join(f"{k} {v}" for k, v in checks.items()),
                                    "/readyz", checks=checks)
        return JSONResponse({"status": "ready", "checks": checks})

    @app.get("/metrics", tags=["operations"], response_class=Response)
    def prometheus_metrics() -> Response:
        """Prometheus text format: tula_jobs{state}, tula_queue_depth_points, tula_point_duration_seconds."""
        return Response(content=metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/catalog/models", tags=["catalog"])
    def catalog_models() -> dict[str, Any]:
        return {"models": [asdict(info) for info in sorted(MODELS.values(), key=lambda i: i.name)],
                "user_models": {"allowed_module_prefixes": allowed_model_modules(), "env": ALLOWED_MODULES_ENV}}

    @app.get("/v1/catalog/datasets", tags=["catalog"])
    def catalog_datasets() -> dict[str, Any]:
        return {"datasets": [asdict(info) for info in sorted(DATASETS.values(), key=lambda i: i.name)]}

    @app.get("/v1/catalog/gpus", tags=["catalog"])
    def catalog_gpus() -> dict[str, Any]:
        """GPU types: memory, default price, intra-node link, peak BF16 and memory bandwidth (catalog-assumed)."""
        return {"gpus": gpu_catalog_listing()}

    @app.post("/v1/jobs", status_code=status.HTTP_202_ACCEPTED, response_model=JobView, tags=["jobs"],
              responses={200: {"model": JobView, "description": "a retried submission: the job made the first time"}},
              dependencies=[Depends(client_submission)])
    def submit_job(
        spec: JobSpec,
        response: Response,
        idempotency_key: Annotated[str | None, Header(max_length=IDEMPOTENCY_KEY_MAX_CHARS, min_length=1)] = None,
    ) -> JobView:
        """Submit a job. With an `Idempotency-Key` header, a retried submission returns the same job
        (200, `Idempotent-Replayed: true`); the same key with a different spec is a 422."""
        try:  # user code is checked here, in this worker thread, not while the event loop validated the body
            spec = checked_submission(spec, allowed_model_modules())
        except ValidationError as error:
            raise RequestValidationError(
                [{**e, "loc": ("body", *e["loc"])} for e in error.errors(include_url=False, include_context=False)]
            ) from None
        try:
            job, created = store.create_job(spec, idempotency_key)
        except IdempotencyConflict as error:
            raise RequestValidationError(
                [{"loc": ("header", "Idempotency-Key"), "msg": str(error), "type": "idempotency_key_reused"}]
            ) from None
        if created:
            executor.notify()
        else:
            response.status_code = status.HTTP_200_OK
            response.headers["Idempotent-Replayed"] = "true"
        response.headers["Location"] = f"/v1/jobs/{job.id}"
        return JobView.of(job)

    @app.get("/v1/jobs", response_model=JobList, tags=["jobs"])
    def list_jobs(
        state: Annotated[list[JobState], Query(description="filter: one or more states, repeated (`?state=done&state=failed`)")] = [],  # noqa: B006
        limit: int = Query(50, ge=1, le=500),
        offset: int = Query(0, ge=0, le=10**9),
    ) -> JobList:
        total = store.count_jobs(state)
        jobs = [JobSummary.of(j) for j in store.list_jobs(state, limit, offset)]
        return JobList(jobs=jobs, total=total, limit=limit, offset=offset, next_offset=next_offset(offset, limit, total))

    def _not_found(job_id: str) -> HTTPException:
        return HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job '{job_id}' not found")

    def _job_or_404(job_id: str):
        job = store.get_job(job_id)
        if job is None:
            raise _not_found(job_id)
        return job

    @app.get("/v1/jobs/{job_id}", response_model=JobView | JobDetail, tags=["jobs"])
    def get_job(
        job_id: str,
        points: Annotated[bool, Query(description="false: the job without its points (a JobDetail), for polling "
                                      "its state and progress; GET /v1/jobs/{job_id}/points pages the points")] = True,
    ) -> JobView | JobDetail:
        """The job with its spec and, unless `points=false`, every point."""
        job = store.get_job(job_id, measurements=False)  # neither view shows a measurement record
        if job is None:
            raise _not_found(job_id)
        return JobView.of(job) if points else JobDetail.of(job)

    @app.get("/v1/jobs/{job_id}/points", response_model=PointList, tags=["jobs"])
    def get_points(
        job_id: str,
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

    @app.post("/v1/jobs/{job_id}/cancel", response_model=JobView, tags=["jobs"])
    def cancel_job(job_id: str) -> JobView:
        """Cancel a queued or running job: its running points are stopped, the rest never run.
        Cancelling a cancelled job is a no-op; a done or failed job is a 409."""
        job = _job_or_404(job_id)
        if job.state in ("done", "failed"):
            raise HTTPException(status.HTTP_409_CONFLICT, detail=f"job is already {job.state}; nothing to cancel")
        executor.cancel(store.cancel_job(job_id))
        return JobView.of(_job_or_404(job_id))

    @app.delete("/v1/jobs/{job_id}", status_code=status.HTTP_204_NO_CONTENT, tags=["jobs"])
    def delete_job(job_id: str) -> Response:
        """Delete a job and its measurements (an active job is cancelled first)."""
        _job_or_404(job_id)
        executor.cancel(store.cancel_job(job_id))
        store.delete_job(job_id)
        return Response(status_code=status.HTTP_204_NO_CONTENT)

    @app.get("/v1/jobs/{job_id}/measurements", response_model=MeasurementList, tags=["jobs"])
    def get_measurements(job_id: str) -> MeasurementList:
        """Every profiling point with its attempts, timings, errors and the worker's raw record."""
        job = _job_or_404(job_id)
        return MeasurementList(job_id=job.id, points=[MeasurementView.of(p) for p in job.points])

    @app.get("/v1/jobs/{job_id}/recommendation", tags=["jobs"])
    def get_recommendation(job_id: str) -> dict[str, Any]:
        job = _job_or_404(job_id)
        if job.state in ("failed", "cancelled"):
            raise HTTPException(status.HTTP_409_CONFLICT, detail=f"job {job.state}" + (f": {job.error}" if job.error else ""))
        if job.recommendation is None:
            view = JobView.of(job)
            raise HTTPException(
                status.HTTP_409_CONFLICT,
                detail=f"job is {job.state} ({view.progress.points_done}/{view.progress.points_total} points); "
                "the recommendation exists once it is done",
            )
        return {"job_id": job.id, **job.recommendation}

    @app.post("/v1/jobs/{job_id}/plan", tags=["jobs"])
    def what_if(job_id: str, what_if: WhatIf) -> dict[str, Any]:
        """Re-plan the job's stored measurements for another cluster, GPU type, pricing, objective,
        deadline, budget or reference run (no profiling). Fields left out keep their stored values. A
        what-if outside its schema is a 422; one that does not fit the stored spec (a rule between
        fields, e.g. max_lr below the stored reference_lr) is a 409 naming the fields."""
        job = _job_or_404(job_id)
        if job.state != "done":
            raise HTTPException(status.HTTP_409_CONFLICT, detail=f"job is {job.state}: what-if needs its measurements")
        try:
            spec = merged_spec(job.spec, what_if)
        except ValidationError as error:
            raise _what_if_conflict(job.id, error) from None
        measurements, failed = plan_inputs(job)
        try:
            return {"job_id": job.id, "what_if": what_if.given(), **plan(spec, measurements, failed)}
        except NotEnoughMeasurements as error:
            raise HTTPException(status.HTTP_409_CONFLICT, detail=str(error)) from None

    app.openapi = lambda: publish_job_submission(standard_bounds(FastAPI.openapi(app)))  # type: ignore[method-assign]  # cached by FastAPI
    mount_api_docs(app)
    mount_dashboard(app)
    return app
