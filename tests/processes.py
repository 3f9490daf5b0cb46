"""Shared by the executor tests: stand-in interpreters, real process checks, waiting on jobs."""

from __future__ import annotations

import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tula_service.db import TERMINAL_JOB_STATES
from tula_service.spec import JobSpec
from tula_service.store import Store
from tests.handmade import spec_dict


def fake_python(tmp_path: Path, body: str) -> str:
    """An executable that stands in for the worker's python: it really crashes, sleeps, etc.
    `$REAL` in the body is the real interpreter."""
    path = tmp_path / "fake-python"
    path.write_text(f"#!/bin/sh\nREAL={sys.executable}\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def gone(pid: int) -> bool:
    """The process has exited (no /proc entry) or is a zombie waiting for its parent."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


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
