"""Running one profiling point, shared by every executor.

An executor claims a point from the store, builds its command (`point_command`), runs it in a child
process somewhere and hands the `Outcome` to `record_outcome`. Two ways to run the child, with the
same Outcome:

- `run_child` (cold): a fresh `python -m profiler.run_point ...`; the Ray executor's tasks, and the
  local executor's fallback;
- `WarmWorker.run`: the same module and arguments in a child forked from a warm worker process
  (`profiler.warm_worker`) that imported torch once; the local executor's default. The child is
  still a process group of its own, killable and timed out alike; a warm worker that dies takes its
  child with it, and that attempt counts as a died worker (the next point restarts it).

`record_outcome` decides:

- a record came back (status ok / oom / failed): the point is finished with it. A "failed" record is
  the point's own error (it would fail again), so it is not retried;
- the worker died (killed by a signal, timed out, exited without a record): the point goes back to
  the queue until it has been started `profiling.max_attempts` times, then it is failed with the
  reason of every attempt;
- the job was cancelled meanwhile: nothing is written (the cancel already marked the point).

Nothing here imports torch; the children (`profiler.run_point`, `profiler.comm`) and the warm worker do.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tula_service import lifecycle
from tula_service.dispatch.jobs import COMPUTE_POINT_KINDS, advance, comm_command_args, pilot_request, point_request, step_request
from tula_service.measurement import parse_measurement, without_nonfinite
from tula_service.store.db import Job, Point
from tula_service.store.job_store import Store

STDERR_TAIL_CHARS = 2000
PR_SET_PDEATHSIG = 1  # linux/prctl.h
WARM_WORKER_MODULE = "profiler.warm_worker"
WARM_READY_TIMEOUT_S = 180.0  # importing torch on a busy host
WARM_KILL_GRACE_S = 10.0  # a killed child's exit report; past it the warm worker is stuck and stopped


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
    spec = job.parsed_spec
    if point.kind == "pilot":
        request = pilot_request(spec)
    elif point.kind == "step":
        request = step_request(spec, point.placement, point.batch_size)
    else:
        request = point_request(spec, point.batch_size)
    return [python, "-m", "profiler.run_point", "--request", json.dumps(request)]


def point_timeout_s(job: Job) -> float:
    return job.parsed_spec.profiling.timeout_s


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
    on_start: Callable[[int], None] | None = None,
    on_exit: Callable[[int], None] | None = None,
) -> Outcome:
    """Run `command --out FILE` in its own process group and turn what happened into an Outcome.
    `env` adds to this process's environment (e.g. CUDA_VISIBLE_DEVICES); `on_start` and `on_exit`
    get the child's pid."""
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
            on_start(child.pid)
        try:
            _, stderr = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(child.pid)
            child.communicate()
            return Outcome("failed", None, f"timed out after {timeout_s:g} s", True, time.monotonic() - started, worker)
        finally:
            if on_exit:
                on_exit(child.pid)
        return _outcome_of_exit(child.returncode, stderr, out_path, time.monotonic() - started, worker)


def _outcome_of_exit(returncode: int, stderr: str, out_path: Path, duration_s: float, worker: str) -> Outcome:
    """A child's exit as an Outcome: its record when it wrote one (exit code 0), else a died worker."""
    if returncode != 0 or not out_path.exists():
        reason = f"exit code {returncode}" if returncode >= 0 else f"killed by signal {-returncode}"
        error = f"profiling process died ({reason}): {stderr[-STDERR_TAIL_CHARS:].strip()}".rstrip(": ")
        return Outcome("failed", None, error, True, duration_s, worker)
    record = without_nonfinite(json.loads(out_path.read_text()))  # stored as it came, NaN and inf as None
    try:
        measurement = parse_measurement(record)
    except ValueError as error:  # pydantic's ValidationError is one: the record names no batch, a kind, ...
        error_text = f"the profiler's record breaks the measurement contract (tula_service.measurement): {error}"
        return Outcome("failed", record, error_text, False, duration_s, worker)
    if measurement.status == "oom":
        return Outcome("oom", record, measurement.error, False, duration_s, worker)
    if measurement.status == "failed":  # the point's own error, e.g. a model that does not build
        return Outcome("failed", record, measurement.error, False, duration_s, worker)
    return Outcome("done", record, None, False, duration_s, worker)


class WarmWorkerUnavailable(RuntimeError):
    """The warm worker did not come up (no fork here, torch missing, a crash at import)."""


class WarmWorkerDied(RuntimeError):
    """The warm worker's pipe closed: it exited or was killed."""


class WarmWorker:
    """The server's side of one `profiler.warm_worker` process (protocol in its docstring).

    `start()` must run in the thread that will use it: the warm worker gets SIGKILL when that thread
    ends (PR_SET_PDEATHSIG), and its children when it does, so nothing outlives a killed server.
    `run()` runs one point at a time and returns the same Outcome as `run_child`.
    """

    def __init__(self, python: str, env: dict[str, str] | None = None, ready_timeout_s: float = WARM_READY_TIMEOUT_S):
        self.python = python
        self.env = env
        self.ready_timeout_s = ready_timeout_s
        self.preload_s: float | None = None
        self._process: subprocess.Popen | None = None
        self._stderr = None
        self._buffer = b""

    @staticmethod
    def available() -> bool:
        return hasattr(os, "fork") and _PRCTL is not None

    @property
    def pid(self) -> int | None:
        process = self._process  # read once: another thread may stop it meanwhile
        return process.pid if process else None

    def alive(self) -> bool:
        process = self._process
        return process is not None and process.poll() is None

    def start(self) -> None:
        """Start the warm worker and wait until it has imported torch; raises WarmWorkerUnavailable."""
        self.stop()
        self._stderr = tempfile.TemporaryFile(prefix="tula-warm-worker-")
        self._buffer = b""
        self._process = subprocess.Popen(
            [self.python, "-m", WARM_WORKER_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            bufsize=0,
            env={**os.environ, **self.env} if self.env else None,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        try:
            message = self._read(time.monotonic() + self.ready_timeout_s)
        except WarmWorkerDied:
            message = {"died": self._death_reason()}
        if not message or not message.get("ready"):
            reason = message.get("died", f"said {message}") if message else f"not ready after {self.ready_timeout_s:g} s"
            self.stop()
            raise WarmWorkerUnavailable(f"the warm worker did not start ({reason})")
        self.preload_s = message.get("preload_s")

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            kill_group(self._process.pid)
            self._process.wait()
        for stream in (self._process.stdin, self._process.stdout) if self._process else ():
            stream.close()
        if self._stderr is not None:
            self._stderr.close()
        self._process = self._stderr = None

    def run(
        self,
        command: list[str],
        timeout_s: float,
        *,
        worker: str,
        on_start: Callable[[int], None] | None = None,
        on_exit: Callable[[int], None] | None = None,
    ) -> Outcome:
        """Run a point's command (`python -m MODULE ARGS`, as `point_command` builds it) in a forked child."""
        module, args = _module_and_args(command)
        started = time.monotonic()
        child_pid = None
        with tempfile.TemporaryDirectory(prefix="tula-point-") as workdir:
            out_path, err_path = Path(workdir) / "measurement.json", Path(workdir) / "stderr.txt"
            try:
                self._send({"module": module, "argv": [*args, "--out", str(out_path)], "stderr": str(err_path)})
                message = self._read(started + timeout_s)
                if message is not None and "refused" in message:
                    raise WarmWorkerUnavailable(message["refused"])
                if message is None or "started" not in message:
                    raise WarmWorkerDied("no child started")
                child_pid = int(message["started"])
                if on_start:
                    on_start(child_pid)
                try:
                    message = self._read(started + timeout_s)
                    if message is None:  # past the timeout: kill the child, wait for the worker's report
                        kill_group(child_pid)
                        if self._read(time.monotonic() + WARM_KILL_GRACE_S) is None:
                            self.stop()
                        duration_s = time.monotonic() - started
                        return Outcome("failed", None, f"timed out after {timeout_s:g} s", True, duration_s, worker)
                    if message.get("exited") != child_pid:
                        raise WarmWorkerDied(f"said {message} for child {child_pid}")
                finally:
                    if on_exit:
                        on_exit(child_pid)
            except (WarmWorkerDied, OSError) as error:
                if child_pid is not None:
                    kill_group(child_pid)
                reason = self._death_reason()
                self.stop()
                detail = f"{error}; " if str(error) else ""
                error_text = f"warm worker died ({detail}{reason}) while running the point"
                return Outcome("failed", None, error_text, True, time.monotonic() - started, worker)
            except BaseException:  # e.g. on_start's database write failed: leave nothing running
                if child_pid is not None:
                    kill_group(child_pid)
                self.stop()
                raise
            stderr = err_path.read_text(errors="replace") if err_path.exists() else ""
            return _outcome_of_exit(int(message["returncode"]), stderr, out_path, time.monotonic() - started, worker)

    def _send(self, message: dict) -> None:
        if not self.alive():
            raise WarmWorkerDied("not running")
        self._process.stdin.write((json.dumps(message) + "\n").encode())

    def _read(self, deadline: float) -> dict | None:
        """The next message, or None at the deadline; raises WarmWorkerDied when the pipe closes."""
        stdout = self._process.stdout
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left_s = deadline - time.monotonic()
                if left_s <= 0 or not selector.select(left_s):
                    return None
                chunk = os.read(stdout.fileno(), 65536)
                if not chunk:
                    raise WarmWorkerDied()
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            return json.loads(line)
        except ValueError:
            raise WarmWorkerDied(f"unreadable message {line[:200]!r}") from None

    def _death_reason(self) -> str:
        """How the warm worker ended, with the tail of its stderr."""
        if self._process is None:
            return "not running"
        try:
            code = self._process.wait(WARM_KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            return "unresponsive"
        reason = f"exit code {code}" if code >= 0 else f"killed by signal {-code}"
        self._stderr.seek(0)
        tail = self._stderr.read().decode(errors="replace")[-STDERR_TAIL_CHARS:].strip()
        return f"{reason}: {tail}" if tail else reason


def _module_and_args(command: list[str]) -> tuple[str, list[str]]:
    """`[python, "-m", MODULE, *ARGS]` -> (MODULE, ARGS)."""
    if len(command) < 3 or command[1] != "-m":
        raise ValueError(f"a warm worker runs `python -m MODULE ...` commands; got {command[:3]}")
    return command[2], command[3:]


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
    max_attempts = job.parsed_spec.profiling.max_attempts
    if outcome.worker_died and point.attempts < max_attempts:
        written = store.retry_point(point_id, f"attempt {point.attempts} on {outcome.worker}: {outcome.error}")
        if written:
            lifecycle.point_retried(point, outcome.duration_s, outcome.error)
        return "retried" if written else "dropped"
    error = outcome.error
    if outcome.worker_died and point.attempts > 1:
        error = f"failed after {point.attempts} attempts; last: {outcome.error}"
    if not store.finish_point(point_id, outcome.state, outcome.measurement, error, outcome.duration_s):
        return "dropped"
    lifecycle.point_finished(point, outcome.state, outcome.duration_s, error)
    if on_finished:
        on_finished(store.get_point(point_id))
    advance(store, point.job_id)
    return "finished"
