"""What-if: re-plan stored measurements without profiling, as a pure function and over HTTP."""

import httpx
import pytest

from tula_service.recommend import plan
from tula_service.spec import JobSpec
from tula_service.whatif import WhatIf, replan
from tests.handmade import measurement, spec_dict

BATCHES = [8, 16, 32, 64]
POINTS = [measurement(b) for b in BATCHES]


def test_what_if_with_no_changes_reproduces_the_stored_plan_exactly():
    stored = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES)).model_dump(mode="json")
    assert replan(stored, POINTS, WhatIf()) == plan(JobSpec.model_validate(stored), POINTS)


def test_what_if_more_devices_changes_the_plan_and_keeps_the_rest():
    stored = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES)).model_dump(mode="json")
    bigger = replan(stored, POINTS, WhatIf(cluster={"gpus_per_node": 8}))
    assert max(r["devices"] for r in bigger["candidates"]) == 8
    assert bigger["models"]["memory"] == plan(JobSpec.model_validate(stored), POINTS)["models"]["memory"]


def test_what_if_validates_like_a_submission():
    stored = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES)).model_dump(mode="json")
    with pytest.raises(ValueError, match="greater than 0"):
        replan(stored, POINTS, WhatIf(pricing={"price": -1}))


@pytest.mark.e2e
def test_what_if_endpoint_replans_a_finished_job(live_server):
    spec = spec_dict(batch_sizes=[8, 16, 32], profiling={"time_cap_s": 0.2, "grad_iters": 2})
    job = httpx.post(f"{live_server.url}/v1/jobs", json=spec).json()
    from tula_service.client import TulaClient

    with TulaClient(live_server.url) as client:
        assert client.wait(job["id"], poll_s=0.3, timeout_s=600)["state"] == "done"
    stored = httpx.get(f"{live_server.url}/v1/jobs/{job['id']}/recommendation").json()
    same = httpx.post(f"{live_server.url}/v1/jobs/{job['id']}/plan", json={}).json()
    assert same["candidates"] == stored["candidates"] and same["chosen"] == stored["chosen"]
    doubled = httpx.post(f"{live_server.url}/v1/jobs/{job['id']}/plan", json={"cluster": {"gpus_per_node": 2}}).json()
    assert max(r["devices"] for r in doubled["candidates"]) == 2
    bad = httpx.post(f"{live_server.url}/v1/jobs/{job['id']}/plan", json={"pricing": {"price": -1}})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "pricing", "price"]
