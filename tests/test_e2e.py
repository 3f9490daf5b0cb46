"""A real uvicorn server on a free port, real profiling child processes, a real SQLite file."""

import httpx
import pytest

from tests.conftest import REPO
from tula_service.client import TulaClient
from tula_service.spec.specfile import load_spec_file

pytestmark = pytest.mark.e2e

EXAMPLE = REPO / "configs" / "example_small_cnn.yaml"


@pytest.fixture(scope="module")
def finished_job(live_server):
    spec = load_spec_file(EXAMPLE)
    response = httpx.post(f"{live_server.url}/v1/jobs", json=spec, timeout=30)
    assert response.status_code == 202
    job = response.json()
    assert response.headers["location"] == f"/v1/jobs/{job['id']}"
    # five batch sizes and, for the 8-device cluster, one all-reduce benchmark
    assert job["state"] == "queued"
    assert (job["progress"]["points_done"], job["progress"]["points_total"], job["progress"]["points_failed"]) == (0, 6, 0)
    with TulaClient(live_server.url) as client:
        final = client.wait(job["id"], poll_s=0.5, timeout_s=600)
        return final.model_dump(mode="json"), client.recommendation(job["id"]), spec


def test_job_finishes_with_every_point_measured(finished_job):
    job, _, _ = finished_job
    assert job["state"] == "done", job["error"]
    progress = job["progress"]
    retimed = sum(p["kind"] == "retime" for p in job["points"])  # noisy points timed again (tula_service.dispatch.reliability)
    assert (progress["points_total"], progress["points_failed"], progress["points_retried"], progress["step"]) == (6 + retimed, 0, 0, "done")
    assert progress["points_done"] == progress["points_measured"] == progress["points_total"]
    assert [p["batch_size"] for p in job["points"] if p["kind"] == "grid"] == [8, 16, 32, 64, 128]
    assert [p["kind"] for p in job["points"]].count("comm") == 1


def test_all_reduce_benchmark_is_reported_next_to_the_spec_bandwidth(finished_job):
    _, rec, _ = finished_job
    network = rec["models"]["network"]
    assert network["measured_link"]["backend"] == "gloo" and network["measured_link"]["bandwidth_gbps"] > 0
    assert network["intra_node"]["bandwidth_gbps"]["source"] == "spec"


def test_noise_scale_was_measured_and_every_point_is_summarized(finished_job):
    _, rec, _ = finished_job
    assert rec["models"]["efficiency"]["source"] == "fitted"
    assert rec["models"]["efficiency"]["noise_scale"]["value"] > 0
    assert [p["batch_size"] for p in rec["profiled"]["points"]] == [8, 16, 32, 64, 128]


def test_measured_memory_grows_with_batch_size(finished_job):
    _, rec, _ = finished_job
    measured = {
        row["device_batch"]: row["memory_bytes"]["value"]
        for row in rec["candidates"]
        if row["memory_bytes"]["source"] == "measured"
    }
    assert sorted(measured) == [8, 16, 32, 64, 128]
    values = [measured[b] for b in sorted(measured)]
    assert all(a < b for a, b in zip(values, values[1:]))
    assert rec["models"]["memory"]["r2"] > 0.999


def test_knee_lies_inside_the_profiled_range_and_on_the_front(finished_job):
    _, rec, spec = finished_job
    chosen = rec["chosen"]
    assert rec["objective"] == "knee" and rec["knee"]["global_batch"] == chosen["global_batch"]
    assert spec["batch_sizes"]["min"] <= chosen["device_batch"] <= spec["batch_sizes"]["max"]
    assert chosen["pareto"]


def test_every_candidate_has_a_time_and_a_cost(finished_job):
    _, rec, _ = finished_job
    # device batches x placements of the 2 x 4 cluster (1, 2, 4, 8 packed; 2 and 4 spread over both nodes) x accumulation
    assert len(rec["candidates"]) == 5 * 6 * 4
    assert {tuple(row["placement"]) for row in rec["candidates"]} == {(1,), (2,), (4,), (4, 4), (1, 1), (2, 2)}
    for row in rec["candidates"]:
        assert row["total_time_s"]["value"] > 0 and row["cost_usd"]["value"] > 0


def test_job_list_shows_the_job_and_its_choice(live_server, finished_job):
    job, rec, _ = finished_job
    listed = httpx.get(f"{live_server.url}/v1/jobs").json()
    mine = [j for j in listed["jobs"] if j["id"] == job["id"]][0]
    assert mine["chosen"]["global_batch"] == rec["chosen"]["global_batch"]


def test_bad_spec_is_422_with_the_field_path(live_server):
    spec = load_spec_file(EXAMPLE)
    spec["batch_sizes"] = [8, 0]
    spec["pricing"]["price"] = -1
    response = httpx.post(f"{live_server.url}/v1/jobs", json=spec)
    assert response.status_code == 422
    fields = {error["field"] for error in response.json()["errors"]}
    assert "body.batch_sizes.1" in fields and "body.pricing.price" in fields


def test_unknown_model_is_422_listing_the_catalog(live_server):
    spec = {**load_spec_file(EXAMPLE), "model": "resnet5"}
    response = httpx.post(f"{live_server.url}/v1/jobs", json=spec)
    assert response.status_code == 422
    message = response.json()["errors"][0]["message"]
    assert "'resnet5' is not in the catalog; did you mean" in message and "small_cnn" in message


def test_unknown_job_is_404(live_server):
    assert httpx.get(f"{live_server.url}/v1/jobs/nope").status_code == 404
    assert httpx.get(f"{live_server.url}/v1/jobs/nope/recommendation").status_code == 404


def test_recommendation_of_an_unfinished_job_is_409_with_progress(make_server):
    server = make_server()  # its own server, so the job is certainly still queued or profiling
    spec = load_spec_file(EXAMPLE)
    job = httpx.post(f"{server.url}/v1/jobs", json=spec).json()
    response = httpx.get(f"{server.url}/v1/jobs/{job['id']}/recommendation")
    assert response.status_code == 409 and "/6 points" in response.json()["detail"]


def test_first_start_on_an_empty_database_submits_the_example(make_server):
    server = make_server("--seed-example", str(EXAMPLE))
    jobs = httpx.get(f"{server.url}/v1/jobs").json()
    assert jobs["total"] == 1 and jobs["jobs"][0]["name"] == "small-cnn-example"
