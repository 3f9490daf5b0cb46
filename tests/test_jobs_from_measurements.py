"""Jobs created from measurements taken anywhere (POST /v1/jobs/from-measurements): the supplied records
become done points of kind "given", only what they miss is profiled (profiling.profile "missing"), or
nothing ("none"); a job with nothing left to profile is planned at once, or refused with a 409 and
nothing stored."""

import json
import time

import httpx
import pytest

from tests.handmade import comm_record, measurement, oom, spec_dict
from tula_service.measurement import parse_measurement
from tula_service.spec.job_spec import JobSpec
from tula_service.spec.points_wanted import points_wanted

BATCHES = [8, 16, 32, 64, 128]
TWO_GPUS = {"nodes": 1, "gpus_per_node": 2, "device_memory_gib": 16, "interconnect_gbps": 100}


def _spec(**overrides) -> dict:
    return spec_dict(batch_sizes=BATCHES, **overrides)


def _post(server, body: dict, **headers) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/jobs/from-measurements", json=body, headers=headers, timeout=120)


def _points(server, job_id: str) -> list[dict]:
    return httpx.get(f"{server.url}/v1/jobs/{job_id}/points", timeout=10).json()["points"]


def _wanted(spec: dict, records: list[dict], profile: str = "missing") -> list:
    return [point[:2] for point in points_wanted(JobSpec.model_validate(spec), [parse_measurement(r) for r in records], profile)]


def test_only_the_points_the_measurements_miss_are_wanted():
    assert _wanted(_spec(), []) == [("grid", b) for b in BATCHES]
    assert _wanted(_spec(), [measurement(8), measurement(32), oom(128)]) == [("grid", 16), ("grid", 64)]
    two_gpus = _spec(cluster=TWO_GPUS)
    assert _wanted(two_gpus, [measurement(b) for b in BATCHES]) == [("comm", None)]
    assert _wanted(two_gpus, [measurement(b) for b in BATCHES] + [comm_record("gloo", 1e-4, 10)]) == []
    step = {"kind": "step", "placement": [2], "device_batch": 32, "step_time_s": 0.2}
    assert _wanted(two_gpus, [measurement(8), step]) == [("grid", b) for b in BATCHES[1:]]  # the step stands in for comm
    pilot = _spec(profiling={"pilot": True})
    assert ("pilot", 32) in _wanted(pilot, [measurement(8)])
    assert _wanted(_spec(), [measurement(8)], "none") == []
    steps = _spec(cluster=TWO_GPUS, profiling={"step_placements": [[2]]})
    assert points_wanted(JobSpec.model_validate(steps), [parse_measurement(measurement(b)) for b in BATCHES])[-1] == ("step", 32, [2])
    assert _wanted(steps, [measurement(b) for b in BATCHES], "none") == []


def test_complete_measurements_make_a_job_planned_at_once(api_only):
    records = [measurement(b) for b in BATCHES]
    response = _post(api_only, {"spec": _spec(), "measurements": records})
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["state"] == "done" and response.headers["location"] == f"/v1/jobs/{job['id']}"
    points = _points(api_only, job["id"])
    assert [(p["kind"], p["state"], p["worker"], p["batch_size"]) for p in points] == [("given", "done", "supplied", b) for b in BATCHES]
    recommendation = httpx.get(f"{api_only.url}/v1/jobs/{job['id']}/recommendation", timeout=10)
    assert recommendation.status_code == 200 and recommendation.json()["chosen"]["device_batch"] in BATCHES
    measurements = httpx.get(f"{api_only.url}/v1/jobs/{job['id']}/measurements", timeout=10).json()
    assert len(measurements["points"]) == len(BATCHES)


def test_partial_measurements_queue_only_the_missing_points(api_only):
    response = _post(api_only, {"spec": _spec(), "measurements": [measurement(8), measurement(32)]})
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["state"] == "queued"  # this server has no executor: the missing points wait
    kinds = sorted((p["kind"], p["state"], p["batch_size"]) for p in _points(api_only, job["id"]))
    assert kinds == [("given", "done", 8), ("given", "done", 32), ("grid", "queued", 16), ("grid", "queued", 64), ("grid", "queued", 128)]


def test_profile_none_with_too_little_is_a_409_and_nothing_is_stored(api_only):
    before = httpx.get(f"{api_only.url}/v1/jobs", timeout=10).json()["total"]
    response = _post(api_only, {"spec": _spec(), "measurements": [measurement(8)], "profile": "none"})
    assert response.status_code == 409, response.text
    assert "cannot plan these measurements" in response.json()["detail"]
    assert httpx.get(f"{api_only.url}/v1/jobs", timeout=10).json()["total"] == before


def test_profile_none_plans_a_csv_of_steps_alone(api_only):
    rows = "placement,local_bsz,step_time,sync_time\n" + "".join(f"1,{b},{0.01 + 0.001 * b},\n" for b in BATCHES)
    response = _post(api_only, {"spec": _spec(), "measurements_csv": rows, "profile": "none"})
    assert response.status_code == 202, response.text
    assert response.json()["state"] == "done"
    recommendation = httpx.get(f"{api_only.url}/v1/jobs/{response.json()['id']}/recommendation", timeout=10).json()
    assert recommendation["models"]["memory"]["source"] == "assumed"


def test_bad_input_is_a_422_naming_the_field(api_only):
    no_measurements = _post(api_only, {"spec": _spec(), "measurements": []})
    assert no_measurements.status_code == 422
    assert [e["field"] for e in no_measurements.json()["errors"]] == ["body.measurements"]
    bad_record = _post(api_only, {"spec": _spec(), "measurements": [measurement(8), {**measurement(16), "batch_size": 0}]})
    assert bad_record.status_code == 422
    assert "body.measurements.1.batch_size" in [e["field"] for e in bad_record.json()["errors"]]
    bad_spec = _post(api_only, {"spec": _spec(model="no_such_model"), "measurements": [measurement(8)]})
    assert bad_spec.status_code == 422 and bad_spec.json()["errors"][0]["field"].startswith("body.spec.model")
    bad_profile = _post(api_only, {"spec": _spec(), "measurements": [measurement(8)], "profile": "some"})
    assert bad_profile.status_code == 422 and [e["field"] for e in bad_profile.json()["errors"]] == ["body.profile"]


def test_a_retried_submission_returns_the_same_job_and_other_measurements_under_its_key_are_refused(api_only):
    body = {"spec": _spec(), "measurements": [measurement(8), measurement(16)]}
    first = _post(api_only, body, **{"Idempotency-Key": "from-measurements-1"})
    again = _post(api_only, body, **{"Idempotency-Key": "from-measurements-1"})
    assert first.status_code == 202 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"] and again.headers["idempotent-replayed"] == "true"
    other = _post(api_only, {**body, "measurements": [measurement(8), measurement(32)]}, **{"Idempotency-Key": "from-measurements-1"})
    assert other.status_code == 422 and other.json()["errors"][0]["field"] == "header.Idempotency-Key"


def _wait_done(server, job_id: str, timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = httpx.get(f"{server.url}/v1/jobs/{job_id}", timeout=10).json()
        if job["state"] in ("done", "failed", "cancelled"):
            return job
        time.sleep(0.5)
    pytest.fail(f"job {job_id} did not finish within {timeout_s} s")


def test_a_real_executor_profiles_only_the_missing_batch(make_server):
    server = make_server()
    spec = _spec(profiling={"timed_iters": 3, "warmup_iters": 1, "time_cap_s": 2, "grad_iters": 2})
    response = _post(server, {"spec": spec, "measurements": [measurement(b) for b in BATCHES[:-1]]})
    assert response.status_code == 202, response.text
    job = _wait_done(server, response.json()["id"])
    assert job["state"] == "done", job
    profiled = [p for p in _points(server, job["id"]) if p["kind"] != "given"]
    assert profiled[0]["kind"] == "grid" and all(p["worker"].startswith("local:") for p in profiled)
    # the supplied batches are never timed again; the profiled one may be, when it is noisy or off the line
    assert {(p["kind"], p["batch_size"], p["state"]) for p in profiled} <= {("grid", 128, "done"), ("retime", 128, "done")}


def test_tula_submit_with_measurements_starts_the_job_from_them(api_only, tmp_path):
    import json

    import yaml

    from tests.test_cli import tula

    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(_spec()))
    compute = tmp_path / "compute.jsonl"
    compute.write_text("".join(json.dumps(measurement(b)) + "\n" for b in BATCHES))
    done = tula("submit", str(spec_path), "--server", api_only.url, "--measurements", str(compute), "--profile", "none", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["state"] == "done"
    assert f"{len(BATCHES)} supplied, 0 points to profile (done)" in done.stderr
    two = tmp_path / "two.jsonl"
    two.write_text("".join(json.dumps(measurement(b)) + "\n" for b in BATCHES[:2]))
    queued = tula("submit", str(spec_path), "--server", api_only.url, "--measurements", str(two))
    assert queued.returncode == 0 and "2 supplied, 3 points to profile" in queued.stdout
    refused = tula("submit", str(spec_path), "--server", api_only.url, "--profile", "none")
    assert refused.returncode == 2 and "give --measurements FILE" in refused.stderr


@pytest.mark.e2e
def test_a_record_with_nan_and_infinity_is_stored_without_them_and_planned(make_server, database_url):
    """Python's json reads NaN and Infinity, PostgreSQL's json refuses them: the records keep None in their place,
    listed under nonfinite_fields, and the points whose |G|^2 overflowed are left out of the noise scale."""
    server = make_server(database_url=database_url)
    records = [measurement(b) for b in BATCHES]
    records[3]["gradient"]["true_grad_sq_norm"], records[4]["gradient"]["trace_sigma"] = "@nan", "@inf"
    body = json.dumps({"spec": _spec(), "measurements": records}).replace('"@nan"', "NaN").replace('"@inf"', "Infinity")
    response = httpx.post(f"{server.url}/v1/jobs/from-measurements", content=body, headers={"Content-Type": "application/json"}, timeout=120)
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    stored = httpx.get(f"{server.url}/v1/jobs/{job_id}/measurements", timeout=10).json()["points"]
    assert [p["measurement"].get("nonfinite_fields") for p in stored] == [None, None, None, ["gradient.true_grad_sq_norm"], ["gradient.trace_sigma"]]
    efficiency = httpx.get(f"{server.url}/v1/jobs/{job_id}/recommendation", timeout=10).json()["models"]["efficiency"]
    assert efficiency["noise_scale"]["evidence"] == "initialization" and efficiency["noise_scale"]["value"] == pytest.approx(100.0)
    assert any("batch 64, 128 were not finite" in warning for warning in efficiency["warnings"])
