"""A typed HTTP client for the Tula API (httpx). The CLI uses it; so can an orchestrator.

Responses parse into the API's own pydantic models (`tula_service.schemas`: JobView, JobList,
PointList, MeasurementList; `tula_service.plan.recommendation`: JobRecommendation, WhatIfPlan). Recommendations
and what-if plans are checked against their model and returned as the JSON dicts the server sent
(`recommendation_model` and `plan_model` return the models). An answer that breaks its model raises
pydantic's ValidationError. Errors are `TulaError` with the server's problem+json body and a message
naming each bad field.

Runs (a training run's telemetry and advice): `start_run`, `run`, `run_plan`, and `upload_telemetry`, which sends
records (a `TulaRun` offline JSONL file's, say) in posts of the server's bound.

Retries: transport errors (connection refused or reset, timeouts) and 502/503/504 are retried with
exponential backoff on every request that is safe to repeat. A submission always carries an
`Idempotency-Key` (a fresh uuid4 unless given) and every retry reuses it, so a submission whose
response was lost is answered with the job the first attempt made, never a second job.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from tula_service.plan.recommendation import JobRecommendation, StatelessPlan, WhatIfPlan
from tula_service.runs.telemetry import MAX_RECORDS_PER_BATCH
from tula_service.schemas import JobList, JobSummary, JobView, MeasurementList, PointList
from tula_service.settings import environment
from tula_service.store.states import TERMINAL_JOB_STATES

RETRY_STATUSES = frozenset({502, 503, 504})
MAX_BACKOFF_S = 10.0
CATALOG_KINDS = ("models", "datasets", "losses", "gpus")


class TulaError(RuntimeError):
    """The server said no. `message` carries its explanation, one line per bad field for a 422;
    `problem` is the application/problem+json body (None when the body was not JSON)."""

    def __init__(self, status_code: int, message: str, problem: dict[str, Any] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.problem = problem


def _field(path: str) -> str:
    """`body.pricing.price` -> `pricing.price`: the body is the spec the user wrote."""
    if path == "body":
        return "(body)"
    return path.removeprefix("body.")


def explain(response: httpx.Response) -> tuple[str, dict[str, Any] | None]:
    """(message, problem body) for an error response."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or f"HTTP {response.status_code} {response.reason_phrase}", None
    if not isinstance(body, dict):
        return str(body), None
    detail, errors = body.get("detail"), body.get("errors") or []
    if isinstance(detail, list):  # FastAPI's own validation body: {"detail": [{loc, msg}, ...]}
        errors = [{"field": ".".join(str(p) for p in e.get("loc", [])), "message": e.get("msg", "")} for e in detail]
        detail = "invalid request"
    lines = [str(detail if detail is not None else body.get("title") or f"HTTP {response.status_code}")]
    lines += [f"{_field(str(e.get('field', '')))}: {e.get('message', '')}" for e in errors if isinstance(e, dict)]
    return "\n".join(lines), body


def _raise_for_problem(response: httpx.Response) -> httpx.Response:
    if response.status_code >= 400:
        message, problem = explain(response)
        raise TulaError(response.status_code, message, problem)
    return response


PLAN_TIMEOUT_S = 300.0  # POST /v1/plan: the placement model's fit over thousands of steps


def _checked(model: type[BaseModel], answer: dict[str, Any]) -> dict[str, Any]:
    """The answer as the server sent it, once it validates as `model` (pydantic's ValidationError if not)."""
    model.model_validate(answer)
    return answer


class TulaClient:
    """`TulaClient()` talks to $TULA_URL (default http://127.0.0.1:8000) with $TULA_TOKEN, if set."""

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.25,
        transport: httpx.BaseTransport | None = None,
    ):
        env = environment()
        self.base_url = (base_url or env.url).rstrip("/")
        token = token if token is not None else env.token
        self.retries = retries
        self.backoff_s = backoff_s
        headers = {"User-Agent": "tula-client"}
        if token and token.strip():
            headers["Authorization"] = f"Bearer {token.strip()}"
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers, transport=transport)

    # --- transport -------------------------------------------------------------------------------

    def _send(self, method: str, path: str, *, retry: bool = True, **kwargs: Any) -> tuple[httpx.Response, int]:
        """The response and how many attempts it took; retries only where repeating is safe."""
        attempt = 0
        while True:
            attempt += 1
            retry_after_s: float | None = None
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError:
                if not retry or attempt > self.retries:
                    raise
            else:
                if not retry or response.status_code not in RETRY_STATUSES or attempt > self.retries:
                    return response, attempt
                header = response.headers.get("retry-after", "")
                retry_after_s = float(header) if header.replace(".", "", 1).isdigit() else None
            backoff_s = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
            time.sleep(min(MAX_BACKOFF_S, retry_after_s) if retry_after_s is not None else backoff_s)

    def _json(self, method: str, path: str, *, retry: bool = True, **kwargs: Any) -> Any:
        response, _ = self._send(method, path, retry=retry, **kwargs)
        return _raise_for_problem(response).json()

    @staticmethod
    def _job_path(job_id: str, *rest: str) -> str:
        return "/".join((f"/v1/jobs/{quote(job_id, safe='')}", *rest))

    # --- jobs ------------------------------------------------------------------------------------

    def submit(self, spec: Mapping[str, Any] | BaseModel, idempotency_key: str | None = None) -> JobView:
        """Submit a spec; a retried submission (same key) returns the job the first attempt made."""
        body = spec.model_dump(mode="json") if isinstance(spec, BaseModel) else dict(spec)
        headers = {"Idempotency-Key": idempotency_key or str(uuid.uuid4())}
        return JobView.model_validate(self._json("POST", "/v1/jobs", json=body, headers=headers))

    def submit_with_measurements(
        self, spec: Mapping[str, Any], measurements: Iterable[Mapping[str, Any]] = (), measurements_csv: str | None = None,
        profile: str = "missing", idempotency_key: str | None = None,
    ) -> JobView:
        """POST /v1/jobs/from-measurements: a job that starts from measurements taken anywhere and profiles only
        what they miss (profile "missing"), or nothing ("none": planned at once, or a 409)."""
        body: dict[str, Any] = {"spec": dict(spec), "measurements": [dict(m) for m in measurements], "profile": profile}
        if measurements_csv is not None:
            body["measurements_csv"] = measurements_csv
        headers = {"Idempotency-Key": idempotency_key or str(uuid.uuid4())}
        path = "/v1/jobs/from-measurements"
        return JobView.model_validate(self._json("POST", path, json=body, headers=headers, timeout=PLAN_TIMEOUT_S))

    def job(self, job_id: str) -> JobView:
        return JobView.model_validate(self._json("GET", self._job_path(job_id)))

    def jobs(self, states: Iterable[str] | str | None = None, limit: int = 50, offset: int = 0) -> JobList:
        """One page of jobs, newest first; `next_offset` is None on the last page."""
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if states:
            params["state"] = [states] if isinstance(states, str) else list(states)
        return JobList.model_validate(self._json("GET", "/v1/jobs", params=params))

    def iter_jobs(self, states: Iterable[str] | str | None = None, page_size: int = 100) -> Iterator[JobSummary]:
        """Every job matching `states`, fetched a page at a time."""
        states = [states] if isinstance(states, str) else (list(states) if states else None)
        offset: int | None = 0
        while offset is not None:
            page = self.jobs(states, limit=page_size, offset=offset)
            yield from page.jobs
            offset = page.next_offset

    def cancel(self, job_id: str) -> JobView:
        """Cancel a queued or running job (a no-op on a cancelled one; 409 once done or failed)."""
        return JobView.model_validate(self._json("POST", self._job_path(job_id, "cancel")))

    def delete(self, job_id: str) -> None:
        """Delete a job and its measurements. A 404 after a retry means the lost attempt deleted it."""
        response, attempts = self._send("DELETE", self._job_path(job_id))
        if response.status_code == 404 and attempts > 1:
            return
        _raise_for_problem(response)

    def points(self, job_id: str, limit: int = 50, offset: int = 0) -> PointList:
        """One page of the job's points, in the order they were made; `next_offset` is None on the last page."""
        return PointList.model_validate(
            self._json("GET", self._job_path(job_id, "points"), params={"limit": limit, "offset": offset})
        )

    def measurements(self, job_id: str) -> MeasurementList:
        return MeasurementList.model_validate(self._json("GET", self._job_path(job_id, "measurements")))

    def recommendation(self, job_id: str) -> dict[str, Any]:
        """The stored recommendation (409 until the job is done), checked against JobRecommendation."""
        return _checked(JobRecommendation, self._json("GET", self._job_path(job_id, "recommendation")))

    def recommendation_model(self, job_id: str) -> JobRecommendation:
        return JobRecommendation.model_validate(self._json("GET", self._job_path(job_id, "recommendation")))

    def plan(self, job_id: str, what_if: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Re-plan a done job's measurements: {cluster: {...}, pricing: {...}, objective, deadline_h, budget_usd};
        the answer is checked against WhatIfPlan."""
        return _checked(WhatIfPlan, self._json("POST", self._job_path(job_id, "plan"), json=dict(what_if or {})))

    def plan_measurements(
        self, spec: Mapping[str, Any], measurements: Iterable[Mapping[str, Any]] = (), measurements_csv: str | None = None
    ) -> dict[str, Any]:
        """POST /v1/plan: a spec planned from measurements taken anywhere (Measurement records and/or a CSV
        of measured steps), nothing stored; the answer is checked against StatelessPlan."""
        body: dict[str, Any] = {"spec": dict(spec), "measurements": [dict(m) for m in measurements]}
        if measurements_csv is not None:
            body["measurements_csv"] = measurements_csv
        # fitting the placement model to many steps takes seconds; a retry would fit them again
        return _checked(StatelessPlan, self._json("POST", "/v1/plan", json=body, retry=False, timeout=PLAN_TIMEOUT_S))

    def plan_model(self, job_id: str, what_if: Mapping[str, Any] | None = None) -> WhatIfPlan:
        return WhatIfPlan.model_validate(self._json("POST", self._job_path(job_id, "plan"), json=dict(what_if or {})))

    def wait(
        self,
        job_id: str,
        poll_s: float = 1.0,
        timeout_s: float | None = None,
        on_progress: Callable[[JobView], None] | None = None,
    ) -> JobView:
        """Poll until the job is done, failed or cancelled; returns its final view."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if on_progress:
                on_progress(job)
            if job.state in TERMINAL_JOB_STATES:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.state} after {timeout_s:g} s")
            time.sleep(poll_s)

    # --- runs (issue 17: a training run's telemetry and advice) -------------------------------------

    @staticmethod
    def _run_path(run_id: str, *rest: str) -> str:
        return "/".join((f"/v1/runs/{quote(run_id, safe='')}", *rest))

    def start_run(self, job_id: str, options: Mapping[str, Any] | None = None, idempotency_key: str | None = None) -> dict[str, Any]:
        """POST /v1/runs: a run of a done job at its recommended configuration (options: hysteresis,
        min_steps_between_changes); a retry with the same key returns the run the first attempt made."""
        headers = {"Idempotency-Key": idempotency_key or str(uuid.uuid4())}
        return self._json("POST", "/v1/runs", json={"job_id": job_id, **dict(options or {})}, headers=headers)

    def run(self, run_id: str) -> dict[str, Any]:
        return self._json("GET", self._run_path(run_id))

    def run_plan(self, run_id: str) -> dict[str, Any]:
        """GET /v1/runs/{id}/plan: the configuration for the run's next interval, why, and what it rests on (a
        repeat changes nothing more, so a retry is safe)."""
        return self._json("GET", self._run_path(run_id, "plan"), timeout=PLAN_TIMEOUT_S)

    def upload_telemetry(self, run_id: str, records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
        """POST /v1/runs/{id}/telemetry in posts of at most MAX_RECORDS_PER_BATCH records; {"accepted", "duplicates",
        "posts"} summed (a step the run holds already is a duplicate, so a retried post is harmless)."""
        records = [dict(r) for r in records]
        totals = {"accepted": 0, "duplicates": 0, "posts": 0}
        for start in range(0, len(records), MAX_RECORDS_PER_BATCH):
            receipt = self._json("POST", self._run_path(run_id, "telemetry"), json={"records": records[start : start + MAX_RECORDS_PER_BATCH]})
            totals["accepted"] += receipt["accepted"]
            totals["duplicates"] += receipt["duplicates"]
            totals["posts"] += 1
        return totals

    # --- the rest --------------------------------------------------------------------------------

    def catalog(self, kind: str) -> dict[str, Any]:
        """kind: models, datasets, losses or gpus."""
        if kind not in CATALOG_KINDS:
            raise ValueError(f"catalog '{kind}' does not exist; known: {', '.join(CATALOG_KINDS)}")
        return self._json("GET", f"/v1/catalog/{kind}")

    def ready(self) -> dict[str, Any]:
        """/readyz: raises TulaError(503) with the failing checks when the server is not ready."""
        return self._json("GET", "/readyz", retry=False)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> TulaClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
