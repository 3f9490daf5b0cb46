"""The HTTP contract on both databases: problem+json errors, idempotent submission, listing with
filters and pages, a job's points a page at a time, cancel, delete, measurements, readiness and metrics. Real servers (API only:
`--executor none`, so nothing is profiled), real SQLite files and a real PostgreSQL server."""

import uuid

import httpx
import pytest

from tests.api_fixtures import finished_job, store_for
from tests.handmade import spec_dict
from tula_service.store.db import make_engine, make_session_factory
from tula_service.store.migrate import head_revision
from tula_service.store.states import JOB_STATES
from tula_service.store.tokens import create_token

PROBLEM = "application/problem+json"


@pytest.fixture
def api(make_server, database_url):
    server = make_server("--executor", "none", database_url=database_url)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        client.database_url = database_url
        yield client


def _submit(api, **overrides) -> dict:
    response = api.post("/v1/jobs", json=spec_dict(**overrides))
    assert response.status_code == 202, response.text
    return response.json()


def test_unknown_job_is_a_404_problem(api):
    response = api.get("/v1/jobs/nope")
    assert response.status_code == 404 and response.headers["content-type"] == PROBLEM
    assert response.json() == {
        "type": "https://tula.dev/problems/not-found", "title": "Not Found", "status": 404,
        "detail": "job 'nope' not found", "instance": "/v1/jobs/nope",
    }  # fmt: skip


def test_a_bad_spec_is_a_422_problem_naming_each_field(api):
    bad = spec_dict(pricing={"kind": "gpu_hour", "price": -1}, batch_sizes=[8, 0])
    response = api.post("/v1/jobs", json=bad)
    assert response.status_code == 422 and response.headers["content-type"] == PROBLEM
    problem = response.json()
    fields = {e["field"] for e in problem["errors"]}
    assert {"body.pricing.price", "body.batch_sizes.1"} <= fields
    assert problem["type"].endswith("/validation-error") and "body.pricing.price" in problem["detail"]


def test_a_body_over_the_size_limit_is_a_413_problem(api):
    response = api.post("/v1/jobs", content=b"[" + b"1," * 600_000 + b"1]", headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.headers["content-type"] == PROBLEM
    assert "limit" in response.json()["detail"]


def test_a_retried_submission_with_the_same_idempotency_key_returns_the_same_job(api):
    key = str(uuid.uuid4())
    first = api.post("/v1/jobs", json=spec_dict(), headers={"Idempotency-Key": key})
    again = api.post("/v1/jobs", json=spec_dict(), headers={"Idempotency-Key": key})
    assert first.status_code == 202 and again.status_code == 200
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    assert api.get("/v1/jobs").json()["total"] == 1


def test_an_idempotency_key_reused_for_another_spec_is_refused(api):
    key = str(uuid.uuid4())
    api.post("/v1/jobs", json=spec_dict(), headers={"Idempotency-Key": key})
    response = api.post("/v1/jobs", json=spec_dict(objective="min_cost"), headers={"Idempotency-Key": key})
    assert response.status_code == 422
    assert response.json()["errors"][0]["field"] == "header.Idempotency-Key"
    too_long = api.post("/v1/jobs", json=spec_dict(), headers={"Idempotency-Key": "k" * 300})
    assert too_long.status_code == 422


def test_jobs_are_listed_by_state_a_page_at_a_time(api):
    ids = [_submit(api, name=f"job{i}")["id"] for i in range(5)]
    for job_id in ids[:2]:
        assert api.post(f"/v1/jobs/{job_id}/cancel").json()["state"] == "cancelled"
    cancelled = api.get("/v1/jobs", params={"state": "cancelled"}).json()
    assert cancelled["total"] == 2 and {j["id"] for j in cancelled["jobs"]} == set(ids[:2])
    both = api.get("/v1/jobs", params=[("state", "queued"), ("state", "cancelled")]).json()
    assert both["total"] == 5
    seen, offset = [], 0
    while offset is not None:
        page = api.get("/v1/jobs", params={"limit": 2, "offset": offset}).json()
        assert len(page["jobs"]) <= 2 and page["total"] == 5
        seen += [j["id"] for j in page["jobs"]]
        offset = page["next_offset"]
    assert sorted(seen) == sorted(ids)


def test_the_state_filter_is_an_enum_of_the_job_states(api):
    parameter = next(p for p in api.get("/openapi.json").json()["paths"]["/v1/jobs"]["get"]["parameters"]
                     if p["name"] == "state")
    assert parameter["schema"]["type"] == "array" and parameter["schema"]["items"]["enum"] == list(JOB_STATES)
    for unknown in ("running", "queued,cancelled"):  # a comma-separated list is one unknown state
        response = api.get("/v1/jobs", params=[("state", "done"), ("state", unknown)])
        assert response.status_code == 422 and response.headers["content-type"] == PROBLEM
        (error,) = response.json()["errors"]
        assert error["field"] == "query.state.1" and "'cancelled'" in error["message"], error


def test_the_job_list_gives_counts_not_points_or_specs(api):
    job_id = finished_job(store_for(api.database_url), batch_sizes=[8, 16, 32])
    listed = next(j for j in api.get("/v1/jobs").json()["jobs"] if j["id"] == job_id)
    assert "points" not in listed and "spec" not in listed
    assert listed["progress"]["points_done"] == listed["progress"]["points_total"] >= 3
    assert listed["cluster"] == {"nodes": 1, "gpus_per_node": 1, "gpu_type": None, "device_memory_gib": 16.0}
    assert listed["chosen"]["global_batch"] >= 8
    one = api.get(f"/v1/jobs/{job_id}").json()
    assert len(one["points"]) == listed["progress"]["points_total"] and one["spec"]["model"] == listed["model"]


def test_a_jobs_points_come_a_page_at_a_time_as_the_job_view_embeds_them(api):
    job_id = finished_job(store_for(api.database_url), batch_sizes=[8, 16, 32])
    embedded = api.get(f"/v1/jobs/{job_id}").json()["points"]
    first = api.get(f"/v1/jobs/{job_id}/points", params={"limit": 2}).json()
    assert (first["job_id"], first["total"], first["limit"], first["offset"], first["next_offset"]) == (job_id, 3, 2, 0, 2)
    last = api.get(f"/v1/jobs/{job_id}/points", params={"limit": 2, "offset": first["next_offset"]}).json()
    assert last["next_offset"] is None and len(last["points"]) == 1
    assert first["points"] + last["points"] == embedded and [p["batch_size"] for p in embedded] == [8, 16, 32]
    assert "measurement" not in embedded[0]
    assert api.get(f"/v1/jobs/{job_id}/points", params={"offset": 3}).json()["points"] == []
    assert api.get(f"/v1/jobs/{job_id}/points", params={"limit": 501}).status_code == 422


def test_the_points_of_an_unknown_job_are_a_404_problem(api):
    response = api.get("/v1/jobs/nope/points")
    assert response.status_code == 404 and response.headers["content-type"] == PROBLEM
    assert response.json()["detail"] == "job 'nope' not found"


def test_a_job_without_its_points_has_its_spec_and_progress_for_polling(api):
    job_id = finished_job(store_for(api.database_url), batch_sizes=[8, 16, 32])
    full = api.get(f"/v1/jobs/{job_id}").json()
    detail = api.get(f"/v1/jobs/{job_id}", params={"points": "false"}).json()
    assert "points" not in detail and detail == {k: v for k, v in full.items() if k != "points"}
    assert detail["progress"]["points_done"] == 3 and detail["links"]["points"] == f"/v1/jobs/{job_id}/points"
    assert api.get("/v1/jobs/nope", params={"points": "false"}).status_code == 404


def test_the_points_need_a_token_as_every_read_does_unless_reads_are_public(make_server, tmp_path):
    database_url = f"sqlite:///{tmp_path / 'tula.db'}"
    job_id = finished_job(store_for(database_url))
    _, token = create_token(make_session_factory(make_engine(database_url)), "ci")
    path = f"/v1/jobs/{job_id}/points"
    private = make_server("--executor", "none", database_path=tmp_path / "tula.db")
    refused = httpx.get(private.url + path, timeout=30)
    assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
    assert httpx.get(private.url + path, headers={"Authorization": f"Bearer {token}"}, timeout=30).status_code == 200
    public = make_server("--executor", "none", "--public-reads", database_path=tmp_path / "tula.db")
    assert httpx.get(public.url + path, timeout=30).status_code == 200


def test_a_cancelled_job_stops_and_has_no_recommendation(api):
    job = _submit(api)
    cancelled = api.post(f"/v1/jobs/{job['id']}/cancel").json()
    assert cancelled["state"] == "cancelled" and cancelled["finished_at"]
    assert {p["state"] for p in cancelled["points"]} == {"cancelled"}
    assert api.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200  # idempotent
    response = api.get(f"/v1/jobs/{job['id']}/recommendation")
    assert response.status_code == 409 and "cancelled" in response.json()["detail"]


def test_a_done_job_cannot_be_cancelled_but_can_be_replanned_and_deleted(api):
    job_id = finished_job(store_for(api.database_url))
    assert api.get(f"/v1/jobs/{job_id}").json()["state"] == "done"
    assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 409
    what_if = api.post(f"/v1/jobs/{job_id}/plan", json={"cluster": {"nodes": 4}, "objective": "min_time"})
    assert what_if.status_code == 200 and what_if.json()["objective"] == "min_time"
    assert api.delete(f"/v1/jobs/{job_id}").status_code == 204
    assert api.get(f"/v1/jobs/{job_id}").status_code == 404
    assert api.get(f"/v1/jobs/{job_id}/measurements").status_code == 404


def test_measurements_list_every_point_with_its_record(api):
    job_id = finished_job(store_for(api.database_url), batch_sizes=[8, 16, 32])
    points = api.get(f"/v1/jobs/{job_id}/measurements").json()["points"]
    assert [p["batch_size"] for p in points] == [8, 16, 32]
    assert all(p["state"] == "done" and p["attempts"] == 1 and p["worker"] == "handmade" for p in points)
    assert points[0]["measurement"]["memory"]["peak_bytes"] > 0


def test_what_if_before_the_job_is_done_is_a_409(api):
    job = _submit(api)
    assert api.post(f"/v1/jobs/{job['id']}/plan", json={"objective": "min_cost"}).status_code == 409
    bad = api.post(f"/v1/jobs/{job['id']}/plan", json={"objective": "fastest"})
    assert bad.status_code in (409, 422)


def test_readiness_reports_the_database_and_the_schema(api):
    ready = api.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"]["database"] == "ok" and ready.json()["checks"]["schema"] == head_revision()


def test_metrics_count_jobs_by_state_and_the_queue(api):
    _submit(api, batch_sizes=[8, 16])
    job = _submit(api, batch_sizes=[8, 16, 32])
    api.post(f"/v1/jobs/{job['id']}/cancel")
    text = api.get("/metrics").text
    assert 'tula_jobs{state="queued"} 1.0' in text and 'tula_jobs{state="cancelled"} 1.0' in text
    assert "tula_queue_depth_points 2.0" in text
    assert "# TYPE tula_point_duration_seconds histogram" in text


def test_the_openapi_schema_lists_every_endpoint(api):
    paths = api.get("/openapi.json").json()["paths"]
    for path in ("/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/points", "/v1/jobs/{job_id}/cancel",
                 "/v1/jobs/{job_id}/measurements", "/v1/jobs/{job_id}/recommendation", "/v1/jobs/{job_id}/plan",
                 "/v1/catalog/models", "/healthz", "/readyz", "/metrics"):
        assert path in paths, path
    assert "delete" in paths["/v1/jobs/{job_id}"]
    points = paths["/v1/jobs/{job_id}/points"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert points == {"$ref": "#/components/schemas/PointList"}


def test_the_gpu_catalog_lists_memory_price_and_link(api):
    gpus = {g["name"]: g for g in api.get("/v1/catalog/gpus").json()["gpus"]}
    assert {"h100_sxm", "a100_80gb_sxm", "h200"} <= set(gpus)
    h100 = gpus["h100_sxm"]
    assert h100["memory_gib"] > 79 and h100["default_price_usd_per_hour"] > 0 and h100["intra_node_link"] == "nvlink4"
    assert h100["source"] == "catalog-assumed"
