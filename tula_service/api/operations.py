"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from sqlalchemy import text
from starlette.responses import JSONResponse

from tula_service.api.deps import EngineDep, ExecutorDep, MetricsDep, SettingsDep
from tula_service.api.errors import PROBLEM_RESPONSES
from tula_service.api.metrics import CONTENT_TYPE
from tula_service.problems import problem_response
from tula_service.store.migrate import current_revision, head_revision

router = APIRouter(tags=["operations"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}

@router.get("/readyz", responses={503: PROBLEM_RESPONSES[422]})
def readyz(engine: EngineDep, executor: ExecutorDep, settings: SettingsDep) -> Response:
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

@router.get("/metrics", response_class=Response)
def prometheus_metrics(metrics: MetricsDep) -> Response:
    """Prometheus text format: tula_jobs{state}, tula_queue_depth_points, tula_point_duration_seconds."""
    return Response(content=metrics.render(), media_type=CONTENT_TYPE)
