"""Errors as application/problem+json (tula_service.problems): the handlers, and the messages that say in
words what a bare validation error would not (a body that is not JSON, one without a JSON Content-Type,
a what-if that does not fit its job)."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from tula_service.api.security import DEFAULT_CSP, STATIC_SECURITY_HEADERS
from tula_service.problems import ProblemError, field_errors, problem_response
from tula_service.schemas import Problem

log = logging.getLogger(__name__)

PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": Problem, "content": {"application/problem+json": {}}} for code in (400, 401, 404, 409, 413, 422)
}

# How a route's body is named in the message for a body sent without a JSON Content-Type.
BODY_NAMES = {"submit_job": "the job spec", "what_if": "the what-if"}
JSON_CONTENT_TYPE = re.compile(r"application/([\w.+-]+\+)?json\s*(;.*)?", re.IGNORECASE)


def allowed_methods(request: Request) -> list[str]:
    """Every method the request's path has a route for: a 405's Allow header (RFC 9110, 15.5.6). A path that a
    route names literally is that resource alone (OpenAPI lists /v1/jobs/from-measurements apart from
    /v1/jobs/{job_id}), so templated routes that also match it do not count."""
    routes = [*request.app.router.routes, *(r for router in request.app.state.routers for r in router.routes)]
    matching = [r for r in routes if r.matches(request.scope)[0] is not Match.NONE]  # the routers' own: FastAPI
    literal = [r for r in matching if getattr(r, "methods", None) and not getattr(r, "param_convertors", None)]  # includes a router as one route
    return sorted({method for route in (literal or matching) for method in getattr(route, "methods", None) or ()})


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


def install_problem_handlers(app: FastAPI) -> None:
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


def what_if_conflict(job_id: str, error: ValidationError) -> ProblemError:
    """A what-if that is well formed but does not fit the job's stored spec (max_lr below its
    reference_lr, objective 'deadline' without a deadline, ...): a 409 naming the fields, as a 422 would."""
    errors = field_errors([{**e, "loc": ("body", *e["loc"])} for e in error.errors(include_url=False)])
    fields = ", ".join(dict.fromkeys(e["field"] for e in errors[:5]))
    return ProblemError(409, f"the what-if does not fit job '{job_id}': its stored spec with the what-if applied "
                        f"is invalid at {fields}", kind="what-if-does-not-fit", title="What-if does not fit the job",
                        errors=errors)
