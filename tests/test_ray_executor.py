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

from tests.api_fixtures import store_for  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.handmade import spec_dict  # noqa: E402
from tests.processes import (  # noqa: E402
    CRASHING_CHILD,
    assert_every_point_failed_crashing,
    fake_python,
    gone,
    process_table,
    run_until_finished,
    started,
    submit,
    submit_over_http,
    wait_for,
    wait_for_job_over_http,
)
from tula_service.dispatch.ray_executor import RayExecutor, measure_comm_on_actors, measure_step_on_actors  # noqa: E402
from tula_service.fit.perfmodel.comm_fit import fit_comm_record  # noqa: E402
from tula_service.measurement import parse_measurement  # noqa: E402
from tula_service.store.job_store import Store  # noqa: E402

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


@pytest.fixture(scope="module")
def two_device_job(ray_cluster, tmp_path_factory):
    """A job for a 2-device cluster (so it measures communication), run to the end on Ray."""
    store = store_for(f"sqlite:///{tmp_path_factory.mktemp('two-device') / 'jobs.db'}")
    job = submit(store, batch_sizes=[4, 8], cluster={"gpus_per_node": 2}, profiling=FAST_PROFILING)
    return run_until_finished(store, RayExecutor(store, address=None, poll_s=0.1), job.id)


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
    assert record["informs_network_model"] is False and "not a GPU interconnect" in record["measured"]
    assert record["world_sizes"] == [2, 4] and record["node_ids"] == [ray_cluster]
    assert [group["world_size"] for group in record["groups"]] == [2, 4]
    assert all(len(group["ranks"]) == group["world_size"] for group in record["groups"])
    assert {p["world_size"] for p in record["points"]} == {2, 4}
    assert all(0 < p["p10_s"] <= p["median_s"] <= p["p90_s"] for p in record["points"])
    model = fit_comm_record(parse_measurement(record))
    assert model.latency_s_ >= 0 and model.bandwidth_gbps_ > 0
    measured = two_device_job.recommendation["models"]["network"]["measured_link"]
    assert measured["backend"] == "gloo" and "error" not in measured


STEP_REQUEST = {
    "kind": "step", "model": "small_cnn", "dataset": {"name": "synthetic_images", "channels": 3, "image_size": 32, "num_classes": 10},
    "batch_size": 8, "warmup_iters": 1, "timed_iters": 3, "time_cap_s": 10, "device": "cpu",
}  # fmt: skip


def test_a_step_runs_across_ray_actors_as_the_one_node_step_does(ray_cluster):
    task = ray.remote(num_cpus=0, max_retries=0)(measure_step_on_actors)
    outcome = ray.get(task.remote({**STEP_REQUEST, "placement": [2]}, 120.0, "tula-test-step"), timeout=180)
    assert outcome["state"] == "done" and outcome["worker"] == f"ray:{ray_cluster}", outcome["error"]
    record = outcome["measurement"]
    step = parse_measurement(record)
    assert step.kind == "step" and step.placement == [2] and step.device_batch == 8 and 0 <= step.sync_time_s < step.step_time_s
    assert (record["launcher"], record["backend"], record["node_ids"]) == ("ray_actors", "gloo", [ray_cluster])
    assert len(record["group"]["ranks"]) == 2 and record["timed_iters"] == 3


def test_a_step_over_more_nodes_than_the_cluster_has_is_a_lost_group(ray_cluster):
    from profiler.ray_group import GroupLost
    from profiler.ray_group import measure_step_on_actors as on_actors

    with pytest.raises(GroupLost, match="no room for the bundles"):
        on_actors({**STEP_REQUEST, "placement": [1, 1]}, 60.0, "tula-test-two-nodes", placement_timeout_s=2.0)
    assert not [g for g in ray.util.placement_group_table().values() if g["name"] == "tula-test-two-nodes" and g["state"] != "REMOVED"]


def test_a_group_that_cannot_form_is_a_failed_record_not_a_lost_attempt(ray_cluster):
    task = ray.remote(num_cpus=0, max_retries=0)(measure_comm_on_actors)
    outcome = ray.get(task.remote(["--max-bytes", "4096", "--backend", "nccl"], 60.0, "tula-test-no-gpu"), timeout=120)
    assert (outcome["state"], outcome["worker_died"]) == ("failed", False)
    record = outcome["measurement"]
    assert (record["kind"], record["status"], record["launcher"]) == ("comm", "failed", "ray_actors")
    assert "nccl" in record["error"] and record["points"] == []


def _ray_executor(store: Store, tmp_path: Path, python_body: str) -> RayExecutor:
    """A Ray executor on the module's cluster running each point as `fake_python(tmp_path, python_body)`."""
    return RayExecutor(store, address=None, poll_s=0.05, python=fake_python(tmp_path, python_body))


def test_a_child_that_keeps_crashing_is_retried_then_failed_with_every_reason(ray_cluster, store, tmp_path):
    job = submit(store, batch_sizes=[8, 16], profiling={"max_attempts": 2})
    finished = run_until_finished(store, _ray_executor(store, tmp_path, CRASHING_CHILD), job.id)
    assert_every_point_failed_crashing(finished, attempts=2, worker=f"ray:{ray_cluster}")


def test_a_ray_worker_that_dies_costs_the_attempt(ray_cluster, store, tmp_path):
    """The child kills the Ray worker running its task: Ray reports the task lost (a RayError),
    which counts as a dead worker, retried up to max_attempts."""
    job = submit(store, batch_sizes=[8, 16], profiling={"max_attempts": 1})
    finished = run_until_finished(store, _ray_executor(store, tmp_path, "kill -KILL $PPID; exec sleep 30"), job.id)
    assert finished.state == "failed"
    for point in finished.points:
        assert point.state == "failed" and point.attempts == 1
        assert point.error.startswith("Ray task died (")


def test_cancelling_a_job_stops_its_running_ray_task(ray_cluster, store, tmp_path):
    pid_file = tmp_path / "child.pid"
    job = submit(store, batch_sizes=[8, 16])
    python_body = f"echo $$ $PPID > {pid_file}.tmp; mv {pid_file}.tmp {pid_file}; exec sleep 60"
    with started(_ray_executor(store, tmp_path, python_body)) as executor:
        wait_for(pid_file.exists, 60, "the child to start")
        child_pid, ray_worker_pid = (int(pid) for pid in pid_file.read_text().split())
        executor.cancel(store.cancel_job(job.id))
        wait_for(lambda: gone(child_pid) and gone(ray_worker_pid), 20, "the child and its Ray worker to die")
        time.sleep(0.5)  # the dispatcher has seen the task end by now; it must not overwrite
        cancelled = store.get_job(job.id)
        assert cancelled.state == "cancelled" and {p.state for p in cancelled.points} == {"cancelled"}
        assert store.claim_next_point() is None


def test_cancelling_a_communication_point_frees_its_actors_placement(ray_cluster, store, tmp_path):
    """A killed coordinator takes its actors with it, but not its placement group: the executor
    removes that by name, so the cluster's CPUs are free again."""
    job = submit(store, batch_sizes=[8, 16], profiling={"measure_comm": True, "max_attempts": 1})
    # the compute points fail at once; the comm point is real
    with started(_ray_executor(store, tmp_path, "exit 3")) as executor:
        placements = wait_for(lambda: _comm_placements("CREATED"), 60, "the communication point to reserve its ranks")
        executor.cancel(store.cancel_job(job.id))

        def freed():
            return not _comm_placements("CREATED") and ray.available_resources().get("CPU", 0) >= CLUSTER_CPUS

        wait_for(freed, 30, "its placement group to be removed and the CPUs freed", poll_s=0.1)
        assert placements <= _comm_placements("REMOVED")
        assert ray.available_resources().get("CPU", 0) == CLUSTER_CPUS
        assert store.get_job(job.id).state == "cancelled"


def _comm_placements(state: str) -> set[str]:
    return {
        group["name"] for group in ray.util.placement_group_table().values()
        if group["name"].startswith("tula-comm-") and group["state"] == state
    }  # fmt: skip


# --- the real server against a `ray start` cluster ----------------------------------------------


def _session_processes(session_id: int) -> list[int]:
    """Pids whose session is `session_id` (the head was started in its own session)."""
    return [pid for pid, fields in process_table().items() if int(fields[3]) == session_id]


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
    job_id = submit_over_http(server.url, spec_dict(batch_sizes=[4, 8], profiling=FAST_PROFILING))
    job = wait_for_job_over_http(server.url, job_id, timeout_s=180)
    assert job["state"] == "done", job
    assert all(p["state"] == "done" and p["worker"].startswith("ray:") for p in job["points"])
    ready = httpx.get(f"{server.url}/readyz", timeout=30).json()
    assert "ray: running" in str(ready)
    server.stop()  # disconnect from Ray before the head goes
