"""Running one profiling point, shared by every executor.

An executor claims a point from the store, builds its command (`point_command`), runs it in a child
process somewhere (`run_child`: here for the local executor, inside a Ray task for the Ray
executor) and hands the `Outcome` to `record_outcome`, which decides:

- a record came back (status ok / oom / failed): the point is finished with it. A "failed" record is
  the point's own error (it would fail again), so it is not retried;
- the worker died (killed by a signal, timed out, exited without a record): the point goes back to
  the queue until it has been started `profiling.max_attempts` times, then it is failed with the
  reason of every attempt;
- the job was cancelled meanwhile: nothing is written (the cancel already marked the point).

`run_child` never imports torch; the child (`python -m profiler.run_point` or `profiler.comm`) does.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tula_service.db import Job, Point
from tula_service.jobs import COMPUTE_POINT_KINDS, advance, comm_command_args, pilot_request, point_request
from tula_service.spec import JobSpec
from tula_service.store import Store

STDERR_TAIL_CHARS = 2000
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass
class Outcome:
    """What one attempt of a point produced."""

    state: str  # "done" | "oom" | "failed"
    measurement: dict[str, Any] | None
    error: str | None
    worker_died: bool  # no record came back: signal, timeout, crash; retried up to max_attempts
    duration_s: float
    worker: str  # where it ran: "local:HOST:PID" or "ray:NODE_ID"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Outcome:
        return cls(**data)


def point_command(python: str, job: Job, point: Point) -> list[str]:
    """The child's command line, without `--out FILE` (the runner adds it)."""
    if point.kind == "comm":
        return [python, "-m", "profiler.comm", *comm_command_args(job)]
    spec = JobSpec.model_validate(job.spec)
    request = pilot_request(spec) if point.kind == "pilot" else point_request(spec, point.batch_size)
    return [python, "-m", "profiler.run_point", "--request", json.dumps(request)]


def point_timeout_s(job: Job) -> float:
    return JobSpec.model_validate(job.spec).profiling.timeout_s


def kill_group(pid: int) -> None:
    """SIGKILL a child's whole process group (it runs in its own session)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _PRCTL = None


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL this process when the thread that started it ends, so a
    killed server (or Ray worker) leaves no orphan profiling on the device (Linux only)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)


def run_child(
    command: list[str],
    timeout_s: float,
    *,
    worker: str | None = None,
    env: dict[str, str] | None = None,
    on_start: Callable[[subprocess.Popen], None] | None = None,
    on_exit: Callable[[subprocess.Popen], None] | None = None,
) -> Outcome:
    """Run `command --out FILE` in its own process group and turn what happened into an Outcome.
    `env` adds to this process's environment (e.g. CUDA_VISIBLE_DEVICES)."""
    worker = worker or f"local:{socket.gethostname()}:{os.getpid()}"
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tula-point-") as workdir:
        out_path = Path(workdir) / "measurement.json"
        child = subprocess.Popen(
            [*command, "--out", str(out_path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **env} if env else None,
            start_new_session=True,  # own process group: a kill also reaches its data-loader workers
            preexec_fn=_die_with_parent,
        )
        if on_start:
            on_start(child)
        try:
            _, stderr = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(child.pid)
            child.communicate()
            return Outcome("failed", None, f"timed out after {timeout_s:g} s", True, time.monotonic() - started, worker)
        finally:
            if on_exit:
                on_exit(child)
        duration_s = time.monotonic() - started
        if child.returncode != 0 or not out_path.exists():
            code = child.returncode
            reason = f"exit code {code}" if code >= 0 else f"killed by signal {-code}"
            error = f"profiling process died ({reason}): {stderr[-STDERR_TAIL_CHARS:].strip()}".rstrip(": ")
            return Outcome("failed", None, error, True, duration_s, worker)
        measurement = json.loads(out_path.read_text())
    status = measurement.get("status")
    if status == "oom":
        return Outcome("oom", measurement, measurement.get("error"), False, duration_s, worker)
    if status == "failed":  # the point's own error, e.g. a model that does not build
        return Outcome("failed", measurement, measurement.get("error"), False, duration_s, worker)
    return Outcome("done", measurement, None, False, duration_s, worker)


def inferred_oom(job: Job, point: Point) -> Outcome | None:
    """A compute point whose batch is above one that already ran out of memory is not run: it would
    too. Not for a pilot (it runs micro-batches of its batch), nor from one: the pilot's memory is not
    a compute point's at the same batch."""
    if point.kind not in COMPUTE_POINT_KINDS:
        return None
    smaller = [
        p.batch_size for p in job.points
        if p.kind in COMPUTE_POINT_KINDS and p.state == "oom" and p.batch_size < point.batch_size
    ]  # fmt: skip
    if not smaller:
        return None
    reason = f"not run: batch {min(smaller)} already ran out of memory on this device"
    record = {"kind": "compute", "status": "oom", "batch_size": point.batch_size, "inferred": True, "error": reason}
    return Outcome("oom", record, reason, False, 0.0, "inferred")


def record_outcome(store: Store, point_id: int, outcome: Outcome, on_finished: Callable[[Point], None] | None = None) -> str:
    """Write an attempt's outcome (finish or retry) and move the job on. Returns what happened:
    "finished", "retried" or "dropped" (the point was no longer running: cancelled or deleted)."""
    point = store.get_point(point_id)
    if point is None or point.state != "running":
        return "dropped"
    job = store.get_job(point.job_id)
    max_attempts = JobSpec.model_validate(job.spec).profiling.max_attempts
    if outcome.worker_died and point.attempts < max_attempts:
        written = store.retry_point(point_id, f"attempt {point.attempts} on {outcome.worker}: {outcome.error}")
        return "retried" if written else "dropped"
    error = outcome.error
    if outcome.worker_died and point.attempts > 1:
        error = f"failed after {point.attempts} attempts; last: {outcome.error}"
    if not store.finish_point(point_id, outcome.state, outcome.measurement, error, outcome.duration_s):
        return "dropped"
    if on_finished:
        on_finished(store.get_point(point_id))
    advance(store, point.job_id)
    return "finished"
