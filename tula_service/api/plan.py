"""Stateless planning: a spec plus measurements in, a recommendation out, nothing stored.

The measurements are the service's own Measurement records (compute, comm, pilot, step: what GET
/v1/jobs/{id}/measurements returns, or a user's trainer writes) and/or a CSV table of measured steps
(tula_service.measurement_csv: `placement,local_bsz,step_time,sync_time` or
`num_nodes,num_replicas,local_bsz,step_time,sync_time`). A record that breaks the contract is a 422 naming
`measurements.<index>.<field>`; a CSV row that cannot be read, a 422 at `measurements_csv` naming the row
and the column. Measurements that are each valid but together cannot be planned from (fewer than two timed
batches, steps that cannot predict the all-reduce, numbers whose fit is not finite) are a 409 saying what is
missing, as a what-if of a job whose measurements cannot be planned is.

The published request schema (publish_plan_request) gives `spec` the JobSubmission schema of POST /v1/jobs
and each record the schema of its kind.

Planning may fit the placement model to many steps (seconds), so this POST needs a token where tokens
exist, also with public reads.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, status
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from tula_service.measurement import CommMeasurement, ComputeMeasurement, PilotMeasurement, StepMeasurement, parse_measurement, without_nonfinite
from tula_service.measurement_csv import LAYOUTS, CsvRowError, steps_from_csv
from tula_service.plan.recommend import NotEnoughMeasurements, plan
from tula_service.plan.recommendation import StatelessPlan
from tula_service.spec.job_spec import JobSpec
from tula_service.spec.points_wanted import Profile
from tula_service.spec.submission_schema import COMPONENT as JOB_SUBMISSION
from tula_service.spec.user_code_check import client_submission

MAX_MEASUREMENTS = 4096  # records; a request is at most 1 MiB anyway (--max-request-bytes)

router = APIRouter(prefix="/v1", tags=["plan"])


class PlanRequest(BaseModel):
    """A job spec and the measurements to plan it from."""

    model_config = ConfigDict(extra="forbid")

    spec: JobSpec
    measurements: list[dict[str, Any]] = Field(
        default_factory=list, max_length=MAX_MEASUREMENTS,
        description="Measurement records: kind compute, comm, pilot or step (placement, device_batch, step_time_s, sync_time_s)",
    )  # fmt: skip
    measurements_csv: str | None = Field(
        None, description="measured steps as a CSV table with the header " + " or ".join(",".join(c) for c in LAYOUTS.values())
        + " (the table's grammar is beyond JSON Schema: a row that cannot be read is a 422 naming the row and the column)",
    )


class JobFromMeasurements(PlanRequest):
    """POST /v1/jobs/from-measurements: a job spec, the measurements it starts from, and what to profile besides."""

    profile: Profile = Field(
        "missing", description="'missing': profile what the measurements do not cover (tula_service.spec.points_wanted); "
        "'none': plan from them alone",
    )  # fmt: skip


def parsed_measurements(request: PlanRequest) -> list[Any]:
    """The request's records and CSV rows as parsed Measurements; RequestValidationError naming each bad one.
    NaN and Infinity (Python's json reads them, RFC 8259 has none) are None, as in a worker's record (without_nonfinite)."""
    parsed, errors = [], []
    for index, record in enumerate(request.measurements):
        try:
            parsed.append(parse_measurement(without_nonfinite(record)))
        except ValidationError as error:
            errors += [{**e, "loc": ("body", "measurements", index, *e["loc"])} for e in error.errors(include_url=False, include_context=False)]
        except ValueError as error:
            errors.append({"loc": ("body", "measurements", index, "kind"), "msg": str(error), "type": "value_error"})
    if request.measurements_csv is not None:
        try:
            parsed += [parse_measurement(record) for record in steps_from_csv(request.measurements_csv)]
        except CsvRowError as error:
            errors.append({"loc": ("body", "measurements_csv"), "msg": str(error), "type": "csv_row",
                           "ctx": {"row": error.row, "column": error.column}})  # fmt: skip
    if errors:
        raise RequestValidationError(errors)
    return parsed


@router.post("/plan", response_model=StatelessPlan, response_model_exclude_unset=True,
             responses={409: {"description": "the measurements are valid but cannot be planned from: what is missing"}},
             dependencies=[Depends(client_submission)])  # the spec's server-set *_source fields ignored, as in a submission
def plan_measurements(request: PlanRequest) -> dict[str, Any]:
    """Plan a spec from measurements taken anywhere (this service's profiler, a trainer, a trace), with no
    profiling and nothing stored. Measured multi-device steps fit the placement-aware step-time model."""
    measurements = parsed_measurements(request)
    kinds: dict[str, int] = {}
    for measurement in measurements:
        kinds[measurement.kind] = kinds.get(measurement.kind, 0) + 1
    return {**plan_or_conflict(request.spec, measurements), "measurements": kinds}


def plan_or_conflict(spec: JobSpec, measurements: list[Any]) -> dict[str, Any]:
    """The recommendation of parsed measurements; HTTP 409 saying what is missing when they cannot be
    planned from, or what broke when their fit does."""
    try:
        planned = plan(spec, measurements)
    except NotEnoughMeasurements as error:
        raise HTTPException(status.HTTP_409_CONFLICT, detail=f"cannot plan these measurements: {error}") from None
    except (ValueError, ArithmeticError) as error:  # numbers so extreme that a fit breaks down
        raise HTTPException(status.HTTP_409_CONFLICT, detail=f"cannot fit these measurements: {error}") from None
    if not all_finite(planned):
        raise HTTPException(status.HTTP_409_CONFLICT, detail="cannot fit these measurements: the fitted models predict non-finite numbers")
    return planned


def all_finite(value: Any) -> bool:
    """No NaN or infinity anywhere in a JSON-like value (JSON cannot carry them)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(all_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(all_finite(v) for v in value)
    return True


PLAN_PATH = "/v1/plan"
JOB_FROM_MEASUREMENTS_PATH = "/v1/jobs/from-measurements"
RECORD_KINDS = (ComputeMeasurement, CommMeasurement, PilotMeasurement, StepMeasurement)


def publish_plan_request(openapi: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI document with the requests of POST /v1/plan and POST /v1/jobs/from-measurements stating what
    they accept, in place: `spec` as POST /v1/jobs's JobSubmission, and each measurement record as one of the
    Measurement kinds."""
    components = openapi["components"]["schemas"]
    records = TypeAdapter(list[ComputeMeasurement | CommMeasurement | PilotMeasurement | StepMeasurement]).json_schema(
        ref_template="#/components/schemas/{model}"
    )
    for name, schema in records.pop("$defs", {}).items():
        components.setdefault(name, schema)
    for path in (PLAN_PATH, JOB_FROM_MEASUREMENTS_PATH):
        body = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        request = components[body["$ref"].rsplit("/", 1)[-1]]
        request["properties"]["spec"] = {"$ref": f"#/components/schemas/{JOB_SUBMISSION}"}
        request["properties"]["measurements"]["items"] = records["items"]
    return openapi
