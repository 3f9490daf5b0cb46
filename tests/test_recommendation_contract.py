"""The recommendation's typed contract (tula_service.plan.recommendation): every recommendation plan() makes
validates, and passes through the model unchanged, so the routes that declare it serve the same JSON;
OpenAPI documents it; a what-if and a stored recommendation come back over HTTP as they were planned."""

import copy
import json
import subprocess
import sys
from typing import Any

import httpx
import pytest
from pydantic import TypeAdapter, ValidationError
from sqlalchemy import update

from tests.api_fixtures import finished_job, store_for
from tests.conftest import REPO, LiveServer
from tests.handmade import comm_record, measurement, oom, spec_dict
from tula_service.plan.recommend import plan
from tula_service.plan.recommendation import JobRecommendation, Recommendation, WhatIfPlan
from tula_service.spec.job_spec import JobSpec
from tula_service.store.db import Job

BATCHES = [8, 16, 32, 64]
TARGET_SAMPLES = 10 * 50_000  # reference_epochs x num_samples of the hand-made spec


def trajectory(count=20, last=TARGET_SAMPLES, noise_scale=400.0, batch=32):
    step = last // count
    return [{"samples": step * (i + 1), "batch": batch, "grad_sqr": 1.0, "trace_sigma": noise_scale,
             "window_steps": 5, "variability": 0.2 + 0.01 * i} for i in range(count)]  # fmt: skip


def noisy(batch_size, cv):
    point = measurement(batch_size)
    point["iter_time"].update(cv=cv, robust_cv=cv)
    point["host_load"] = {"contended": True, "load_1m": 9.0}
    return point


def language_model(batch_size):
    point = measurement(batch_size)
    point["model"]["tokens_per_sample"] = 128
    point["memory"]["peak_bytes"] = int(point["memory"]["peak_bytes"])  # the profiler writes bytes as integers
    point["options"] = {"dtype": "bf16"}
    return point


POINTS = [measurement(b) for b in BATCHES]
FAILED = [{"kind": "grid", "batch_size": 128, "error": "worker died", "attempts": 2, "attempt_errors": ["killed", "killed"]}]
PILOT = {"kind": "pilot", "status": "ok", "batch_size": 32, "trajectory": trajectory(last=32_000)}
# name: (spec overrides, measurements, failed points)
SCENARIOS = {
    "knee": ({}, POINTS, None),
    "min_time on 2 nodes": ({"objective": "min_time", "cluster": {"nodes": 2, "gpus_per_node": 4}}, POINTS, None),
    "min_cost per node-hour": ({"objective": "min_cost", "pricing": {"kind": "node_hour", "price": 20.0}}, POINTS, None),
    "memory_gb_hour with overhead": (
        {"pricing": {"kind": "memory_gb_hour", "price": 0.1, "fixed_overhead_usd": 3}}, POINTS, None),
    "deadline met": ({"objective": "deadline", "deadline_h": 10}, POINTS, None),
    "deadline missed": ({"objective": "deadline", "deadline_h": 1e-6}, POINTS, None),
    "budget met": ({"objective": "budget", "budget_usd": 100, "cluster": {"gpus_per_node": 8}}, POINTS, None),
    "budget missed": ({"objective": "budget", "budget_usd": 1e-6}, POINTS, None),
    "gpu catalog price and link": (
        {"cluster": {"nodes": 2, "gpus_per_node": 4, "gpu_type": "h100_sxm", "device_memory_gib": None,
                     "interconnect_gbps": None}, "pricing": {"kind": "gpu_hour", "price": None}}, POINTS, None),  # fmt: skip
    "pilot": ({"profiling": {"pilot": True}}, [*POINTS, PILOT], None),
    "reference run with lr cap": (
        {"objective": "min_time", "cluster": {"gpus_per_node": 16},
         "training": {"reference_lr": 0.1, "max_lr": 0.15, "reference_run": {"gradient_stats": trajectory()}}},
        POINTS, None),  # fmt: skip
    "growing noise, batch schedule": (
        {"objective": "min_time", "cluster": {"gpus_per_node": 16, "interconnect_gbps": 1000},
         "training": {"reference_lr": 0.1, "reference_run": {"gradient_stats": [
             {**record, "grad_sqr": 20.0 / (i + 2)} for i, record in enumerate(trajectory(noise_scale=2000.0))]}}},
        POINTS, None),  # fmt: skip
    "other runs, adam": (
        {"training": {"optimizer": "adam", "reference_lr": 0.001, "other_runs": [{"batch": 256, "epochs": 12.0}]}},
        POINTS, None),
    "no gradient statistics": ({}, [measurement(b, true_grad_sq_norm=0.0, trace_sigma=0.0) for b in BATCHES], None),
    "out of memory, failed points": ({"batch_sizes": [8, 16, 32, 64, 128]}, [*POINTS, oom(128)], FAILED),
    "nccl link measured": ({"cluster": {"gpus_per_node": 4}}, [*POINTS, comm_record("nccl", 2e-5, 200.0)], None),
    "gloo link reported": ({"cluster": {"gpus_per_node": 4}}, [*POINTS, comm_record("gloo", 2e-5, 200.0)], None),
    "noisy, re-timed, unreliable": (
        {"batch_sizes": [8, 16, 32, 64, 128]},
        [*(noisy(b, 0.5) for b in [8, 16, 32, 64, 128]), noisy(32, 0.6)], None),  # fmt: skip
    "language model": ({}, [language_model(b) for b in BATCHES], None),
    "two points": ({"batch_sizes": [8, 16]}, POINTS[:2], None),
}


def planned(name: str) -> dict:
    """The scenario's recommendation as the store keeps it: JSON."""
    overrides, measurements, failed = SCENARIOS[name]
    spec = JobSpec.model_validate(spec_dict(**copy.deepcopy(overrides)))
    return json.loads(json.dumps(plan(spec, copy.deepcopy(measurements), failed)))


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_recommendation_validates_and_round_trips_to_the_same_json(name):
    out = planned(name)
    dumped = Recommendation.model_validate(out).model_dump(mode="json", exclude_unset=True)
    assert json.dumps(dumped) == json.dumps(out)  # the same keys in the same order, ints still ints


def test_the_scenarios_cover_each_shape_of_the_answer():
    answers = {name: planned(name) for name in SCENARIOS}
    assert {a["objective"] for a in answers.values()} == {"knee", "min_time", "min_cost", "deadline", "budget"}
    assert {a["pricing"]["kind"] for a in answers.values()} == {"gpu_hour", "node_hour", "memory_gb_hour"}
    assert {(a["constraint"] or {}).get("met") for a in answers.values()} == {None, True, False}
    efficiency = {a["models"]["efficiency"]["source"] for a in answers.values()}
    evidence = {a["models"]["efficiency"]["evidence"]["used"] for a in answers.values()}
    assert efficiency == {"fitted", "assumed"} and evidence == {None, "initialization", "pilot", "reference_run", "other_runs"}
    assert "capped_from" in answers["reference run with lr cap"]["training_advice"]["lr_rule"]["lr"]
    assert answers["out of memory, failed points"]["profiled"]["memory_limit"]["source"] == "measured"
    assert answers["nccl link measured"]["models"]["network"]["intra_node"]["bandwidth_gbps"]["source"] == "fitted"
    assert "note" in answers["gloo link reported"]["models"]["network"]
    assert answers["noisy, re-timed, unreliable"]["reliability"]["verdict"] == "unreliable"
    assert answers["noisy, re-timed, unreliable"]["reliability"]["retimed_batches"] == [32]
    assert answers["language model"]["chosen"]["global_batch_tokens"] == 128 * answers["language model"]["chosen"]["global_batch"]
    staged = answers["growing noise, batch schedule"]["training_advice"]["batch_schedule"]["schedules"]
    assert len(staged["staged_doubling"]["stages"]) > 1 and list(answers["no gradient statistics"]["training_advice"]["batch_schedule"]["schedules"]) == ["constant"]


def test_a_measured_byte_count_stays_an_integer():
    out = planned("language model")
    dumped = Recommendation.model_validate(out).model_dump(mode="json", exclude_unset=True)
    assert isinstance(out["profiled"]["points"][0]["peak_bytes"], int)
    assert isinstance(dumped["profiled"]["points"][0]["peak_bytes"], int)


def test_a_number_without_its_source_is_refused():
    out = planned("knee")
    del out["chosen"]["total_time_s"]["source"]
    with pytest.raises(ValidationError, match=r"chosen\.total_time_s\.source"):
        Recommendation.model_validate(out)


def test_a_fit_report_may_carry_more_detail_than_the_model_names():
    out = planned("knee")
    out["models"]["compute"]["residual_plot"] = [0.1, 0.2]
    out["models"]["efficiency"]["evidence"]["candidates"][0]["bootstrap"] = {"draws": 200}
    dumped = Recommendation.model_validate(out).model_dump(mode="json", exclude_unset=True)
    assert json.dumps(dumped) == json.dumps(out)


def test_the_contract_loads_neither_the_server_nor_the_planner_nor_torch():
    probe = ("import sys, tula_service.plan.recommendation\n"
             "print(' '.join(m for m in ('sqlalchemy', 'fastapi', 'tula_service.store.db', 'numpy', 'torch') if m in sys.modules))")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.split() == [], result.stderr


def _json_bytes(content: dict) -> bytes:
    """What the routes answered before they declared a model: FastAPI took their `dict[str, Any]` return
    annotation for the response model and serialized with it."""
    return TypeAdapter(dict[str, Any]).dump_json(content)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """A real API-only server with one done job (hand-made measurements, planned by the real planner)."""
    folder = tmp_path_factory.mktemp("contract")
    server = LiveServer(folder / "tula.db", folder / "server.log", ("--executor", "none")).start()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        client.job_id = finished_job(store_for(server.database_url), batch_sizes=BATCHES)
        client.database_url = server.database_url
        yield client
    server.stop()


def test_the_stored_recommendation_is_served_byte_for_byte(api):
    stored = store_for(api.database_url).get_job(api.job_id).recommendation
    response = api.get(f"/v1/jobs/{api.job_id}/recommendation")
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    assert response.content == _json_bytes({"job_id": api.job_id, **stored})
    JobRecommendation.model_validate_json(response.content)


def test_a_recommendation_stored_before_the_curves_is_served_as_stored(api):
    store = store_for(api.database_url)
    job_id = finished_job(store, batch_sizes=BATCHES)
    older = store.get_job(job_id).recommendation
    del older["curves"], older["knee"]["candidate"]
    with store.session() as session, session.begin():
        session.execute(update(Job).where(Job.id == job_id).values(recommendation=older))
    response = api.get(f"/v1/jobs/{job_id}/recommendation")
    assert response.status_code == 200 and response.content == _json_bytes({"job_id": job_id, **older})
    replanned = api.post(f"/v1/jobs/{job_id}/plan", json={}).json()
    assert "curves" in replanned and replanned["knee"]["candidate"] >= 0


def test_a_stored_recommendation_the_contract_no_longer_describes_is_planned_again(api):
    """Stored by an older server, before `reliability` existed: served as this server plans the same
    measurements now, not as a 500 for an answer outside its schema."""
    from tula_service.dispatch.jobs import plan_inputs
    from tula_service.plan.recommend import plan

    store = store_for(api.database_url)
    job_id = finished_job(store, batch_sizes=BATCHES)
    older = store.get_job(job_id).recommendation
    del older["reliability"]
    with store.session() as session, session.begin():
        session.execute(update(Job).where(Job.id == job_id).values(recommendation=older))
    response = api.get(f"/v1/jobs/{job_id}/recommendation")
    job = store.get_job(job_id)
    measurements, failed = plan_inputs(job)
    assert response.status_code == 200
    assert response.content == _json_bytes({"job_id": job_id, **plan(job.parsed_spec, measurements, failed)})
    assert response.json()["reliability"]["verdict"] == "reliable"


def test_only_a_stored_recommendation_may_lack_the_curves():
    older = {"job_id": "j", **planned("knee")}
    del older["curves"], older["knee"]["candidate"]
    JobRecommendation.model_validate(older)
    with pytest.raises(ValidationError, match=r"curves\n  Field required"):
        WhatIfPlan.model_validate({**older, "what_if": {}})


def test_a_what_if_is_served_byte_for_byte_as_planned(api):
    from tula_service.dispatch.jobs import plan_inputs
    from tula_service.plan.whatif import WhatIf, replan

    body = {"cluster": {"nodes": 2, "gpus_per_node": 4}, "objective": "min_cost", "pricing": {"kind": "node_hour", "price": 9}}
    response = api.post(f"/v1/jobs/{api.job_id}/plan", json=body)
    job = store_for(api.database_url).get_job(api.job_id)
    what_if = WhatIf.model_validate(body)
    measurements, failed = plan_inputs(job)
    expected = {"job_id": job.id, "what_if": what_if.given(), **replan(job.spec, measurements, what_if, failed)}
    assert response.status_code == 200 and response.content == _json_bytes(expected)
    assert WhatIfPlan.model_validate_json(response.content).what_if == what_if.given()


def test_openapi_documents_both_answers(api):
    schema = api.get("/openapi.json").json()
    paths = schema["paths"]
    ok = lambda path, method: paths[path][method]["responses"]["200"]["content"]["application/json"]["schema"]  # noqa: E731
    assert ok("/v1/jobs/{job_id}/recommendation", "get") == {"$ref": "#/components/schemas/JobRecommendation"}
    assert ok("/v1/jobs/{job_id}/plan", "post") == {"$ref": "#/components/schemas/WhatIfPlan"}
    components = schema["components"]["schemas"]
    assert list(components["JobRecommendation"]["properties"])[:2] == ["job_id", "objective"]
    assert components["Candidate"]["properties"]["total_time_s"]["$ref"] == "#/components/schemas/SourcedValue"
    assert "source" in components["SourcedValue"]["required"]
