"""A finished job without profiling: hand-made measurements written through the real store and
fitted by the real planner, for API tests on any database backend."""

from __future__ import annotations

from tests.handmade import measurement, spec_dict
from tula_service.dispatch.dispatcher import Outcome, record_outcome
from tula_service.spec.job_spec import JobSpec
from tula_service.store.db import make_engine, make_session_factory
from tula_service.store.job_store import Store


def store_for(database_url: str) -> Store:
    return Store(make_session_factory(make_engine(database_url)))


def finished_job(store: Store, **overrides) -> str:
    """Submit a single-device spec and play every point through claim -> record_outcome, as a
    worker would; the job ends done with a recommendation. Returns its id."""
    job, _ = store.create_job(JobSpec.model_validate(spec_dict(name="handmade-done", **overrides)))
    while (point := store.claim_next_point("handmade")) is not None:
        record = measurement(point.batch_size)
        record_outcome(store, point.id, Outcome("done", record, None, False, 0.01, "handmade"))
    done = store.get_job(job.id)
    assert done.state == "done", done.error
    return job.id


def run_on_a_server(make_server, tmp_path) -> tuple[object, str]:
    """A server (no executor) on a fresh SQLite file holding a finished job, and a run of that job: (server, run id)."""
    import httpx

    database = tmp_path / "runs.db"
    job_id = finished_job(store_for(f"sqlite:///{database}"))
    server = make_server("--executor", "none", database_path=database)
    run = httpx.post(f"{server.url}/v1/runs", json={"job_id": job_id}, timeout=30).json()
    return server, run["id"]
