"""The FastAPI app: the store, the executor and the middleware, with a router per resource
(tula_service.api.operations, .catalog, .jobs, .plan) that reaches them through tula_service.api.deps.

Errors are application/problem+json (tula_service.api.errors); bodies are capped by tula_service.limits;
the Host allowlist and the security headers are tula_service.api.security; tokens are tula_service.api.auth;
/metrics is Prometheus text (tula_service.api.metrics); the OpenAPI document is tula_service.api.openapi.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI

from tula_service.api import catalog, jobs, operations, plan, runs
from tula_service.api.auth import TokenAuth
from tula_service.api.dashboard import mount_api_docs, mount_dashboard
from tula_service.api.errors import PROBLEM_RESPONSES, install_problem_handlers
from tula_service.api.metrics import Metrics
from tula_service.runs.plan_cache import PlanCache
from tula_service.api.openapi import install_openapi
from tula_service.api.security import IN_PROCESS_ALLOWED_HOSTS, HostAllowlist, SecurityHeaders
from tula_service.dispatch.executor import LocalExecutor, NoExecutor
from tula_service.limits import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimit
from tula_service.settings import environment
from tula_service.spec.job_spec import JobSpec
from tula_service.spec.specfile import load_spec_file
from tula_service.store.db import make_engine, make_session_factory
from tula_service.store.job_store import Store

log = logging.getLogger(__name__)

EXECUTORS = ("local", "ray", "none")
ROUTERS = (operations.router, catalog.router, jobs.router, plan.router, runs.router)  # a router per resource


def default_database_url() -> str:
    return environment().database_url


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
    # Host names the server answers to (tula_service.api.security); `tula serve` sets the bound address,
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
        from tula_service.dispatch.ray_executor import RayExecutor

        return RayExecutor(store, address=settings.ray_address, on_finished=metrics.observe_point)
    return NoExecutor()


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
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.plans = PlanCache()  # GET /v1/runs/{id}/plan answers that would not differ
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    # Each added outside the one before: a request without a valid token is refused before its body is
    # read, one for another Host before its token is looked up, and every answer gets the security headers.
    app.add_middleware(TokenAuth, sessions=sessions, public_reads=settings.public_reads,
                       require_token=settings.require_token)
    app.add_middleware(HostAllowlist, allowed_hosts=settings.allowed_hosts)
    app.add_middleware(SecurityHeaders)
    install_problem_handlers(app)

    app.state.routers = ROUTERS
    for router in ROUTERS:
        app.include_router(router)
    install_openapi(app)
    mount_api_docs(app)
    mount_dashboard(app)
    return app
