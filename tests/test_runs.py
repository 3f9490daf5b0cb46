"""Runs on a real server and a real SQLite file: started from a done job's recommendation, fed telemetry
(idempotent by step, ordered, bounded), re-planned from it with hysteresis and a rate limit, and durable
across a restart."""

import httpx
import pytest

from benchmarks.live_server import plan_answers
from tests.api_fixtures import finished_job, store_for
from tests.handmade import spec_dict
from tula_service.store import run_store

NUM_SAMPLES = 50_000  # the hand-made spec's dataset
REFERENCE_EPOCHS = 10


def _records(first: int, last: int, global_batch: int, trace_sigma: float, **extra) -> list[dict]:
    """Steps first..last of a run whose noise scale is trace_sigma / 1.0, timed at 0.05 s a step, its loss falling (a run
    that learns: a flat loss is a plateau, which keeps the LR at the reference, efficiency_evidence.plateau_cap)."""
    return [{"step": s, "samples": s * global_batch, "grad_sqr": 1.0, "trace_sigma": trace_sigma, "variability": 0.2,
             "step_time_s": 0.05, "loss": 2.0 / (1 + s * 1e-2), **extra} for s in range(first, last + 1)]  # fmt: skip


@pytest.fixture
def server_and_job(make_server, tmp_path):
    database = tmp_path / "runs.db"
    job_id = finished_job(store_for(f"sqlite:///{database}"))
    return make_server("--executor", "none", database_path=database), job_id, database


def _post(server, path: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def test_a_run_starts_at_the_recommendation_and_a_retry_returns_it(server_and_job):
    server, job_id, _ = server_and_job
    recommendation = httpx.get(f"{server.url}/v1/jobs/{job_id}/recommendation", timeout=10).json()
    first = _post(server, "/v1/runs", {"job_id": job_id}, **{"Idempotency-Key": "run-1"})
    assert first.status_code == 201, first.text
    run = first.json()
    chosen = recommendation["chosen"]
    assert {k: run["config"][k] for k in ("device_batch", "accumulation", "global_batch", "placement")} == {
        k: chosen[k] for k in ("device_batch", "accumulation", "global_batch", "placement")}
    assert run["config"]["source"] == "recommendation" and run["records"] == 0 and first.headers["location"] == f"/v1/runs/{run['id']}"
    again = _post(server, "/v1/runs", {"job_id": job_id}, **{"Idempotency-Key": "run-1"})
    assert again.status_code == 200 and again.json()["id"] == run["id"] and again.headers["idempotent-replayed"] == "true"
    other = _post(server, "/v1/runs", {"job_id": job_id, "hysteresis": 0.2}, **{"Idempotency-Key": "run-1"})
    assert other.status_code == 422 and other.json()["errors"][0]["field"] == "header.Idempotency-Key"


def test_telemetry_is_stored_once_per_step_in_step_order(server_and_job):
    server, job_id, database = server_and_job
    run = _post(server, "/v1/runs", {"job_id": job_id}).json()
    batch = run["config"]["global_batch"]
    late, early = _records(11, 20, batch, 100.0), _records(1, 10, batch, 100.0)
    assert _post(server, f"/v1/runs/{run['id']}/telemetry", {"records": late}).json() == {"accepted": 10, "duplicates": 0, "records": 10, "last_step": 20}
    receipt = _post(server, f"/v1/runs/{run['id']}/telemetry", {"records": early + late[:3]}).json()  # a re-send with new ones
    assert receipt == {"accepted": 10, "duplicates": 3, "records": 20, "last_step": 20}
    stored = run_store.telemetry(store_for(f"sqlite:///{database}"), run["id"])
    assert [r["step"] for r in stored] == list(range(1, 21))
    page = httpx.get(f"{server.url}/v1/runs/{run['id']}/telemetry", params={"limit": 15, "offset": 10}, timeout=10).json()
    assert [r["step"] for r in page["records"]] == list(range(11, 21)) and page["total"] == 20 and page["next_offset"] is None
    first = httpx.get(f"{server.url}/v1/runs/{run['id']}/telemetry", params={"limit": 5}, timeout=10).json()
    assert [r["step"] for r in first["records"]] == [1, 2, 3, 4, 5] and first["next_offset"] == 5


def test_bad_telemetry_and_unknown_runs_are_clear_errors(server_and_job, tmp_path):
    server, job_id, _ = server_and_job
    run = _post(server, "/v1/runs", {"job_id": job_id}).json()
    bad = _post(server, f"/v1/runs/{run['id']}/telemetry", {"records": [{"step": -1}, {"step": 2, "step_time_s": 0}]})
    assert bad.status_code == 422
    assert {e["field"] for e in bad.json()["errors"]} == {"body.records.0.step", "body.records.1.step_time_s"}
    assert _post(server, f"/v1/runs/{run['id']}/telemetry", {"records": []}).status_code == 422
    assert _post(server, "/v1/runs/nope/telemetry", {"records": [{"step": 1}]}).status_code == 404
    assert httpx.get(f"{server.url}/v1/runs/nope/plan", timeout=10).status_code == 404
    assert _post(server, "/v1/runs", {"job_id": "nope"}).status_code == 404
    queued = _post(server, "/v1/jobs", spec_dict()).json()
    not_done = _post(server, "/v1/runs", {"job_id": queued["id"]})
    assert not_done.status_code == 409 and "done job" in not_done.json()["detail"]


def test_a_larger_live_noise_scale_moves_the_run_to_a_larger_batch_once(server_and_job):
    server, job_id, _ = server_and_job
    run = _post(server, "/v1/runs", {"job_id": job_id, "min_steps_between_changes": 100}).json()
    start = run["config"]
    path = f"/v1/runs/{run['id']}"
    # the same noise scale as profiled (|G|^2 1, tr(Sigma) 100): nothing to change
    _post(server, f"{path}/telemetry", {"records": _records(1, 40, start["global_batch"], 100.0)})
    same = httpx.get(f"{server.url}{path}/plan", timeout=60).json()
    assert same["changed"] is False and same["config"]["global_batch"] == start["global_batch"], same["why"]
    assert same["evidence"]["gradient_records"] == 40 and same["evidence"]["noise_scale"]["value"] == pytest.approx(100.0, rel=0.05)
    # the noise scale grows 50x as training goes on: a larger batch is faster to the target, but not before the rate limit allows
    _post(server, f"{path}/telemetry", {"records": _records(41, 60, start["global_batch"], 5000.0)})
    early = httpx.get(f"{server.url}{path}/plan", timeout=60).json()
    assert early["changed"] is False and "steps since the last change" in early["why"], early["why"]
    _post(server, f"{path}/telemetry", {"records": _records(61, 200, start["global_batch"], 5000.0)})
    moved = httpx.get(f"{server.url}{path}/plan", timeout=60).json()
    assert moved["changed"] is True, moved["why"]
    assert moved["config"]["global_batch"] > start["global_batch"] and moved["config"]["source"] == "live"
    assert moved["predicted"]["gain"] >= 0.05 and moved["config"]["lr_relative_to_current"] > 1
    assert moved["decisions"][-1]["from"]["global_batch"] == start["global_batch"] and moved["decisions"][-1]["step"] == 200
    steady = httpx.get(f"{server.url}{path}/plan", timeout=60).json()  # asked again: no new evidence, no change
    assert steady["changed"] is False and steady["config"] == moved["config"] and len(steady["decisions"]) == 1


def test_a_plan_asked_again_before_new_evidence_is_not_computed_again(server_and_job):
    server, job_id, _ = server_and_job
    run = _post(server, "/v1/runs", {"job_id": job_id, "min_steps_between_changes": 0}).json()
    path = f"{server.url}/v1/runs/{run['id']}/plan"
    _post(server, f"/v1/runs/{run['id']}/telemetry", {"records": _records(1, 40, run["config"]["global_batch"], 100.0)})
    first = httpx.get(path, timeout=60)
    assert first.status_code == 200 and first.json()["changed"] is False and first.headers["cache-control"] == "no-cache"
    etag = first.headers["etag"]
    again = httpx.get(path, timeout=60)  # no ETag sent: the same answer, kept
    assert again.status_code == 200 and again.json() == first.json() and again.headers["etag"] == etag
    not_modified = httpx.get(path, headers={"If-None-Match": f'"other", W/{etag}'}, timeout=60)
    assert not_modified.status_code == 304 and not_modified.content == b"" and not_modified.headers["etag"] == etag
    assert plan_answers(server.url) == {"computed": 1.0, "cached": 1.0, "not_modified": 1.0}
    # new evidence (the noise scale grows 50x): a new version, re-planned, and the run moves
    _post(server, f"/v1/runs/{run['id']}/telemetry", {"records": _records(41, 200, run["config"]["global_batch"], 5000.0)})
    moved = httpx.get(path, headers={"If-None-Match": etag}, timeout=60)
    assert moved.status_code == 200 and moved.json()["changed"] is True and "etag" not in moved.headers, moved.text
    # the move made the run a new version: its own answer is computed once, says changed: false, and is then kept
    settled = httpx.get(path, timeout=60)
    assert settled.json()["changed"] is False and settled.json()["config"] == moved.json()["config"]
    assert settled.headers["etag"] not in (etag, None)
    assert httpx.get(path, headers={"If-None-Match": settled.headers["etag"]}, timeout=60).status_code == 304
    assert plan_answers(server.url) == {"computed": 3.0, "cached": 1.0, "not_modified": 2.0}


def test_a_run_and_its_decisions_survive_a_restart(server_and_job, make_server):
    server, job_id, database = server_and_job
    run = _post(server, "/v1/runs", {"job_id": job_id, "min_steps_between_changes": 0}).json()
    _post(server, f"/v1/runs/{run['id']}/telemetry", {"records": _records(1, 100, run["config"]["global_batch"], 5000.0)})
    moved = httpx.get(f"{server.url}/v1/runs/{run['id']}/plan", timeout=60).json()
    assert moved["changed"] is True, moved["why"]
    etag = httpx.get(f"{server.url}/v1/runs/{run['id']}/plan", timeout=60).headers["etag"]
    server.stop()
    again = make_server("--executor", "none", database_path=database)
    restored = httpx.get(f"{again.url}/v1/runs/{run['id']}", timeout=10).json()
    assert restored["config"] == moved["config"] and restored["records"] == 100 and restored["last_step"] == 100
    assert len(restored["decisions"]) == 1
    # the restarted server (other code, perhaps) answers in full: the ETag of the one before it matches nothing
    replanned = httpx.get(f"{again.url}/v1/runs/{run['id']}/plan", headers={"If-None-Match": etag}, timeout=60)
    assert replanned.status_code == 200 and replanned.json()["config"] == moved["config"] and replanned.headers["etag"] != etag


def test_a_run_refuses_telemetry_past_its_bound_and_stores_none_of_the_batch(jobs_database_url, monkeypatch):
    store = store_for(jobs_database_url)
    job_id = finished_job(store)
    run, _ = run_store.create_run(store, job_id, {"hysteresis": 0.05, "min_steps_between_changes": 0}, {"global_batch": 32}, None)
    monkeypatch.setattr(run_store, "MAX_RECORDS_PER_RUN", 5)
    assert run_store.add_telemetry(store, run.id, [{"step": s} for s in range(4)])["records"] == 4
    with pytest.raises(run_store.RunFull, match="limit of 5"):
        run_store.add_telemetry(store, run.id, [{"step": s} for s in range(4, 6)])
    assert [r["step"] for r in run_store.telemetry(store, run.id)] == [0, 1, 2, 3]
    assert run_store.add_telemetry(store, run.id, [{"step": 3}, {"step": 4}])["records"] == 5  # a duplicate does not count
