"""Jobs survive: a killed profiling child is retried, a killed server is restarted and its jobs
finish. Real uvicorn servers, real profiling children, real signals."""

import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.handmade import spec_dict
from tests.processes import children_of, command_line, gone, submit_over_http, wait_for, wait_for_job_over_http

pytestmark = pytest.mark.e2e

# Each point samples until its 3 s cap (stop targets it cannot meet): a point that stops early, once its
# median is known, can end before the test's kill reaches its child, and then nothing is retried. A 1 s
# cap was too short on a loaded CI machine: the test's process was not scheduled again before the child
# had ended, and its kill reached a finished child.
SPEC = spec_dict(
    name="durability",
    batch_sizes=[8, 16, 32],
    profiling={"time_cap_s": 3.0, "timed_iters": 3, "warmup_iters": 1, "grad_iters": 2,
               "target_cv": 1e-6, "target_median_rse": 1e-6},
)  # fmt: skip


def _warm_workers(server_pid: int) -> list[int]:
    """Pids of the server's warm workers (`python -m profiler.warm_worker`)."""
    return [pid for pid in children_of(server_pid) if b"profiler.warm_worker" in command_line(pid)]


def _profiler_children(server_pid: int) -> list[int]:
    """Pids of the profiling children running points for the server: forked by its warm workers, or
    started cold (`python -m profiler.run_point`)."""
    cold = [pid for pid in children_of(server_pid) if b"profiler.run_point" in command_line(pid)]
    children = [pid for warm in _warm_workers(server_pid) for pid in children_of(warm)] + cold
    return [pid for pid in children if not gone(pid)]  # a zombie has finished its point: killing it retries nothing


def _a_job_with_a_running_child(server) -> tuple[str, int]:
    """(job id, child pid): SPEC submitted to the server, once one of its points' child runs."""
    job_id = submit_over_http(server.url, SPEC)
    [child] = wait_for(lambda: _profiler_children(server.process.pid), 60, "a profiling child")
    return job_id, child


def _done_with_one_point_retried(server, job_id: str) -> tuple[dict, dict]:
    """(job, its retried point) once the job has ended: done, with one point done at its second attempt."""
    final = wait_for_job_over_http(server.url, job_id)
    assert final["state"] == "done", final["error"]
    [retried] = [p for p in final["points"] if p["attempts"] == 2]
    assert retried["state"] == "done"
    return final, retried


def test_a_killed_profiling_child_is_retried_and_the_job_ends_done(make_server):
    server = make_server()
    job_id, child = _a_job_with_a_running_child(server)
    os.kill(child, signal.SIGKILL)
    final, retried = _done_with_one_point_retried(server, job_id)
    assert "killed by signal 9" in retried["attempt_errors"][0]
    assert final["progress"]["points_retried"] == 1 and final["progress"]["points_failed"] == 0
    log = server.log_path.read_text()
    for event in ("job_submitted", "point_started", "point_retried", "point_done"):
        assert f"tula.lifecycle: event={event} job={job_id}" in log
    assert f"tula.lifecycle: event=job_finished job={job_id} state=done" in log


def test_a_killed_warm_worker_is_restarted_and_the_job_ends_done(make_server):
    server = make_server()
    job_id, child = _a_job_with_a_running_child(server)
    [warm_worker] = _warm_workers(server.process.pid)
    os.kill(warm_worker, signal.SIGKILL)
    wait_for(lambda: gone(child), 10, "the point's child to die with its warm worker")
    _, retried = _done_with_one_point_retried(server, job_id)
    assert "warm worker died (killed by signal 9)" in retried["attempt_errors"][0]
    [restarted] = _warm_workers(server.process.pid)
    assert restarted != warm_worker


def test_a_server_killed_mid_profiling_restarts_and_the_job_completes(make_server, tmp_path):
    database = tmp_path / "restart.db"
    first = make_server(database_path=database)
    job_id, child = _a_job_with_a_running_child(first)
    first.process.kill()  # SIGKILL: no shutdown handler runs
    first.process.wait()
    wait_for(lambda: gone(child), 10, "the orphaned child to die with its server")
    assert _job_state_in_database(database, job_id) == "profiling"

    second = make_server(database_path=database)
    final = wait_for_job_over_http(second.url, job_id)
    assert final["state"] == "done", final["error"]
    interrupted = [p for p in final["points"] if p["attempt_errors"]]
    assert len(interrupted) == 1 and "interrupted (server stopped)" in interrupted[0]["attempt_errors"][0]
    assert all(p["state"] == "done" for p in final["points"])
    rec = httpx.get(f"{second.url}/v1/jobs/{job_id}/recommendation", timeout=10).json()
    assert rec["chosen"]["global_batch"] > 0


def _job_state_in_database(database: Path, job_id: str) -> str:
    import sqlite3

    with sqlite3.connect(database) as connection:
        return connection.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]
