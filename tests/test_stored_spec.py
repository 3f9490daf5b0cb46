"""A stored spec is parsed once per loaded job, and the decisions of its submission hold: narrowing the
model allowlist or the data roots afterwards fails no parse (before, every re-parse of a queued job failed
as an "executor error"); the worker still refuses what today's allowlist refuses, as a failed point that
says why."""

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from models.registry import ALLOWED_MODULES_ENV
from tests.handmade import spec_dict
from tula_service.dispatch.jobs import point_request
from tula_service.plan.whatif import WhatIf, merged_spec
from tula_service.spec.job_spec import JobSpec
from tula_service.store.db import make_engine, make_session_factory
from tula_service.store.job_store import Store

USER_MODEL = "tests.user_models_fixture:tiny_classifier"
IMAGES = {"name": "synthetic_images", "num_samples": 1000, "channels": 1, "image_size": 8, "num_classes": 4}


def user_spec() -> dict:
    spec = spec_dict(model=USER_MODEL, model_options={}, dataset=IMAGES, batch_sizes=[8, 16])
    spec["user_code_check"] = "passed: built and ran on 2 samples"  # as the submission recorded it
    return spec


def test_a_narrowed_allowlist_refuses_new_submissions_but_not_stored_specs(monkeypatch):
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "tests")
    accepted = JobSpec.model_validate(user_spec())
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "")
    with pytest.raises(ValidationError, match="not allowlisted"):
        JobSpec.model_validate(user_spec())
    stored = JobSpec.stored(accepted.model_dump(mode="json"))
    assert stored.model == USER_MODEL
    what_if = merged_spec(accepted.model_dump(mode="json"), WhatIf.model_validate({"cluster": {"nodes": 2}}))
    assert what_if.cluster.nodes == 2


def test_a_stored_spec_still_checks_its_shape_and_bounds():
    broken = spec_dict(batch_sizes=[8])
    with pytest.raises(ValidationError, match="at least 2 distinct"):
        JobSpec.stored(broken)
    too_many = spec_dict(cluster={"nodes": 10**6, "gpus_per_node": 8})
    with pytest.raises(ValidationError, match="devices"):
        JobSpec.stored(too_many)


def test_a_loaded_job_parses_its_spec_once(tmp_path):
    store = Store(make_session_factory(make_engine(f"sqlite:///{tmp_path / 'tula.db'}")))
    job, _ = store.create_job(JobSpec.model_validate(spec_dict()))
    loaded = store.get_job(job.id)
    assert loaded.parsed_spec is loaded.parsed_spec
    assert loaded.parsed_spec == JobSpec.model_validate(spec_dict())


def test_the_worker_refuses_a_module_the_allowlist_no_longer_names(monkeypatch, tmp_path):
    pytest.importorskip("torch")
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "tests")
    stored = JobSpec.model_validate(user_spec()).model_dump(mode="json")
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "")
    request = {**point_request(JobSpec.stored(stored), 8), "time_cap_s": 0.5, "grad_iters": 0, "device": "cpu"}
    assert request["allowed_model_modules"] == []
    out = tmp_path / "point.json"
    subprocess.run([sys.executable, "-m", "profiler.run_point", "--request", json.dumps(request), "--out", str(out)],
                   check=True, timeout=120)  # fmt: skip
    record = json.loads(out.read_text())
    assert record["status"] == "failed" and "not allowlisted" in record["error"] and ALLOWED_MODULES_ENV in record["error"]
