"""The local executor with real child processes: a dead worker costs an attempt, never the server;
retries are bounded; cancellation stops running children.

The tests that stand in a fake interpreter for each point's `python -m profiler.run_point` run the
cold path (warm=False); tests/test_warm_worker.py covers the same guarantees for points forked from
the warm worker."""

import sys
import time
from pathlib import Path

from tests.api_fixtures import store_for
from tests.processes import (
    CRASHING_CHILD,
    assert_every_point_failed_crashing,
    fake_python,
    gone,
    run_until_finished,
    running_child,
    started,
    submit,
    wait_for,
)
from tula_service.dispatch.executor import LocalExecutor
from tula_service.store.job_store import Store

FAST_PROFILING = {"time_cap_s": 0.2, "timed_iters": 2, "warmup_iters": 1, "grad_iters": 2}


def _cold_executor(store: Store, tmp_path: Path, python_body: str) -> LocalExecutor:
    """A local executor running each point as a fresh process of `fake_python(tmp_path, python_body)`."""
    return LocalExecutor(store, python=fake_python(tmp_path, python_body), poll_s=0.05, warm=False)


def test_a_worker_that_keeps_dying_is_retried_then_failed_with_every_reason(store, tmp_path):
    job = submit(store, batch_sizes=[8, 16], profiling={"max_attempts": 2})
    finished = run_until_finished(store, _cold_executor(store, tmp_path, CRASHING_CHILD), job.id)
    assert_every_point_failed_crashing(finished, attempts=2, worker="local:")
    assert "need at least 2 successfully profiled batch sizes" in finished.error


def test_a_point_killed_once_is_retried_and_the_job_ends_done(store, tmp_path):
    marker = tmp_path / "killed-once"
    # The first start of the batch-16 point kills itself with SIGKILL; every other start is real.
    body = f'case "$*" in *\'"batch_size": 16\'*) if [ ! -e {marker} ]; then touch {marker}; kill -KILL $$; fi;; esac\nexec "$REAL" "$@"'
    job = submit(store, batch_sizes=[8, 16, 32], profiling=FAST_PROFILING)
    finished = run_until_finished(store, _cold_executor(store, tmp_path, body), job.id)
    assert finished.state == "done", finished.error
    by_batch = {p.batch_size: p for p in finished.points if p.kind == "grid"}  # a noisy point may be re-timed too
    assert by_batch[16].state == "done" and by_batch[16].attempts == 2
    assert "killed by signal 9" in by_batch[16].attempt_errors[0]
    assert by_batch[8].attempts == 1 and by_batch[32].attempts == 1
    assert finished.recommendation["profiled"]["failed"] == []


def test_a_point_that_keeps_dying_is_missing_and_the_job_still_fits_and_says_so(store, tmp_path):
    body = 'case "$*" in *\'"batch_size": 16\'*) kill -KILL $$;; esac\nexec "$REAL" "$@"'
    job = submit(store, batch_sizes=[8, 16, 32], profiling={**FAST_PROFILING, "max_attempts": 2})
    finished = run_until_finished(store, _cold_executor(store, tmp_path, body), job.id)
    assert finished.state == "done", finished.error
    [missing] = finished.recommendation["profiled"]["failed"]
    assert missing["batch_size"] == 16 and missing["attempts"] == 2
    assert "killed by signal 9" in missing["error"] and len(missing["attempt_errors"]) == 1


def test_a_points_own_error_is_data_and_not_retried(store, tmp_path, monkeypatch):
    monkeypatch.setenv("TULA_DATA_ROOTS", str(tmp_path))
    dataset = {"name": "image_folder", "path": str(tmp_path / "no-such-folder"), "num_samples": 1000}
    job = submit(store, batch_sizes=[8, 16], dataset=dataset, profiling={"max_attempts": 3})
    finished = run_until_finished(store, LocalExecutor(store, poll_s=0.05), job.id)
    assert finished.state == "failed"
    for point in finished.points:
        assert point.attempts == 1 and point.measurement["status"] == "failed"
        assert "no-such-folder" in point.error and point.measurement["traceback_tail"]


def test_child_that_overruns_its_timeout_is_killed(store, tmp_path):
    job = submit(store, batch_sizes=[8, 16], profiling={"timeout_s": 0.5, "max_attempts": 1})
    began = time.monotonic()
    finished = run_until_finished(store, _cold_executor(store, tmp_path, "sleep 30"), job.id)
    assert time.monotonic() - began < 20
    assert all("timed out after 0.5 s" in p.error for p in finished.points)


def test_cancelling_a_job_kills_its_running_child_and_keeps_it_cancelled(store, tmp_path):
    job = submit(store, batch_sizes=[8, 16])
    with started(_cold_executor(store, tmp_path, "sleep 60")) as executor:
        _, child_pid = running_child(store, job.id)
        executor.cancel(store.cancel_job(job.id))
        wait_for(lambda: gone(child_pid), 10, "the cancelled point's child to die")
        time.sleep(0.5)  # the worker thread has seen its child die by now; it must not overwrite
        cancelled = store.get_job(job.id)
        assert cancelled.state == "cancelled" and cancelled.finished_at is not None
        assert {p.state for p in cancelled.points} == {"cancelled"}
        assert store.claim_next_point() is None


def test_a_cancel_written_by_another_process_stops_the_child(store, jobs_database_url, tmp_path):
    """An API-only server (--executor none) cancels in the database; the dispatching executor's
    watchdog sees it and kills the child."""
    job = submit(store, batch_sizes=[8, 16])
    with started(_cold_executor(store, tmp_path, "sleep 60")):
        _, child_pid = running_child(store, job.id)
        store_for(jobs_database_url).cancel_job(job.id)  # its own engine, no executor.cancel: only the database knows
        wait_for(lambda: gone(child_pid), 10, "the cancelled point's child to die")


def test_points_left_running_by_a_dead_server_are_requeued(store):
    job = submit(store, batch_sizes=[8, 16])
    claimed = store.claim_next_point("local:elsewhere:1")
    assert claimed.state == "running" and store.get_job(job.id).state == "profiling"
    [interrupted] = store.requeue_interrupted()
    assert interrupted.id == claimed.id
    points = store.get_job(job.id).points
    assert {p.state for p in points} == {"queued"}
    assert "interrupted (server stopped)" in points[0].attempt_errors[0]


def test_a_killed_server_leaves_no_orphan_child(tmp_path):
    """The child dies with the thread that started it (PR_SET_PDEATHSIG), so a SIGKILLed server
    does not leave profiling running on the device."""
    import subprocess

    pid_file = tmp_path / "child.pid"
    script = tmp_path / "starter.py"
    script.write_text(
        "import sys\n"
        "from tula_service.dispatch.dispatcher import run_child\n"
        f"run_child([{fake_python(tmp_path, f'echo $$ > {pid_file}; sleep 60')!r}], 60)\n"
    )
    starter = subprocess.Popen([sys.executable, str(script)], cwd=Path(__file__).resolve().parents[1])
    wait_for(pid_file.exists, 30, "the child to start")
    child_pid = int(pid_file.read_text())
    starter.kill()
    starter.wait()
    wait_for(lambda: gone(child_pid), 10, "the orphaned child to die with its starter")
