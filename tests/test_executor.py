"""The local executor with real child processes: failures cost a point, never the server."""

import stat
import time

from tula_service.db import make_engine, make_session_factory
from tula_service.executor import LocalExecutor
from tula_service.spec import JobSpec
from tula_service.store import Store
from tests.handmade import spec_dict


def _store(tmp_path) -> Store:
    return Store(make_session_factory(make_engine(f"sqlite:///{tmp_path}/jobs.db")))


def _fake_python(tmp_path, body: str) -> str:
    """An executable that stands in for the worker's python: it really crashes, sleeps, etc."""
    path = tmp_path / "fake-python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _run_until_finished(store: Store, executor: LocalExecutor, job_id: str, timeout_s: float = 60):
    executor.start()
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            job = store.get_job(job_id)
            if job.state in ("done", "failed"):
                return job
            time.sleep(0.1)
        raise AssertionError(f"job still {store.get_job(job_id).state}")
    finally:
        executor.stop()


def test_crashing_child_fails_its_points_and_the_job_says_why(tmp_path):
    store = _store(tmp_path)
    job = store.create_job(JobSpec.model_validate(spec_dict(batch_sizes=[8, 16])))
    executor = LocalExecutor(store, python=_fake_python(tmp_path, "echo 'worker exploded' >&2; kill -SEGV $$"), poll_s=0.05)
    finished = _run_until_finished(store, executor, job.id)
    assert finished.state == "failed"
    assert all(p.state == "failed" and "killed by signal 11" in p.error for p in finished.points)
    assert "worker exploded" in finished.points[0].error
    assert "need at least 2 successfully profiled batch sizes" in finished.error


def test_child_that_overruns_its_timeout_is_killed(tmp_path):
    store = _store(tmp_path)
    spec = spec_dict(batch_sizes=[8, 16], profiling={"timeout_s": 0.5})
    job = store.create_job(JobSpec.model_validate(spec))
    executor = LocalExecutor(store, python=_fake_python(tmp_path, "sleep 30"), poll_s=0.05)
    started = time.monotonic()
    finished = _run_until_finished(store, executor, job.id)
    assert time.monotonic() - started < 20
    assert all("timed out after 0.5 s" in p.error for p in finished.points)


def test_points_left_running_by_a_dead_server_are_requeued(tmp_path):
    store = _store(tmp_path)
    job = store.create_job(JobSpec.model_validate(spec_dict(batch_sizes=[8, 16])))
    claimed = store.claim_next_point()
    assert claimed.state == "running" and store.get_job(job.id).state == "profiling"
    assert store.requeue_interrupted() == 1
    assert {p.state for p in store.get_job(job.id).points} == {"queued"}


