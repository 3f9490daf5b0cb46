"""Points forked from the warm worker keep the cold path's guarantees: a killed child or a killed warm
worker costs an attempt and the job still finishes; cancelling and timeouts kill the point's child,
not the warm worker; without a warm worker the points run cold. Real processes, real signals."""

import logging
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import pytest

from tests.processes import (
    children_of,
    fake_python,
    gone,
    parent_of,
    run_until_finished,
    running_child,
    started,
    submit,
    wait_for,
    wait_for_job,
)
from tula_service.dispatch.executor import LocalExecutor
from tula_service.store.job_store import Store

FAST_PROFILING = {"time_cap_s": 1.0, "timed_iters": 2, "warmup_iters": 1, "grad_iters": 2}
LONG_PROFILING = {"time_cap_s": 120.0, "timed_iters": 100_000, "target_cv": 1e-9}  # runs until killed


@pytest.fixture
def lifecycle_lines(caplog):
    caplog.set_level(logging.INFO, logger="tula.lifecycle")
    return lambda event: [r.getMessage() for r in caplog.records if r.name == "tula.lifecycle" and f"event={event} " in r.getMessage()]


class RunningPoint(NamedTuple):
    job_id: str
    executor: LocalExecutor
    point_id: int
    child_pid: int
    warm_pid: int  # the child's parent


@contextmanager
def _a_point_running_warm(store: Store, profiling: dict) -> Iterator[RunningPoint]:
    """A job of two points on a started executor, once its first point's child runs; the executor is
    stopped afterwards."""
    job = submit(store, batch_sizes=[8, 16], profiling=profiling)
    with started(LocalExecutor(store, poll_s=0.05)) as executor:
        point_id, child_pid = running_child(store, job.id)
        yield RunningPoint(job.id, executor, point_id, child_pid, parent_of(child_pid))


def test_points_run_in_children_of_one_warm_worker(store, lifecycle_lines):
    job = submit(store, batch_sizes=[8, 16], profiling=FAST_PROFILING)
    with started(LocalExecutor(store, poll_s=0.05)) as executor:
        [warm_pid] = wait_for(executor.warm_worker_pids, 120, "the warm worker").values()
        finished = wait_for_job(store, job.id)
    assert finished.state == "done", finished.error
    assert all(p.state == "done" and p.attempts == 1 for p in finished.points)
    point_lines = lifecycle_lines("point_started")
    assert len(point_lines) == len(finished.points) and all("path=warm" in line for line in point_lines)
    assert len(lifecycle_lines("warm_worker_started")) == 1
    assert f"pid={warm_pid} " not in " ".join(point_lines)  # each point is a child of its own
    assert gone(warm_pid)  # stopping the executor stops its warm worker


def test_a_killed_point_child_is_retried_and_the_warm_worker_keeps_serving(store, lifecycle_lines):
    with _a_point_running_warm(store, {**FAST_PROFILING, "time_cap_s": 3.0}) as running:
        os.kill(running.child_pid, signal.SIGKILL)
        finished = wait_for_job(store, running.job_id)
        assert running.executor.warm_worker_pids() == {0: running.warm_pid}
    assert finished.state == "done", finished.error
    killed = next(p for p in finished.points if p.id == running.point_id)
    assert killed.state == "done" and killed.attempts == 2
    assert "profiling process died (killed by signal 9)" in killed.attempt_errors[0]
    [retried] = lifecycle_lines("point_retried")
    assert f"point={running.point_id} " in retried and "killed by signal 9" in retried
    assert len(lifecycle_lines("warm_worker_started")) == 1


def test_a_killed_warm_worker_is_restarted_and_its_point_retried(store, lifecycle_lines):
    with _a_point_running_warm(store, {**FAST_PROFILING, "time_cap_s": 3.0}) as running:
        os.kill(running.warm_pid, signal.SIGKILL)
        wait_for(lambda: gone(running.child_pid), 10, "the point's child to die with its warm worker")
        finished = wait_for_job(store, running.job_id)
        [new_warm_pid] = running.executor.warm_worker_pids().values()
    assert finished.state == "done", finished.error
    killed = next(p for p in finished.points if p.id == running.point_id)
    assert killed.state == "done" and killed.attempts == 2
    assert "warm worker died (killed by signal 9)" in killed.attempt_errors[0]
    assert new_warm_pid != running.warm_pid and len(lifecycle_lines("warm_worker_started")) == 2
    assert finished.recommendation["profiled"]["failed"] == []


def test_cancelling_a_job_kills_its_running_point_but_not_the_warm_worker(store, lifecycle_lines):
    with _a_point_running_warm(store, LONG_PROFILING) as running:
        running.executor.cancel(store.cancel_job(running.job_id))
        wait_for(lambda: gone(running.child_pid), 10, "the cancelled point's child to die")
        cancelled = wait_for_job(store, running.job_id)
        assert {p.state for p in cancelled.points} == {"cancelled"}
        assert store.claim_next_point() is None
        assert running.executor.warm_worker_pids() == {0: running.warm_pid}
    [finished] = lifecycle_lines("job_finished")
    assert f"job={running.job_id} " in finished and "state=cancelled" in finished


def test_a_killed_all_reduce_point_leaves_no_rank_behind_and_is_retried(store):
    job = submit(store, batch_sizes=[8, 16], profiling={**FAST_PROFILING, "measure_comm": True})

    def comm_child():
        [comm] = [p for p in store.get_job(job.id).points if p.kind == "comm"]
        return comm.state == "running" and comm.worker_pid

    with started(LocalExecutor(store, poll_s=0.05)):
        child_pid = wait_for(comm_child, 120, "the all-reduce point's child to start", poll_s=0.01)
        rank_pids = wait_for(lambda: len(ranks := children_of(child_pid)) >= 2 and ranks, 30, "its ranks", poll_s=0.01)
        os.kill(child_pid, signal.SIGKILL)
        wait_for(lambda: all(gone(pid) for pid in rank_pids), 10, "the ranks to end with the point's child")
        finished = wait_for_job(store, job.id)
    assert finished.state == "done", finished.error
    [comm] = [p for p in finished.points if p.kind == "comm"]
    assert comm.state == "done" and comm.attempts == 2
    assert "profiling process died (killed by signal 9)" in comm.attempt_errors[0]
    assert (comm.measurement["backend"], comm.measurement["launcher"]) == ("gloo", "forked_processes")


def test_a_warm_child_that_overruns_its_timeout_is_killed(store, lifecycle_lines):
    job = submit(store, batch_sizes=[8, 16], profiling={**LONG_PROFILING, "timeout_s": 1.0, "max_attempts": 1})
    finished = run_until_finished(store, LocalExecutor(store, poll_s=0.05), job.id)
    assert finished.state == "failed"
    assert all(p.state == "failed" and p.error == "timed out after 1 s" for p in finished.points)
    assert len(lifecycle_lines("point_failed")) == 2
    [ended] = lifecycle_lines("job_finished")
    assert "state=failed" in ended


def test_without_a_warm_worker_the_points_run_as_fresh_processes(store, tmp_path, lifecycle_lines, caplog):
    no_warm_worker = 'case "$*" in *profiler.warm_worker*) echo "no fork here" >&2; exit 3;; esac\nexec "$REAL" "$@"'
    job = submit(store, batch_sizes=[8, 16], profiling=FAST_PROFILING)
    finished = run_until_finished(store, LocalExecutor(store, python=fake_python(tmp_path, no_warm_worker), poll_s=0.05), job.id)
    assert finished.state == "done", finished.error
    point_lines = lifecycle_lines("point_started")
    assert point_lines and all("path=cold" in line for line in point_lines)
    assert any("the warm worker did not start (exit code 3: no fork here)" in r.getMessage() for r in caplog.records)
