"""The local executor: one worker thread per device, each running one profiling point at a time in
a child process of its own.

The pool is sized to the local GPUs (one worker per device, pinned with CUDA_VISIBLE_DEVICES), so on
a GPU host points run in parallel, one per GPU. A host without GPUs gets one worker: points there
share the CPU cores, so two points at once would slow each other down and both their timings would
be wrong (and the step-time model fitted to them); `workers` can raise it, at that cost.

Each worker keeps a warm worker process (`profiler.warm_worker`, through `dispatch.WarmWorker`) that
imported torch once and forks a child per point; the child runs exactly what
`python -m profiler.run_point` runs, in its own process group. Without fork (or with warm=False,
or when the warm worker cannot start) a worker runs the cold command itself (`dispatch.run_child`).
Either way a child that crashes, runs out of memory or overruns its timeout costs that attempt only;
a warm worker that dies (kill -9) takes its child with it, the attempt counts as a died worker (the
point is retried) and the next point starts a fresh warm worker. At start, points left running by a
dead server are re-queued (and their orphaned children, if any survived, are killed).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from tula_service import lifecycle
from tula_service.dispatch.dispatcher import (
    Outcome,
    WarmWorker,
    WarmWorkerUnavailable,
    inferred_oom,
    kill_group,
    point_command,
    point_timeout_s,
    record_outcome,
    run_child,
)
from tula_service.dispatch.jobs import advance
from tula_service.store.db import Point
from tula_service.store.job_store import Store

log = logging.getLogger(__name__)

PROFILER_MODULES = (b"profiler.run_point", b"profiler.comm", b"profiler.warm_worker")


def local_gpu_count() -> int:
    """GPUs NVML sees on this host (0 without the NVIDIA driver or nvidia-ml-py)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no library: a CPU host
        return 0


def reap_orphan(point: Point, host: str = socket.gethostname()) -> bool:
    """Kill the child a dead server left behind for `point`, when it is still a profiler process on
    this host (checked in /proc, so a recycled pid is never killed)."""
    if not point.worker_pid or not (point.worker or "").startswith(f"local:{host}:"):
        return False
    try:
        cmdline = Path(f"/proc/{point.worker_pid}/cmdline").read_bytes()
    except OSError:
        return False
    if not any(module in cmdline for module in PROFILER_MODULES):
        return False
    kill_group(point.worker_pid)
    return True


class LocalExecutor:
    def __init__(
        self,
        store: Store,
        workers: int | None = None,
        python: str = sys.executable,
        poll_s: float = 1.0,
        on_finished: Callable[[Point], None] | None = None,
        warm: bool = True,
    ):
        """`warm`: run points in children forked from a warm worker (where fork exists); False runs
        every point as a fresh `python -m profiler.run_point`."""
        gpus = local_gpu_count()
        self.store = store
        self.workers = workers or max(1, gpus)
        self.gpus = gpus
        self.python = python
        self.poll_s = poll_s
        self.on_finished = on_finished
        self.warm = warm and WarmWorker.available()
        self.worker_name = f"local:{socket.gethostname()}:{os.getpid()}"
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._children: dict[int, int] = {}  # point id -> pid of its running child (its process group)
        self._children_lock = threading.Lock()
        self._warm_workers: dict[int, WarmWorker] = {}  # worker index -> its warm worker
        self._cold_only: set[int] = set()  # worker indexes whose warm worker could not start

    def start(self) -> None:
        interrupted = self.store.requeue_interrupted()
        if interrupted:
            reaped = sum(reap_orphan(p) for p in interrupted)
            log.info("re-queued %d points left running by a previous server (%d orphans killed)", len(interrupted), reaped)
        for job_id in self.store.jobs_awaiting_fit():
            advance(self.store, job_id)
        for index in range(self.workers):
            thread = threading.Thread(target=self._loop, args=(index,), name=f"tula-worker-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)
        watchdog = threading.Thread(target=self._watch_cancellations, name="tula-cancel-watch", daemon=True)
        watchdog.start()
        self._threads.append(watchdog)

    def alive(self) -> bool:
        return bool(self._threads) and all(t.is_alive() for t in self._threads)

    def notify(self) -> None:
        """A job was submitted: stop waiting and look at the queue."""
        self._wake.set()

    def warm_worker_pids(self) -> dict[int, int]:
        """Worker index -> pid of its warm worker, for those running."""
        return {index: warm.pid for index, warm in list(self._warm_workers.items()) if warm.alive()}

    def cancel(self, points: list[Point]) -> None:
        """Stop the children of these (already cancelled) points."""
        with self._children_lock:
            for point in points:
                child_pid = self._children.get(point.id)
                if child_pid is not None:
                    kill_group(child_pid)
                else:
                    reap_orphan(point)
        for job_id in dict.fromkeys(p.job_id for p in points):
            lifecycle.job_cancelled(job_id, sum(p.job_id == job_id for p in points))

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        with self._children_lock:
            for child_pid in self._children.values():
                kill_group(child_pid)
        for warm in list(self._warm_workers.values()):
            if warm.pid:
                kill_group(warm.pid)  # its thread sees the pipe close and stops it
        for thread in self._threads:
            thread.join(timeout_s)

    def _watch_cancellations(self) -> None:
        """Kill the children of points that are no longer running in the database: cancelled or
        deleted, possibly through another server process on the same database."""
        while not self._stopping.wait(self.poll_s):
            with self._children_lock:
                point_ids = list(self._children)
            for point_id in point_ids:
                try:
                    point = self.store.get_point(point_id)
                except Exception:  # noqa: BLE001 - a database hiccup: look again next time
                    log.exception("checking point %s failed", point_id)
                    continue
                if point is None or point.state != "running":
                    with self._children_lock:
                        child_pid = self._children.get(point_id)
                        if child_pid is not None:
                            kill_group(child_pid)

    def _loop(self, index: int) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    point = self.store.claim_next_point(self.worker_name)
                except Exception:  # noqa: BLE001 - a database hiccup must not end the worker
                    log.exception("claiming a point failed; retrying")
                    self._stopping.wait(self.poll_s)
                    continue
                if point is None:
                    self._wake.wait(self.poll_s)
                    self._wake.clear()
                    continue
                try:
                    self._run_point(point, index)
                except Exception:  # noqa: BLE001
                    log.exception("running point %s failed", point.id)
                    outcome = Outcome("failed", None, "executor error (see server log)", True, 0.0, self.worker_name)
                    record_outcome(self.store, point.id, outcome)
        finally:
            warm = self._warm_workers.pop(index, None)
            if warm is not None:
                warm.stop()

    def _env(self, index: int) -> dict[str, str] | None:
        return {"CUDA_VISIBLE_DEVICES": str(index)} if self.gpus else None

    def _warm_worker(self, index: int) -> WarmWorker | None:
        """This worker's warm worker, started at its first point (or restarted after it died) in this
        thread; None when it cannot start: then the worker runs points cold from now on. Started
        lazily, a server that profiles nothing never imports torch; each warm worker holds torch in
        memory (a few hundred MB) while it lives."""
        warm = self._warm_workers.get(index)
        if warm is not None and warm.alive():
            return warm
        if self._stopping.is_set() or index in self._cold_only:
            return None
        warm = self._warm_workers[index] = warm or WarmWorker(self.python, env=self._env(index))
        try:
            warm.start()
        except WarmWorkerUnavailable as error:
            log.warning("worker %d: %s; running points as fresh processes instead", index, error)
            self._cold_only.add(index)
            return None
        lifecycle.emit("warm_worker_started", worker_index=index, pid=warm.pid, preload_s=warm.preload_s)
        return warm

    def _run_point(self, point: Point, index: int) -> None:
        job = self.store.get_job(point.job_id)
        outcome = inferred_oom(job, point)
        if outcome is None:
            warm = self._warm_worker(index) if self.warm else None

            def started(child_pid: int) -> None:
                with self._children_lock:
                    self._children[point.id] = child_pid
                self.store.set_point_worker(point.id, self.worker_name, child_pid)
                lifecycle.point_started(point, self.worker_name, child_pid, "warm" if warm else "cold")

            def exited(_child_pid: int) -> None:
                with self._children_lock:
                    self._children.pop(point.id, None)

            command, timeout_s = point_command(self.python, job, point), point_timeout_s(job)
            hooks = {"worker": self.worker_name, "on_start": started, "on_exit": exited}
            try:
                outcome = warm.run(command, timeout_s, **hooks) if warm else None
            except WarmWorkerUnavailable as error:
                log.warning("point %s: %s; running it as a fresh process", point.id, error)
                warm = None
            if outcome is None:
                outcome = run_child(command, timeout_s, env=self._env(index), **hooks)
        if self._stopping.is_set() and outcome.worker_died:
            return  # killed by our own shutdown: left "running", re-queued at the next start
        record_outcome(self.store, point.id, outcome, self.on_finished)


class NoExecutor:
    """`--executor none`: an API-only server. It stores jobs and serves them; another server
    process on the same database (with `--executor local` or `ray`) runs their points."""

    workers = 0

    def start(self) -> None:
        pass

    def alive(self) -> bool:
        return True

    def notify(self) -> None:
        pass

    def cancel(self, points: list[Point]) -> None:
        """The dispatching server sees the cancelled state and stops the children itself."""

    def stop(self, timeout_s: float = 10.0) -> None:
        pass
