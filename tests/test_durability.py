"""Jobs survive: a killed profiling child is retried, a killed server is restarted and its jobs
finish. Real uvicorn servers, real profiling children, real signals."""

import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.handmade import spec_dict
from tests.processes import gone, wait_for

pytestmark = pytest.mark.e2e

SPEC = spec_dict(
    name="durability",
    batch_sizes=[8, 16, 32],
    profiling={"time_cap_s": 1.0, "timed_iters": 3, "warmup_iters": 1, "grad_iters": 2},
)


def _processes() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, command line) of every process (from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        found[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmdline)
    return found


def _warm_workers(server_pid: int) -> list[int]:
    """Pids of the server's warm workers (`python -m profiler.warm_worker`)."""
    return [pid for pid, (parent, cmdline) in _processes().items() if parent == server_pid and b"profiler.warm_worker" in cmdline]


def _profiler_children(server_pid: int) -> list[int]:
    """Pids of the profiling children running points for the server: forked by its warm workers, or
    started cold (`python -m profiler.run_point`)."""
    processes = _processes()
    warm = {pid for pid, (parent, cmdline) in processes.items() if parent == server_pid and b"profiler.warm_worker" in cmdline}
    return [
        pid for pid, (parent, cmdline) in processes.items()
        if parent in warm or (parent == server_pid and b"profiler.run_point" in cmdline)
    ]  # fmt: skip


def _job(server, job_id: str) -> dict:
    return httpx.get(f"{server.url}/v1/jobs/{job_id}", timeout=10).json()


def test_a_killed_profiling_child_is_retried_and_the_job_ends_done(make_server):
    server = make_server()
    job_id = httpx.post(f"{server.url}/v1/jobs", json=SPEC, timeout=30).json()["id"]
    [child] = wait_for(lambda: _profiler_children(server.process.pid), 60, "a profiling child")
    os.kill(child, signal.SIGKILL)
    final = wait_for(lambda: (j := _job(server, job_id))["state"] in ("done", "failed") and j, 300, "the job to end")
    assert final["state"] == "done", final["error"]
    retried = [p for p in final["points"] if p["attempts"] == 2]
    assert len(retried) == 1 and retried[0]["state"] == "done"
    assert "killed by signal 9" in retried[0]["attempt_errors"][0]
    assert final["progress"]["points_retried"] == 1 and final["progress"]["points_failed"] == 0
    log = server.log_path.read_text()
    for event in ("job_submitted", "point_started", "point_retried", "point_done"):
        assert f"tula.lifecycle: event={event} job={job_id}" in log
    assert f"tula.lifecycle: event=job_finished job={job_id} state=done" in log


def test_a_killed_warm_worker_is_restarted_and_the_job_ends_done(make_server):
    server = make_server()
    job_id = httpx.post(f"{server.url}/v1/jobs", json=SPEC, timeout=30).json()["id"]
    [child] = wait_for(lambda: _profiler_children(server.process.pid), 60, "a profiling child")
    [warm_worker] = _warm_workers(server.process.pid)
    os.kill(warm_worker, signal.SIGKILL)
    wait_for(lambda: gone(child), 10, "the point's child to die with its warm worker")
    final = wait_for(lambda: (j := _job(server, job_id))["state"] in ("done", "failed") and j, 300, "the job to end")
    assert final["state"] == "done", final["error"]
    retried = [p for p in final["points"] if p["attempts"] == 2]
    assert len(retried) == 1 and retried[0]["state"] == "done"
    assert "warm worker died (killed by signal 9)" in retried[0]["attempt_errors"][0]
    [restarted] = _warm_workers(server.process.pid)
    assert restarted != warm_worker


def test_a_server_killed_mid_profiling_restarts_and_the_job_completes(make_server, tmp_path):
    database = tmp_path / "restart.db"
    first = make_server(database_path=database)
    job_id = httpx.post(f"{first.url}/v1/jobs", json=SPEC, timeout=30).json()["id"]
    [child] = wait_for(lambda: _profiler_children(first.process.pid), 60, "a profiling child")
    first.process.kill()  # SIGKILL: no shutdown handler runs
    first.process.wait()
    wait_for(lambda: gone(child), 10, "the orphaned child to die with its server")
    assert _job_state_in_database(database, job_id) == "profiling"

    second = make_server(database_path=database)
    final = wait_for(lambda: (j := _job(second, job_id))["state"] in ("done", "failed") and j, 300, "the job to end")
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
