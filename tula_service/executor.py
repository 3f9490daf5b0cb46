"""The local executor: worker threads that run each profiling point in its own child process.

A child that crashes, runs out of memory or overruns its timeout costs that point only; the
server and the other points go on. Points left running by a dead server are re-queued at start.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tula_service.jobs import advance, comm_command_args, point_request
from tula_service.db import Job, Point
from tula_service.spec import JobSpec
from tula_service.store import Store

log = logging.getLogger(__name__)

STDERR_TAIL_CHARS = 2000


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _smaller_out_of_memory(job: Job, point: Point) -> int | None:
    """A smaller batch of the same job that went out of memory: this one would too."""
    if point.kind == "comm":
        return None
    smaller = [p.batch_size for p in job.points if p.state == "oom" and p.batch_size < point.batch_size]
    return min(smaller) if smaller else None


class LocalExecutor:
    def __init__(self, store: Store, workers: int = 1, python: str = sys.executable, poll_s: float = 1.0):
        self.store = store
        self.workers = workers
        self.python = python
        self.poll_s = poll_s
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._children: set[subprocess.Popen] = set()
        self._children_lock = threading.Lock()

    def start(self) -> None:
        requeued = self.store.requeue_interrupted()
        if requeued:
            log.info("re-queued %d points left running by a previous server", requeued)
        for job_id in self.store.jobs_awaiting_fit():
            advance(self.store, job_id)
        for index in range(self.workers):
            thread = threading.Thread(target=self._loop, name=f"tula-worker-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def notify(self) -> None:
        """A job was submitted: stop waiting and look at the queue."""
        self._wake.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        with self._children_lock:
            for child in self._children:
                _kill_group(child)
        for thread in self._threads:
            thread.join(timeout_s)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            point = self.store.claim_next_point()
            if point is None:
                self._wake.wait(self.poll_s)
                self._wake.clear()
                continue
            self._run_point(point)
            advance(self.store, point.job_id)

    def _command(self, point: Point, job: Job) -> list[str]:
        if point.kind == "comm":
            return [self.python, "-m", "profiler.comm", *comm_command_args(job)]
        request = point_request(JobSpec.model_validate(job.spec), point.batch_size)
        return [self.python, "-m", "profiler.run_point", "--request", json.dumps(request)]

    def _run_point(self, point: Point) -> None:
        job = self.store.get_job(point.job_id)
        smaller_oom = _smaller_out_of_memory(job, point)
        if smaller_oom is not None:
            reason = f"not run: batch {smaller_oom} already ran out of memory on this device"
            record = {"kind": "compute", "status": "oom", "batch_size": point.batch_size, "inferred": True, "error": reason}
            self.store.finish_point(point.id, "oom", record, reason, 0.0)
            return
        timeout_s = JobSpec.model_validate(job.spec).profiling.timeout_s
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="tula-point-") as workdir:
            out_path = Path(workdir) / "measurement.json"
            command = [*self._command(point, job), "--out", str(out_path)]
            state, measurement, error = self._run_child(command, out_path, timeout_s)
        if self._stopping.is_set() and state == "failed":
            return  # interrupted by shutdown: left "running", re-queued at the next start
        self.store.finish_point(point.id, state, measurement, error, time.monotonic() - started)

    def _run_child(self, command: list[str], out_path: Path, timeout_s: float) -> tuple[str, dict | None, str | None]:
        # Own process group, so a kill also reaches anything the child started (data loader workers).
        child = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        with self._children_lock:
            self._children.add(child)
        try:
            _, stderr = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(child)
            child.communicate()
            return "failed", None, f"timed out after {timeout_s:g} s"
        finally:
            with self._children_lock:
                self._children.discard(child)
        if child.returncode != 0 or not out_path.exists():
            reason = f"exit code {child.returncode}" if child.returncode >= 0 else f"killed by signal {-child.returncode}"
            return "failed", None, f"profiling process failed ({reason}): {stderr[-STDERR_TAIL_CHARS:].strip()}"
        measurement = json.loads(out_path.read_text())
        if measurement.get("status") == "oom":
            return "oom", measurement, measurement.get("error")
        if measurement.get("status") == "failed":  # e.g. a communication group that could not form
            return "failed", measurement, measurement.get("error")
        return "done", measurement, None
