"""The profiler's records against the typed contract the service reads (tula_service.measurement): real
torch runs on CPU (a compute point, an out-of-memory point, a pilot, a gloo all-reduce, a point whose
model fails), and the hand-made records the other tests use, so that neither drifts from the contract."""

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from tests.handmade import comm_record, measurement, oom
from tula_service.measurement import (
    CommMeasurement,
    ComputeMeasurement,
    PilotMeasurement,
    SourcedValue,
    parse_measurement,
)

IMAGES = {"name": "synthetic_images", "channels": 3, "image_size": 16, "num_classes": 10, "num_samples": 2000}
FAST = {"warmup_iters": 1, "timed_iters": 3, "time_cap_s": 0.5, "grad_iters": 3, "device": "cpu", "threads": 1}


def test_the_hand_made_records_meet_the_contract():
    point = parse_measurement(measurement(16))
    assert isinstance(point, ComputeMeasurement) and point.ok
    assert point.iter_time.median_s > 0 and point.memory.peak_bytes > 0 and point.gradient.batch == 16
    assert parse_measurement(oom(512)).status == "oom"
    comm = parse_measurement(comm_record("nccl", 1e-5, 100))
    assert isinstance(comm, CommMeasurement) and comm.points[0].world_size == 2


def test_a_record_that_breaks_the_contract_is_refused_by_field():
    broken = measurement(16)
    del broken["iter_time"]
    with pytest.raises(ValidationError, match="iter_time"):
        parse_measurement(broken)
    wrong = measurement(16)
    wrong["memory"]["peak_bytes"] = "a lot"
    with pytest.raises(ValidationError, match="peak_bytes"):
        parse_measurement(wrong)
    with pytest.raises(ValueError, match="unknown measurement kind 'step'"):
        parse_measurement({"kind": "step", "status": "ok"})


def test_a_record_keeps_the_detail_the_contract_does_not_name():
    record = measurement(16)
    record["iter_time"]["phases"] = {"forward": {"median_s": 0.001}}
    point = parse_measurement(record)
    assert point.iter_time.model_extra["phases"] == {"forward": {"median_s": 0.001}}
    assert point.model_dump(exclude_none=True)["iter_time"]["phases"] == record["iter_time"]["phases"]


def test_sourced_values_name_where_they_came_from():
    assert SourcedValue(value=1.5, source="fitted", rel_err=0.04).rel_err == 0.04
    with pytest.raises(ValidationError, match="source"):
        SourcedValue(value=1.5, source="guessed")


# Real runs of the profiler (torch on CPU).


def run_point(tmp_path, request: dict) -> dict:
    """The record of one point run as the server runs it: a child process (`profiler.run_point`), so an
    emulated memory limit (RLIMIT_AS on a CPU) stays in that process."""
    out = tmp_path / "point.json"
    subprocess.run([sys.executable, "-m", "profiler.run_point", "--request", json.dumps(request), "--out", str(out)],
                   check=True, timeout=120)  # fmt: skip
    return json.loads(out.read_text())


def test_a_real_compute_point_and_an_out_of_memory_point_meet_the_contract(tmp_path):
    pytest.importorskip("torch")
    from profiler.measure import profile_point

    request = {"model": "small_cnn", "dataset": IMAGES, "batch_size": 8, **FAST}
    point = parse_measurement(profile_point(request))
    assert isinstance(point, ComputeMeasurement) and point.ok, point.error
    assert point.gradient is not None and point.gradient.batch == 8 and point.model.gradient_bytes > 0
    assert point.host_load is not None
    # As tests/test_profiler.py's real out-of-memory: 4096 images of 32 x 32 need ~1.4 GB of activations,
    # the child may use 256 MiB beyond its start (a far smaller limit can fail inside oneDNN instead).
    images_32 = {"name": "synthetic_images", "channels": 3, "image_size": 32, "num_classes": 10, "num_samples": 8192}
    limited = {**request, "dataset": images_32, "batch_size": 4096, "memory_limit_bytes": 256 * 2**20}
    too_small = parse_measurement(run_point(tmp_path, limited))
    assert too_small.status == "oom" and too_small.iter_time is None, too_small


def test_a_real_pilot_meets_the_contract():
    pytest.importorskip("torch")
    from profiler.pilot import run_pilot

    request = {"model": "small_cnn", "dataset": IMAGES, "batch_size": 16, "device": "cpu", "threads": 1,
               "pilot_steps": 20, "pilot_record_every": 5, "lr": 0.05}  # fmt: skip
    pilot = parse_measurement(run_pilot(request))
    assert isinstance(pilot, PilotMeasurement) and pilot.ok, pilot.error
    assert len(pilot.trajectory) >= 2 and pilot.trajectory[-1].batch == 16


def test_a_real_all_reduce_benchmark_meets_the_contract():
    pytest.importorskip("torch")
    from profiler.comm import CommPolicy, measure_all_reduce

    quick = CommPolicy(warmup_iters=1, min_iters=3, max_iters=5, seconds_per_size=0.02)
    comm = parse_measurement(measure_all_reduce(16 * 1024, world_sizes=[2], backend="gloo", policy=quick, timeout_s=60))
    assert isinstance(comm, CommMeasurement) and comm.ok, comm.error
    assert comm.backend == "gloo" and {p.world_size for p in comm.points} == {2}


def test_a_point_whose_model_fails_is_a_failed_record_of_the_contract(tmp_path):
    pytest.importorskip("torch")
    failed = parse_measurement(run_point(tmp_path, {"model": "no_such_model", "dataset": IMAGES, "batch_size": 8, **FAST}))
    assert failed.status == "failed" and "no_such_model" in failed.error
