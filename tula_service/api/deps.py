"""What the routes depend on (FastAPI `Depends`): the store, the executor, the settings, the database
engine, the metrics and the run plans' cache the app was made with (`create_app` puts them on app.state).

Authentication is not a dependency but a middleware (tula_service.api.auth.TokenAuth): FastAPI reads and
validates a body before it solves a route's dependencies, and a request without a valid token must be
refused before its body is read.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request
from sqlalchemy.engine import Engine

from tula_service.api.metrics import Metrics
from tula_service.runs.plan_cache import PlanCache
from tula_service.store.job_store import Store


def _store(request: Request) -> Store:
    return request.app.state.store


def _executor(request: Request) -> Any:
    return request.app.state.executor


def _settings(request: Request) -> Any:  # tula_service.api.app.Settings (which imports the routers)
    return request.app.state.settings


def _engine(request: Request) -> Engine:
    return request.app.state.engine


def _metrics(request: Request) -> Metrics:
    return request.app.state.metrics


def _plans(request: Request) -> PlanCache:
    return request.app.state.plans


StoreDep = Annotated[Store, Depends(_store)]
ExecutorDep = Annotated[Any, Depends(_executor)]  # LocalExecutor, RayExecutor or NoExecutor: start/stop/notify/cancel/alive
SettingsDep = Annotated[Any, Depends(_settings)]  # tula_service.api.app.Settings
EngineDep = Annotated[Engine, Depends(_engine)]
MetricsDep = Annotated[Metrics, Depends(_metrics)]
PlansDep = Annotated[PlanCache, Depends(_plans)]
