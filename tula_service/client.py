"""A small typed HTTP client for the Tula API (the CLI uses it; so can an orchestrator)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


class TulaError(RuntimeError):
    """The server said no; the message carries its explanation (field paths for 422)."""

    def __init__(self, status_code: int, message: str):
        super().__init__(message)
        self.status_code = status_code


def _explain(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        return response.text
    if isinstance(detail, list):  # FastAPI validation errors: one line per field
        lines = []
        for error in detail:
            loc = ".".join(str(part) for part in error.get("loc", []) if part != "body")
            lines.append(f"{loc or '(spec)'}: {error.get('msg')}")
        return "\n".join(lines)
    return str(detail)


class TulaClient:
    def __init__(self, base_url: str | None = None, timeout_s: float = 30.0):
        self.base_url = (base_url or os.environ.get("TULA_URL") or DEFAULT_URL).rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s)

    def _request(self, method: str, path: str, **kwargs) -> Any:
        response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise TulaError(response.status_code, _explain(response))
        return response.json()

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self._request("POST", "/v1/jobs", json=spec)

    def job(self, job_id: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/jobs/{job_id}")

    def jobs(self, limit: int = 50, offset: int = 0) -> dict[str, Any]:
        return self._request("GET", "/v1/jobs", params={"limit": limit, "offset": offset})

    def recommendation(self, job_id: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/jobs/{job_id}/recommendation")

    def catalog(self, kind: str) -> dict[str, Any]:
        """kind: "models" or "datasets"."""
        return self._request("GET", f"/v1/catalog/{kind}")

    def wait(
        self,
        job_id: str,
        poll_s: float = 1.0,
        timeout_s: float | None = None,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Poll until the job is done or failed; returns the final job view."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if on_progress:
                on_progress(job)
            if job["state"] in ("done", "failed"):
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['state']} after {timeout_s:g} s")
            time.sleep(poll_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> TulaClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
