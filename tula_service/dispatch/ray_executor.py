"""The Ray executor: every profiling point runs on a Ray cluster (`tula serve --executor ray
--ray-address ADDRESS`), so profiling spreads over the cluster's nodes.

One dispatcher thread in the server claims points from the store and keeps at most `slots` of them
in flight, slots = the cluster's GPUs, or its CPUs when it has none (at least 1), read from
`ray.cluster_resources()` on every round, so a cluster that grows gets more points at once:

- a compute point (grid, search) is one Ray task (`num_cpus=1`, and `num_gpus=1` when the cluster
  has GPUs: Ray sets the task's CUDA_VISIBLE_DEVICES) that runs `dispatch.run_child` on the
  worker: the same child process, timeout and record as the local executor. The command is built
  here with WORKER_PYTHON in place of the interpreter; the worker puts its own `sys.executable`
  there (its Python may live elsewhere). Ray does not retry the task (`max_retries=0`): retries are
  the store's, bounded by `profiling.max_attempts`;
- a communication point is one coordinating Ray task (no CPU of its own) that runs
  `profiler.ray_group`: a group of Ray actors, one per rank, in a placement group named here, form
  a torch.distributed process group and run `profiler.comm`'s all-reduce sweep. It takes every slot
  while it runs (its largest world size may need all of them);
- a data-parallel step point (kind "step", `profiling.step_placements`) on one node is a compute task
  whose child (`profiler.ddp_step`) starts its ranks on the task's node: `num_gpus` = its GPUs when the
  cluster has GPUs (so Ray puts it on a node with that many free), else gloo ranks on CPU; one across
  nodes is a coordinating task, as the all-reduce benchmark's, over Ray actors in a placement group with a
  bundle per node (`profiler.ray_group.measure_step_on_actors`). Either takes every slot while it runs,
  so its timing is not shared.

Ray workers never touch the database: a task returns `Outcome.to_dict()`, and the dispatcher, on
`ray.wait`, writes it with `record_outcome` (after setting the point's worker to "ray:NODE_ID").
How failures map to outcomes:

- the child crashed, timed out or came back without a record: run_child's Outcome (worker died, so
  the point is retried), exactly as locally;
- the Ray task itself died (worker crash, node lost, any `ray.exceptions.RayError`), or the actor
  group was lost (an actor died, no room for it, past its deadline): `worker_died=True`, retried;
- a task gives no result within `profiling.timeout_s` + SCHEDULING_GRACE_S (e.g. it waits for a GPU
  the cluster lost): it is cancelled and counts as a dead worker;
- cancelled points (by `cancel`, or seen no longer running in the database on the next round,
  e.g. cancelled through an API-only server): `ray.cancel(ref, force=True)` kills the worker
  process, its profiling child dies with it (PR_SET_PDEATHSIG), a comm point's actors die with
  their owner and its placement group is removed by name; `record_outcome` then drops the result.

At start, points left running by a dead server are re-queued (Ray already killed that driver's
tasks). The server never imports torch, and Ray only when this executor is chosen (`tula[ray]`).
Workers need the `tula` package with its `worker` extra on their Python path, like a local run. A
cluster with Ray's token authentication needs RAY_AUTH_MODE=token and its token (~/.ray/auth_token
or RAY_AUTH_TOKEN) in the server's environment.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tula_service import lifecycle
from tula_service.dispatch.dispatcher import (
    STDERR_TAIL_CHARS,
    Outcome,
    inferred_oom,
    point_command,
    point_timeout_s,
    record_outcome,
    run_child,
)
from tula_service.dispatch.jobs import advance, comm_command_args, step_request
from tula_service.measurement import without_nonfinite
from tula_service.store.db import Point
from tula_service.store.job_store import Store

log = logging.getLogger(__name__)

WORKER_PYTHON = "{worker_python}"  # replaced by the Ray worker's sys.executable
SCHEDULING_GRACE_S = 600.0  # beyond the point's own timeout: placement, worker start, a busy cluster
STOP_GRACE_S = 5.0
EXCLUSIVE_KINDS = ("comm", "step")  # points timed alone: an all-reduce, a data-parallel step
COORDINATOR_CPUS = 0.01  # the all-reduce coordinator task; CPU_PER_RANK in profiler.ray_group leaves room for it


def _gpus_of(point: Point) -> int:
    """GPUs a point's Ray task asks for: a one-node step point's GPUs (its ranks are the task's child
    processes), else one."""
    return point.placement[0] if point.kind == "step" and point.placement else 1


def import_ray():
    """Ray, or an error that says how to get it."""
    try:
        import ray
    except ImportError as error:
        raise RuntimeError(
            "the Ray executor needs Ray on the server and on the workers: pip install 'tula[ray]' "
            f"(ray>=2.9); importing it failed: {error}"
        ) from error
    return ray


def run_point_on_worker(command: list[str], timeout_s: float) -> dict[str, Any]:
    """Body of a compute point's Ray task (runs on a worker): the child process, as locally."""
    import ray

    if command[0] == WORKER_PYTHON:
        command = [sys.executable, *command[1:]]
    worker = f"ray:{ray.get_runtime_context().get_node_id()}"
    return run_child(command, timeout_s, worker=worker).to_dict()


def measure_comm_on_actors(comm_args: list[str], timeout_s: float, placement_group_name: str) -> dict[str, Any]:
    """Body of a communication point's Ray task: coordinates the actor group of `profiler.ray_group`."""
    from profiler.ray_group import measure_on_actors

    return _on_actors(lambda: measure_on_actors(comm_args, timeout_s, placement_group_name))


def measure_step_on_actors(request: dict[str, Any], timeout_s: float, placement_group_name: str) -> dict[str, Any]:
    """Body of a step point's Ray task when its placement spans nodes: the actor group of `profiler.ray_group`."""
    from profiler import comm, ray_group

    def measure() -> dict[str, Any]:
        try:
            return ray_group.measure_step_on_actors(request, timeout_s, placement_group_name)
        except comm.RankFailure as error:  # the step's own failure (a model that does not build): data, not retried
            return {"kind": "step", "status": "failed", "placement": request["placement"], "device_batch": request["batch_size"],
                    "error": f"RankFailure: {str(error)[-STDERR_TAIL_CHARS:]}"}  # fmt: skip

    return _on_actors(measure)


def _on_actors(measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """An actor group's record as an Outcome (dict): a lost group (an actor died, no room for it, past the
    deadline) is a died worker, retried; a record not "ok" is the point's own outcome ("oom" or "failed")."""
    import ray

    from profiler.ray_group import GroupLost

    worker = f"ray:{ray.get_runtime_context().get_node_id()}"
    started = time.monotonic()
    try:
        record = without_nonfinite(measure())
    except GroupLost as error:
        return Outcome("failed", None, f"Ray actor group lost: {error}", True, time.monotonic() - started, worker).to_dict()
    duration_s = time.monotonic() - started
    if record["status"] == "oom":
        return Outcome("oom", record, record.get("error"), False, duration_s, worker).to_dict()
    if record["status"] != "ok":  # e.g. the group did not form: the point's own error, not retried
        return Outcome("failed", record, record.get("error"), False, duration_s, worker).to_dict()
    return Outcome("done", record, None, False, duration_s, worker).to_dict()


@dataclass
class _Flight:
    """A point whose Ray task is in flight."""

    point_id: int
    kind: str
    started: float  # time.monotonic() at submission
    deadline: float
    placement_group_name: str | None = None
    stop_reason: str | None = None  # set when we cancelled it


class RayExecutor:
    def __init__(
        self,
        store: Store,
        address: str | None,
        poll_s: float = 1.0,
        on_finished: Callable[[Point], None] | None = None,
        python: str | None = None,
    ):
        """`address`: the cluster (`ray.init(address=...)`; None: Ray's own default, an existing
        local cluster or a new one). `python`: the workers' interpreter, default theirs."""
        self._ray = import_ray()
        self.store = store
        self.address = address
        self.poll_s = poll_s
        self.on_finished = on_finished
        self.python = python or WORKER_PYTHON
        self.worker_name = f"ray:{socket.gethostname()}:{os.getpid()}"  # until a task says its node
        self.workers = 0  # slots, known once connected
        self._owns_ray = False
        self._flights: dict[Any, _Flight] = {}  # ObjectRef -> flight
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._compute_task = None
        self._comm_task = None
        self._step_task = None

    def start(self) -> None:
        interrupted = self.store.requeue_interrupted()
        if interrupted:
            log.info("re-queued %d points left running by a previous server", len(interrupted))
        for job_id in self.store.jobs_awaiting_fit():
            advance(self.store, job_id)
        ray = self._ray
        if not ray.is_initialized():
            try:
                ray.init(address=self.address)
            except ConnectionError as error:
                raise RuntimeError(f"cannot connect to the Ray cluster at {self.address or '(default)'}: {error}") from error
            self._owns_ray = True
        self._compute_task = ray.remote(num_cpus=1, max_retries=0)(run_point_on_worker)
        # A sliver of CPU, so the coordinator (which imports torch) never lands on a 0-CPU node such
        # as the API server's own Ray node in docker/compose.yaml.
        self._comm_task = ray.remote(num_cpus=COORDINATOR_CPUS, max_retries=0)(measure_comm_on_actors)
        self._step_task = ray.remote(num_cpus=COORDINATOR_CPUS, max_retries=0)(measure_step_on_actors)
        self.workers = self._slots()[0]
        log.info("Ray executor: cluster %s, %s", self.address or "(default)", ray.cluster_resources())
        self._thread = threading.Thread(target=self._loop, name="tula-ray-dispatch", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._ray.is_initialized()

    def notify(self) -> None:
        """A job was submitted: stop waiting and look at the queue."""
        self._wake.set()

    def cancel(self, points: list[Point]) -> None:
        """Stop the Ray tasks (and actor groups) of these (already cancelled) points."""
        point_ids = {point.id for point in points}
        with self._lock:
            for ref, flight in self._flights.items():
                if flight.point_id in point_ids:
                    self._stop_flight(ref, flight, "cancelled")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop dispatching and kill what is in flight; those points stay "running" and are
        re-queued at the next start (as with the local executor)."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if not self._ray.is_initialized():
            return
        with self._lock:
            flights = dict(self._flights)
            for ref, flight in flights.items():
                self._stop_flight(ref, flight, "executor stopped")
        if flights:  # the tasks are dead once their refs resolve; then no placement group can appear
            self._ray.wait(list(flights), num_returns=len(flights), timeout=min(timeout_s, STOP_GRACE_S))
            for flight in flights.values():
                self._remove_placement_group(flight.placement_group_name)
        if self._owns_ray:
            self._ray.shutdown()

    # --- the dispatcher thread ------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self._launch_while_free()
                with self._lock:
                    refs = list(self._flights)
                if not refs:
                    self._wake.wait(self.poll_s)
                    self._wake.clear()
                    continue
                ready, _ = self._ray.wait(refs, num_returns=1, timeout=self.poll_s)
                if ready:  # collect everything that is done by now, not only the first
                    ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
                for ref in ready:
                    self._finish(ref)
                self._stop_overdue_and_cancelled()
            except Exception:  # noqa: BLE001 - a database or cluster hiccup must not end dispatching
                log.exception("Ray dispatch round failed; retrying")
                self._stopping.wait(self.poll_s)

    def _slots(self) -> tuple[int, int]:
        """(slots, GPUs): points the cluster runs at once, one per GPU, else one per CPU."""
        resources = self._ray.cluster_resources()
        gpus = int(resources.get("GPU", 0))
        return max(1, gpus or int(resources.get("CPU", 0))), gpus

    def _launch_while_free(self) -> None:
        slots, gpus = self._slots()
        self.workers = slots
        while not self._stopping.is_set():
            with self._lock:
                busy = slots if any(f.kind in EXCLUSIVE_KINDS for f in self._flights.values()) else len(self._flights)
            if busy >= slots:
                return
            point = self.store.claim_next_point(self.worker_name)
            if point is None:
                return
            try:
                self._launch(point, gpus)
            except Exception as error:  # noqa: BLE001 - e.g. the cluster refused the task
                log.exception("submitting point %s to Ray failed", point.id)
                reason = f"submitting the Ray task failed: {type(error).__name__}: {error}"
                outcome = Outcome("failed", None, reason, True, 0.0, self.worker_name)
                record_outcome(self.store, point.id, outcome, self.on_finished)

    def _launch(self, point: Point, gpus: int) -> None:
        job = self.store.get_job(point.job_id)
        outcome = inferred_oom(job, point)
        if outcome is not None:
            record_outcome(self.store, point.id, outcome, self.on_finished)
            return
        timeout_s = point_timeout_s(job)
        placement_group_name = None
        if point.kind == "comm":
            placement_group_name = f"tula-comm-{point.id}-{uuid.uuid4().hex[:12]}"
            ref = self._comm_task.remote(comm_command_args(job), timeout_s, placement_group_name)
        elif point.kind == "step" and len(point.placement or []) > 1:
            placement_group_name = f"tula-step-{point.id}-{uuid.uuid4().hex[:12]}"
            ref = self._step_task.remote(step_request(job.parsed_spec, point.placement, point.batch_size), timeout_s, placement_group_name)
        else:
            task = self._compute_task.options(num_gpus=_gpus_of(point)) if gpus else self._compute_task
            ref = task.remote(point_command(self.python, job, point), timeout_s)
        started = time.monotonic()
        deadline = started + timeout_s + SCHEDULING_GRACE_S
        with self._lock:
            self._flights[ref] = _Flight(point.id, point.kind, started, deadline, placement_group_name)
        lifecycle.point_started(point, self.worker_name, None, "ray")

    def _finish(self, ref) -> None:
        with self._lock:
            flight = self._flights.pop(ref, None)
        if flight is None:
            return
        duration_s = time.monotonic() - flight.started
        try:
            outcome = Outcome.from_dict(self._ray.get(ref))
        except self._ray.exceptions.TaskCancelledError:
            reason = f"Ray task stopped: {flight.stop_reason or 'cancelled'}"
            outcome = Outcome("failed", None, reason, True, duration_s, self.worker_name)
        except self._ray.exceptions.RayError as error:  # worker crashed, node lost, task raised
            reason = f"Ray task died ({type(error).__name__}): {str(error)[-STDERR_TAIL_CHARS:].strip()}"
            outcome = Outcome("failed", None, reason, True, duration_s, self.worker_name)
        self._remove_placement_group(flight.placement_group_name)
        if self._stopping.is_set() and outcome.worker_died:
            return  # killed by our own shutdown: left "running", re-queued at the next start
        if outcome.worker.startswith("ray:"):
            self.store.set_point_worker(flight.point_id, outcome.worker)
        record_outcome(self.store, flight.point_id, outcome, self.on_finished)

    def _stop_overdue_and_cancelled(self) -> None:
        """Cancel tasks past their deadline, and those of points no longer running in the
        database (cancelled or deleted, possibly through another server process)."""
        with self._lock:
            flights = [(ref, flight) for ref, flight in self._flights.items() if flight.stop_reason is None]
        now = time.monotonic()
        for ref, flight in flights:
            if now > flight.deadline:
                limit_s = flight.deadline - flight.started
                with self._lock:
                    self._stop_flight(ref, flight, f"no result from Ray within {limit_s:g} s (timeout + scheduling grace)")
                continue
            point = self.store.get_point(flight.point_id)
            if point is None or point.state != "running":
                with self._lock:
                    self._stop_flight(ref, flight, "cancelled")

    def _stop_flight(self, ref, flight: _Flight, reason: str) -> None:
        """Under self._lock. Force-cancel kills the worker process (and with it the child, or the
        coordinator and so its actors); the ref then resolves with TaskCancelledError."""
        if flight.stop_reason is not None:
            return
        flight.stop_reason = reason
        try:
            self._ray.cancel(ref, force=True)
        except Exception:  # noqa: BLE001 - already finished
            log.debug("cancelling the Ray task of point %s failed", flight.point_id, exc_info=True)

    def _remove_placement_group(self, name: str | None) -> None:
        """The comm point's placement group (normally removed by its coordinator; not when that
        was killed). Removing it also kills any actor still in it."""
        if not name:
            return
        from ray.util import get_placement_group, remove_placement_group

        try:
            remove_placement_group(get_placement_group(name))
        except Exception:  # noqa: BLE001 - not there: already removed, or never created
            pass
