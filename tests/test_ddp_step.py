"""The multi-device step (`profiler.ddp_step`): real gloo ranks forked on CPU, a real zoo model wrapped in
DistributedDataParallel, in-process and as the child process the server runs."""

import json
import subprocess
import sys
import time

import httpx
import pytest

torch = pytest.importorskip("torch")

from profiler.ddp_step import measure_step  # noqa: E402
from tests.handmade import spec_dict  # noqa: E402
from tula_service.measurement import StepMeasurement, parse_measurement  # noqa: E402

IMAGES = {"name": "synthetic_images", "channels": 3, "image_size": 32, "num_classes": 10}
FAST = {"warmup_iters": 1, "timed_iters": 4, "time_cap_s": 10, "device": "cpu", "threads": 1}


def _request(batch_size: int = 8, placement: tuple[int, ...] = (2,), **extra) -> dict:
    workload = {"model": "small_cnn", "dataset": IMAGES, "batch_size": batch_size}
    return {"kind": "step", **workload, "placement": list(placement), **FAST, **extra}


def _run_point(request: dict, out) -> dict:
    subprocess.run(
        [sys.executable, "-m", "profiler.run_point", "--request", json.dumps(request), "--out", str(out)],
        check=True, timeout=120,
    )  # fmt: skip
    return json.loads(out.read_text())


def test_two_gloo_ranks_measure_a_step_that_meets_the_contract():
    record = measure_step(_request())
    step = parse_measurement(record)
    assert isinstance(step, StepMeasurement) and step.placement == [2] and step.device_batch == 8
    assert step.origin == "profiler" and step.step_time_s > 0 and 0 <= step.sync_time_s < step.step_time_s
    assert record["backend"] == "gloo" and record["world_size"] == 2
    assert record["device"] == "cpu" and record["threads"] == 1
    assert len(record["iter_times_s"]["sync"]) == len(record["iter_times_s"]["local"]) == record["timed_iters"] == 4
    assert record["local_step_time_s"] > 0 and "no_sync" in record["sync_time_note"]
    assert record["sync_time_s"] == pytest.approx(max(0.0, record["step_time_s"] - record["local_step_time_s"]))


def test_run_point_writes_the_step_record(tmp_path):
    record = _run_point(_request(batch_size=4, backend="auto"), tmp_path / "step.json")  # as dispatch.jobs.step_request
    step = parse_measurement(record)
    assert isinstance(step, StepMeasurement) and step.placement == [2] and step.device_batch == 4


def test_a_placement_over_two_nodes_names_the_ray_executor():
    with pytest.raises(ValueError, match="cross-node steps run through the Ray executor"):
        measure_step(_request(placement=(1, 1)))


def test_a_missing_dataset_is_a_failed_record_not_a_hang(tmp_path):
    missing = {"name": "image_folder", "path": str(tmp_path / "missing"), "image_size": 32}
    record = _run_point(_request(dataset=missing, data_roots=[str(tmp_path)]), tmp_path / "step.json")
    assert record["kind"] == "step" and record["status"] == "failed"
    assert "does not exist" in record["error"] and record["error"].startswith("RankFailure: rank ")
    assert parse_measurement(record).status == "failed"  # the contract's, so the server records the point's own error


def test_a_rank_out_of_memory_is_an_oom_record():
    # As tests/test_profiler.py's: 4096 images of 32 x 32 need ~1.4 GB of activations; each rank may use 256 MiB more.
    images = {**IMAGES, "num_samples": 8192}
    record = measure_step(_request(batch_size=4096, dataset=images, memory_limit_bytes=256 * 2**20))
    assert record["status"] == "oom" and "allocate" in record["error"]
    assert record["placement"] == [2] and record["device_batch"] == 4096
    assert parse_measurement(record).status == "oom"


def test_the_time_cap_cuts_the_timed_iterations_but_never_below_three():
    record = measure_step(_request(timed_iters=1000, time_cap_s=2))
    assert 3 <= record["timed_iters"] < 1000 and record["stopped_by"] == "time_cap"
    assert len(record["iter_times_s"]["sync"]) == record["timed_iters"]


def test_a_job_with_step_placements_measures_a_two_rank_step_and_plans_from_it(make_server):
    """The real local executor: compute points, then a step point on 2 gloo ranks at a profiled batch; the
    plan fits the placement model to it and says that step was measured."""
    server = make_server()
    spec = spec_dict(
        batch_sizes=[8, 16], cluster={"nodes": 2, "gpus_per_node": 2, "device_memory_gib": 16, "interconnect_gbps": 100},
        profiling={**{k: v for k, v in FAST.items() if k != "threads"}, "grad_iters": 2, "step_placements": [[2], [1, 1]], "measure_comm": False},
    )  # fmt: skip
    job = httpx.post(f"{server.url}/v1/jobs", json=spec, timeout=30).json()
    deadline = time.monotonic() + 240
    while job["state"] not in ("done", "failed") and time.monotonic() < deadline:
        time.sleep(0.5)
        job = httpx.get(f"{server.url}/v1/jobs/{job['id']}", timeout=10).json()
    assert job["state"] == "done", job
    points = httpx.get(f"{server.url}/v1/jobs/{job['id']}/points", timeout=10).json()["points"]
    steps = {tuple(p["placement"]): p for p in points if p["kind"] == "step"}
    assert steps[(2,)]["state"] == "done" and steps[(2,)]["batch_size"] == 16
    # the local executor runs ranks on its own host only: a placement over two nodes is a failed point, as data
    assert steps[(1, 1)]["state"] == "failed" and "Ray executor" in steps[(1, 1)]["error"]
    recommendation = httpx.get(f"{server.url}/v1/jobs/{job['id']}/recommendation", timeout=10).json()
    assert recommendation["models"]["step_time"]["model"] == "placement"
    measured = [c for c in recommendation["candidates"] if c["placement"] == [2] and c["device_batch"] == 16 and c["accumulation"] == 1]
    assert measured and all(c["step_time_s"]["source"] == "measured" for c in measured)
