"""The OpenAPI document as the API publishes it: JSON Schema's names for numeric bounds, and the request
schema of POST /v1/jobs narrowed to what its validators accept (tula_service.spec.submission_schema), and
POST /v1/plan's request stating its spec and measurement records (tula_service.api.plan)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from tula_service.api.plan import publish_plan_request
from tula_service.spec.submission_schema import publish_job_submission

PYDANTIC_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def standard_bounds(schema: Any) -> Any:
    """The OpenAPI document with JSON Schema's names for numeric bounds, in place. pydantic writes a bound
    that follows a validator in an Annotated type (`Annotated[int, BeforeValidator(...), Field(ge=1)]`,
    as tula_service.spec.job_spec's counts are) as `ge`/`le`/`gt`/`lt`, which JSON Schema does not know, so
    clients and schemathesis would take `batch: 0` for valid."""
    if isinstance(schema, list):
        for item in schema:
            standard_bounds(item)
    elif isinstance(schema, dict):
        if schema.get("type") in ("integer", "number") or "anyOf" in schema:  # a bound on `int | float` sits by its anyOf
            for pydantic_name, json_schema_name in PYDANTIC_BOUNDS.items():
                if pydantic_name in schema:
                    schema.setdefault(json_schema_name, schema.pop(pydantic_name))
        for value in schema.values():
            standard_bounds(value)
    return schema


def install_openapi(app: FastAPI) -> None:
    """app.openapi() as published (FastAPI caches the document it builds; both steps are idempotent)."""
    app.openapi = lambda: standard_bounds(publish_plan_request(publish_job_submission(standard_bounds(FastAPI.openapi(app)))))  # type: ignore[method-assign]
