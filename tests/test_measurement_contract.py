"""The profiler's records against the typed contract the service reads (tula_service.measurement): real
torch runs on CPU (a compute point, an out-of-memory point, a pilot, a gloo all-reduce, a point whose
model fails), and the hand-made records the other tests use, so that neither drifts from the contract."""

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from tests.handmade import comm_record, measurement, oom, spec_dict
from tula_service.dispatch.dispatcher import run_child
from tula_service.dispatch.jobs import _predicted_max_batch
from tula_service.measurement import (
    CommMeasurement,
    ComputeMeasurement,
    PilotMeasurement,
    SourcedValue,
    parse_measurement,
)
from tula_service.plan.recommend import plan, usable_measurements
from tula_service.spec.job_spec import JobSpec

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
    with pytest.raises(ValueError, match="unknown measurement kind 'epoch'"):
        parse_measurement({"kind": "epoch", "status": "ok"})
    with pytest.raises(ValidationError, match="step_time_s"):
        parse_measurement({"kind": "step", "status": "ok", "placement": [2], "device_batch": 8})


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


# The service reads the contract's attributes (tula_service.plan.recommend, reliability, jobs, dispatch).


def test_the_gradient_summary_and_the_host_load_a_point_shows_are_typed_fields():
    record = measurement(16)
    record["gradient"].update(noise_scale=120.0, variability_median=0.2)
    record["host_load"] = {"contended": True, "load_1m": 9.5}
    point = parse_measurement(record)
    assert (point.gradient.noise_scale, point.gradient.variability_median, point.host_contended) == (120.0, 0.2, True)
    assert parse_measurement(measurement(16)).host_contended is None  # the record does not say


def test_a_byte_count_written_as_an_integer_stays_one_in_the_recommendation():
    records = [measurement(b, static_bytes=100_000_000, act_bytes_per_sample=1_000_000) for b in (8, 16, 32, 64)]
    points = plan(JobSpec.model_validate(spec_dict(batch_sizes=[8, 16, 32, 64])), records)["profiled"]["points"]
    assert [p["peak_bytes"] for p in points] == [r["memory"]["peak_bytes"] for r in records]
    assert all(type(p["peak_bytes"]) is int and type(p["activation_bytes"]) is int for p in points)
    assert type(parse_measurement(measurement(8)).memory.peak_bytes) is float  # and a float stays a float


def test_usable_measurements_hands_back_the_records_it_was_given():
    records = [measurement(8), oom(64), comm_record("gloo", 1e-5, 10), measurement(16)]
    ok, oom_batches = usable_measurements(records)
    assert ok == [records[0], records[3]] and oom_batches == [64]
    parsed, _ = usable_measurements([parse_measurement(r) for r in records])
    assert all(isinstance(p, ComputeMeasurement) for p in parsed) and [p.batch_size for p in parsed] == [8, 16]


def test_a_record_that_breaks_the_contract_fails_its_point_with_the_field_named():
    """A real child writes an 'ok' record without its timing: the point fails with its own error (not
    retried, and not a fit that fails later on a missing key), and the record is kept as it came."""
    broken = measurement(16)
    del broken["iter_time"]
    write = f"import json, sys; open(sys.argv[-1], 'w').write(json.dumps({broken!r}))"
    outcome = run_child([sys.executable, "-c", write], 60)
    assert outcome.state == "failed" and not outcome.worker_died
    assert "measurement contract" in outcome.error and "iter_time" in outcome.error
    assert outcome.measurement == broken


def test_the_max_batch_search_predicts_with_the_plans_memory_model():
    spec = JobSpec.model_validate(spec_dict(batch_sizes=[8, 16, 32, 64], profiling={"memory_limit_gib": 0.25}))
    records = [measurement(b) for b in (8, 16, 32, 64)]
    for index, record in enumerate(records):  # off the line, so the fit is not read off one point
        record["memory"]["peak_bytes"] *= 1 + 0.02 * (-1) ** index
    memory = plan(spec, records)["models"]["memory"]
    ok, _ = usable_measurements([parse_measurement(r) for r in records])
    expected = int((0.25 * 2**30 - memory["static_bytes"]) // memory["act_bytes_per_sample"])
    assert _predicted_max_batch(spec, ok) == expected
