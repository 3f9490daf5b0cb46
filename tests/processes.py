"""Shared by the executor tests: stand-in interpreters, real process checks, submitting jobs and
waiting on them (in the store, or over a live server's API)."""

from __future__ import annotations

import stat
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import httpx

from tests.handmade import spec_dict
from tula_service.spec.job_spec import JobSpec
from tula_service.store.job_store import Store
from tula_service.store.states import TERMINAL_JOB_STATES

CRASHING_CHILD = "echo 'worker exploded' >&2; kill -SEGV $$"  # a fake_python body: every start dies


def fake_python(tmp_path: Path, body: str) -> str:
    """An executable that stands in for the worker's python: it really crashes, sleeps, etc.
    `$REAL` in the body is the real interpreter."""
    path = tmp_path / "fake-python"
    path.write_text(f"#!/bin/sh\nREAL={sys.executable}\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


# --- processes, from /proc ------------------------------------------------------------------------


def _stat_fields(pid: int | str) -> list[str]:
    """/proc/PID/stat after the command name: state, parent pid, process group, session, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_table() -> dict[int, list[str]]:
    """pid -> its /proc/PID/stat fields (as `_stat_fields`), for every process alive while it is read."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                table[int(entry.name)] = _stat_fields(entry.name)
            except (OSError, IndexError):  # it exited meanwhile
                continue
    return table


def gone(pid: int) -> bool:
    """The process has exited (no /proc entry) or is a zombie waiting for its parent."""
    try:
        return _stat_fields(pid)[0] == "Z"
    except OSError:
        return True


def parent_of(pid: int) -> int:
    return int(_stat_fields(pid)[1])


def children_of(pid: int) -> list[int]:
    return [child for child, fields in process_table().items() if int(fields[1]) == pid]


def command_line(pid: int) -> bytes:
    """The process's NUL-separated command line; empty once it has exited."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# --- jobs in the store ----------------------------------------------------------------------------


class Executor(Protocol):  # LocalExecutor, RayExecutor
    def start(self) -> None: ...
    def stop(self) -> None: ...


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def submit(store: Store, **overrides):
    job, created = store.create_job(JobSpec.model_validate(spec_dict(**overrides)))
    assert created
    return job


def wait_for_job(store: Store, job_id: str, states=TERMINAL_JOB_STATES, timeout_s: float = 180):
    def ended():
        job = store.get_job(job_id)
        return job if job.state in states else None

    try:
        return wait_for(ended, timeout_s, f"job {job_id} to reach {states}")
    except AssertionError:
        job = store.get_job(job_id)
        raise AssertionError(f"job still {job.state}: {[(p.kind, p.state, p.error) for p in job.points]}") from None


@contextmanager
def started(executor: Executor) -> Iterator[Executor]:
    """The executor, started; stopped afterwards whatever happened."""
    executor.start()
    try:
        yield executor
    finally:
        executor.stop()


def run_until_finished(store: Store, executor: Executor, job_id: str, timeout_s: float = 180):
    """Start the executor, wait for the job to end, stop the executor; returns the ended job."""
    with started(executor):
        return wait_for_job(store, job_id, timeout_s=timeout_s)


def assert_every_point_failed_crashing(job, attempts: int, worker: str) -> None:
    """The ended job failed: each point ran CRASHING_CHILD `attempts` times, and says so, with the
    reason of every attempt before the last one on `worker` (a worker name or its prefix)."""
    assert job.state == "failed"
    for point in job.points:
        assert point.state == "failed" and point.attempts == attempts
        assert point.error.startswith(f"failed after {attempts} attempts; last: profiling process died (killed by signal 11)")
        assert "worker exploded" in point.error
        assert len(point.attempt_errors) == attempts - 1
        assert all(error.startswith(f"attempt {n} on {worker}") for n, error in enumerate(point.attempt_errors, 1))


def running_child(store: Store, job_id: str, timeout_s: float = 120) -> tuple[int, int]:
    """(point id, child pid) of the job's running point once a local executor has started its child."""

    def running():
        return next(((p.id, p.worker_pid) for p in store.get_job(job_id).points if p.state == "running" and p.worker_pid), None)

    return wait_for(running, timeout_s, "a point's child to start")


# --- jobs over a live server's API ----------------------------------------------------------------


def submit_over_http(server_url: str, spec: dict) -> str:
    """POST the spec to /v1/jobs; returns the new job's id."""
    response = httpx.post(f"{server_url}/v1/jobs", json=spec, timeout=30)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def wait_for_job_over_http(server_url: str, job_id: str, timeout_s: float = 300) -> dict:
    """GET /v1/jobs/{job_id} until the job has ended; returns its JSON."""

    def ended():
        job = httpx.get(f"{server_url}/v1/jobs/{job_id}", timeout=30).json()
        return job if job["state"] in TERMINAL_JOB_STATES else None

    return wait_for(ended, timeout_s, f"job {job_id} to end", poll_s=0.3)
