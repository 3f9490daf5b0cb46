"""The Ray executor on a real local Ray cluster (2 CPUs, no mocks): compute points run as Ray tasks,
the all-reduce runs across a group of Ray actors, dead workers cost an attempt, cancel stops the
task; and the real server dispatches to a `ray start` cluster."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # before Ray starts: its processes inherit it

ray = pytest.importorskip("ray")
pytest.importorskip("torch")

from tests.conftest import free_port  # noqa: E402
from tests.handmade import spec_dict  # noqa: E402
from tests.processes import fake_python, gone, submit, wait_for_job  # noqa: E402
from tula_service.db import make_engine, make_session_factory  # noqa: E402
from tula_service.perfmodel.comm_fit import fit_comm_record  # noqa: E402
from tula_service.ray_executor import RayExecutor, measure_comm_on_actors  # noqa: E402
from tula_service.store import Store  # noqa: E402

FAST_PROFILING = {"time_cap_s": 0.5, "timed_iters": 2, "warmup_iters": 1, "grad_iters": 2}
CLUSTER_CPUS = 2
# Ray's token authentication (its default for new clusters): the head and the server that joins it
# share the token in ~/.ray/auth_token, which the head creates when missing.
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token"}


@pytest.fixture(scope="module")
def ray_cluster():
    """One in-process Ray cluster for the module (starting Ray costs seconds)."""
    ray.init(address="local", num_cpus=CLUSTER_CPUS, include_dashboard=False)
    yield ray.get_runtime_context().get_node_id()
    ray.shutdown()


def _store(tmp_path) -> Store:
    return Store(make_session_factory(make_engine(f"sqlite:///{tmp_path}/jobs.db")))


def _run_until_finished(store: Store, executor: RayExecutor, job_id: str):
    executor.start()
    try:
        return wait_for_job(store, job_id)
    finally:
        executor.stop()


@pytest.fixture(scope="module")
def two_device_job(ray_cluster, tmp_path_factory):
    """A job for a 2-device cluster (so it measures communication), run to the end on Ray."""
    store = _store(tmp_path_factory.mktemp("two-device"))
    job = submit(store, batch_sizes=[4, 8], cluster={"gpus_per_node": 2}, profiling=FAST_PROFILING)
    return _run_until_finished(store, RayExecutor(store, address=None, poll_s=0.1), job.id)


def test_compute_points_run_as_ray_tasks_and_the_job_ends_done(two_device_job, ray_cluster):
    assert two_device_job.state == "done", two_device_job.error
    compute = [p for p in two_device_job.points if p.kind == "grid"]
    assert sorted(p.batch_size for p in compute) == [4, 8]
    for point in compute:
        assert point.state == "done" and point.attempts == 1
        assert point.worker == f"ray:{ray_cluster}"
        assert point.measurement["status"] == "ok" and point.measurement["batch_size"] == point.batch_size
    assert two_device_job.recommendation["chosen"]["device_batch"] in (4, 8)


def test_the_all_reduce_is_measured_across_ray_actors_and_fits(two_device_job, ray_cluster):
    [comm] = [p for p in two_device_job.points if p.kind == "comm"]
    assert comm.state == "done" and comm.worker.startswith("ray:"), comm.error
    record = comm.measurement
    assert (record["kind"], record["status"], record["backend"], record["launcher"]) == ("comm", "ok", "gloo", "ray_actors")
    assert record["world_sizes"] == [2, 4] and record["node_ids"] == [ray_cluster]
    assert [group["world_size"] for group in record["groups"]] == [2, 4]
    assert all(len(group["ranks"]) == group["world_size"] for group in record["groups"])
    assert {p["world_size"] for p in record["points"]} == {2, 4}
    assert all(0 < p["p10_s"] <= p["median_s"] <= p["p90_s"] for p in record["points"])
    model = fit_comm_record(record)
    assert model.latency_s_ >= 0 and model.bandwidth_gbps_ > 0
    measured = two_device_job.recommendation["models"]["network"]["measured_link"]
    assert measured["backend"] == "gloo" and "error" not in measured


def test_a_group_that_cannot_form_is_a_failed_record_not_a_lost_attempt(ray_cluster):
    task = ray.remote(num_cpus=0, max_retries=0)(measure_comm_on_actors)
    outcome = ray.get(task.remote(["--max-bytes", "4096", "--backend", "nccl"], 60.0, "tula-test-no-gpu"), timeout=120)
    assert (outcome["state"], outcome["worker_died"]) == ("failed", False)
    record = outcome["measurement"]
    assert (record["kind"], record["status"], record["launcher"]) == ("comm", "failed", "ray_actors")
    assert "nccl" in record["error"] and record["points"] == []


def test_a_child_that_keeps_crashing_is_retried_then_failed_with_every_reason(ray_cluster, tmp_path):
    store = _store(tmp_path)
    job = submit(store, batch_sizes=[8, 16], profiling={"max_attempts": 2})
    python = fake_python(tmp_path, "echo 'worker exploded' >&2; kill -SEGV $$")
    finished = _run_until_finished(store, RayExecutor(store, address=None, poll_s=0.05, python=python), job.id)
    assert finished.state == "failed"
    for point in finished.points:
        assert point.state == "failed" and point.attempts == 2
        assert point.error.startswith("failed after 2 attempts; last: profiling process died (killed by signal 11)")
        assert "worker exploded" in point.error
        assert len(point.attempt_errors) == 1 and point.attempt_errors[0].startswith(f"attempt 1 on ray:{ray_cluster}")


def test_a_ray_worker_that_dies_costs_the_attempt(ray_cluster, tmp_path):
    """The child kills the Ray worker running its task: Ray reports the task lost (a RayError),
    which counts as a dead worker, retried up to max_attempts."""
    store = _store(tmp_path)
    job = submit(store, batch_sizes=[8, 16], profiling={"max_attempts": 1})
    python = fake_python(tmp_path, "kill -KILL $PPID; exec sleep 30")
    finished = _run_until_finished(store, RayExecutor(store, address=None, poll_s=0.05, python=python), job.id)
    assert finished.state == "failed"
    for point in finished.points:
        assert point.state == "failed" and point.attempts == 1
        assert point.error.startswith("Ray task died (")


def test_cancelling_a_job_stops_its_running_ray_task(ray_cluster, tmp_path):
    store = _store(tmp_path)
    pid_file = tmp_path / "child.pid"
    job = submit(store, batch_sizes=[8, 16])
    python = fake_python(tmp_path, f"echo $$ $PPID > {pid_file}.tmp; mv {pid_file}.tmp {pid_file}; exec sleep 60")
    executor = RayExecutor(store, address=None, poll_s=0.05, python=python)
    executor.start()
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        child_pid, ray_worker_pid = (int(pid) for pid in pid_file.read_text().split())
        executor.cancel(store.cancel_job(job.id))
        deadline = time.monotonic() + 20
        while not (gone(child_pid) and gone(ray_worker_pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(child_pid) and gone(ray_worker_pid)
        time.sleep(0.5)  # the dispatcher has seen the task end by now; it must not overwrite
        cancelled = store.get_job(job.id)
        assert cancelled.state == "cancelled" and {p.state for p in cancelled.points} == {"cancelled"}
        assert store.claim_next_point() is None
    finally:
        executor.stop()


def test_cancelling_a_communication_point_frees_its_actors_placement(ray_cluster, tmp_path):
    """A killed coordinator takes its actors with it, but not its placement group: the executor
    removes that by name, so the cluster's CPUs are free again."""
    store = _store(tmp_path)
    job = submit(store, batch_sizes=[8, 16], profiling={"measure_comm": True, "max_attempts": 1})
    python = fake_python(tmp_path, "exit 3")  # the compute points fail at once; the comm point is real
    executor = RayExecutor(store, address=None, poll_s=0.05, python=python)
    executor.start()
    try:
        deadline = time.monotonic() + 60
        while not (placements := _comm_placements("CREATED")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert placements, "the communication point never reserved its ranks"
        executor.cancel(store.cancel_job(job.id))
        deadline = time.monotonic() + 30
        while _comm_placements("CREATED") or ray.available_resources().get("CPU", 0) < CLUSTER_CPUS:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not _comm_placements("CREATED") and placements <= _comm_placements("REMOVED")
        assert ray.available_resources().get("CPU", 0) == CLUSTER_CPUS
        assert store.get_job(job.id).state == "cancelled"
    finally:
        executor.stop()


def _comm_placements(state: str) -> set[str]:
    return {
        group["name"] for group in ray.util.placement_group_table().values()
        if group["name"].startswith("tula-comm-") and group["state"] == state
    }  # fmt: skip


# --- the real server against a `ray start` cluster ----------------------------------------------


def _session_processes(session_id: int) -> list[int]:
    """Pids whose session is `session_id` (the head was started in its own session)."""
    pids = []
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_path.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session_id:
            pids.append(int(stat_path.parent.name))
    return pids


@pytest.fixture
def ray_head(tmp_path):
    """`ray start --head --block` in its own session and temp dir (so no other Ray user finds it);
    at teardown every process of that session is terminated, then killed."""
    temp_dir = tempfile.mkdtemp(prefix="tula-ray-", dir="/tmp")  # short: Ray's socket paths live here
    port = free_port()
    log_path = tmp_path / "ray-head.log"
    ray_cli = Path(sys.executable).with_name("ray")
    head = subprocess.Popen(
        [str(ray_cli), "start", "--head", f"--num-cpus={CLUSTER_CPUS}", f"--port={port}", "--include-dashboard=false",
         "--disable-usage-stats", f"--temp-dir={temp_dir}", "--block"],
        stdout=log_path.open("wb"), stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **RAY_ENV},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while "Ray runtime started" not in log_path.read_text(errors="replace"):
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start failed:\n{log_path.read_text(errors='replace')}")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        for sig, grace_s in ((signal.SIGTERM, 3), (signal.SIGKILL, 5)):  # a test cluster: no graceful drain
            for pid in _session_processes(head.pid):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            while [p for p in _session_processes(head.pid) if not gone(p)] and time.monotonic() < deadline:
                time.sleep(0.1)
        head.wait(5)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.e2e
def test_the_server_dispatches_a_job_to_a_ray_cluster(ray_head, make_server):
    server = make_server("--executor", "ray", "--ray-address", ray_head, env=RAY_ENV)
    spec = spec_dict(batch_sizes=[4, 8], profiling=FAST_PROFILING)
    response = httpx.post(f"{server.url}/v1/jobs", json=spec, timeout=30)
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    deadline = time.monotonic() + 180
    while (job := httpx.get(f"{server.url}/v1/jobs/{job_id}", timeout=30).json())["state"] not in ("done", "failed"):
        assert time.monotonic() < deadline, job
        time.sleep(0.3)
    assert job["state"] == "done", job
    assert all(p["state"] == "done" and p["worker"].startswith("ray:") for p in job["points"])
    ready = httpx.get(f"{server.url}/readyz", timeout=30).json()
    assert "ray: running" in str(ready)
    server.stop()  # disconnect from Ray before the head goes
