"""Errors as `application/problem+json` (RFC 9457, Problem Details for HTTP APIs).

Every error body has `type` (a URI naming the kind of problem), `title` (the same for every
occurrence of that type), `status`, `detail` (this occurrence, in words) and `instance` (the request
path). Validation problems add `errors`: one entry per bad field with its dotted `field` path
(`body.cluster.nodes`), `message` and the validator's `type`.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from starlette.responses import JSONResponse

PROBLEM_MEDIA_TYPE = "application/problem+json"
PROBLEM_TYPE_BASE = "https://tula.dev/problems/"


def problem_type(status: int, kind: str | None = None) -> str:
    """A stable type URI per status (https://tula.dev/problems/not-found, .../validation-error, ...),
    or per kind where one status has a problem of its own (.../host-not-allowed)."""
    if kind is not None:
        return PROBLEM_TYPE_BASE + kind
    if status == 422:
        return PROBLEM_TYPE_BASE + "validation-error"
    return PROBLEM_TYPE_BASE + HTTPStatus(status).phrase.lower().replace(" ", "-").replace("'", "")


def problem_body(status: int, detail: str, instance: str | None = None, *, title: str | None = None,
                 kind: str | None = None, errors: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "type": problem_type(status, kind),
        "title": title or HTTPStatus(status).phrase,
        "status": status,
        "detail": detail,
    }
    if instance is not None:
        body["instance"] = instance
    if errors is not None:
        body["errors"] = errors
    body.update(extra)
    return body


def problem_response(status: int, detail: str, instance: str | None = None, *, headers: dict[str, str] | None = None,
                     **kwargs: Any) -> JSONResponse:
    return JSONResponse(problem_body(status, detail, instance, **kwargs), status_code=status,
                        headers=headers, media_type=PROBLEM_MEDIA_TYPE)


class ProblemError(Exception):
    """Raised by a route for an answer that carries more than an HTTPException can: a problem with `errors`."""

    def __init__(self, status: int, detail: str, **kwargs: Any):
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.kwargs = kwargs


def field_errors(validation_errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """pydantic/FastAPI errors -> [{field, message, type}] with dotted paths."""
    return [
        {"field": ".".join(str(part) for part in error.get("loc", ())), "message": error.get("msg", ""),
         "type": error.get("type", "")}
        for error in validation_errors
    ]
