"""What-if: re-plan stored measurements without profiling, as a pure function and over HTTP."""

import httpx
import pytest

from tests.handmade import measurement, spec_dict
from tula_service.catalogs import gpu
from tula_service.plan.recommend import plan
from tula_service.plan.whatif import WhatIf, merged_spec, replan
from tula_service.spec.job_spec import JobSpec

BATCHES = [8, 16, 32, 64]
POINTS = [measurement(b) for b in BATCHES]
BIG_POINTS = [measurement(b, static_bytes=2e9, act_bytes_per_sample=3e8) for b in BATCHES]  # 64 needs ~21 GiB


def stored_on(cluster: dict, pricing: dict | None = None, batches: list[int] = BATCHES) -> dict:
    """A stored (validated, dumped) spec on the given cluster and pricing (replaced, not merged)."""
    spec = spec_dict(batch_sizes=batches)
    spec["cluster"], spec["pricing"] = cluster, pricing or {"kind": "gpu_hour"}
    return JobSpec.model_validate(spec).model_dump(mode="json")


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


def test_what_if_a_reference_batch_beyond_the_dataset_is_refused_not_answered():
    stored = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES)).model_dump(mode="json")
    with pytest.raises(ValueError, match="reference batch 1000000 is larger than the dataset"):
        replan(stored, POINTS, WhatIf(training={"reference_batch": 10**6}))
    with pytest.raises(ValueError, match="less than or equal to 16777216"):
        replan(stored, POINTS, WhatIf(training={"reference_batch": 10**9}))


def test_what_if_switching_gpu_type_replaces_memory_link_and_catalog_price():
    stored = stored_on({"nodes": 2, "gpus_per_node": 8, "gpu_type": "h100_sxm"})
    switched = merged_spec(stored, WhatIf(cluster={"gpu_type": "a100_40gb_sxm"}))
    assert switched.cluster.device_memory_gib == 40.0 and switched.cluster.device_memory_source == "catalog-assumed"
    assert switched.cluster.intra_node_link == "nvlink3"
    a100_price = gpu("a100_40gb_sxm").default_price_usd_per_hour
    assert (switched.pricing.price, switched.pricing.price_source) == (a100_price, "catalog-assumed")
    assert (switched.cluster.nodes, switched.cluster.gpus_per_node) == (2, 8)


def test_what_if_switching_gpu_type_drops_memory_and_link_given_for_the_old_device():
    stored = stored_on({"gpu_type": "h100_sxm", "device_memory_gib": 70, "intra_node_link": "pcie5_x16"})
    switched = merged_spec(stored, WhatIf(cluster={"gpu_type": "a10g"}))
    assert switched.cluster.device_memory_gib == gpu("a10g").memory_gib
    assert switched.cluster.intra_node_link == "pcie4_x16"


def test_what_if_switching_gpu_type_keeps_a_price_from_the_spec():
    stored = stored_on({"gpu_type": "h100_sxm"}, {"kind": "gpu_hour", "price": 7.5})
    switched = merged_spec(stored, WhatIf(cluster={"gpu_type": "l40s"}))
    assert (switched.pricing.price, switched.pricing.price_source) == (7.5, "spec")


def test_what_if_values_win_over_the_new_gpus_catalog_values():
    stored = stored_on({"gpu_type": "h100_sxm"})
    what_if = WhatIf(cluster={"gpu_type": "h200", "device_memory_gib": 100}, pricing={"price": 3})
    switched = merged_spec(stored, what_if)
    assert (switched.cluster.device_memory_gib, switched.cluster.device_memory_source) == (100, "spec")
    assert (switched.pricing.price, switched.pricing.price_source) == (3, "spec")
    assert switched.cluster.intra_node_link == "nvlink4"


def test_what_if_memory_on_the_same_gpu_is_the_specs_not_the_catalogs():
    stored = stored_on({"gpu_type": "h100_sxm"})
    assert JobSpec.model_validate(stored).cluster.device_memory_source == "catalog-assumed"
    changed = merged_spec(stored, WhatIf(cluster={"device_memory_gib": 8}))
    assert (changed.cluster.device_memory_gib, changed.cluster.device_memory_source) == (8, "spec")


def test_what_if_from_explicit_memory_to_a_gpu_type():
    stored = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES)).model_dump(mode="json")  # 16 GiB, 100 Gbit/s
    switched = merged_spec(stored, WhatIf(cluster={"gpu_type": "a100_80gb_sxm"}))
    assert switched.cluster.device_memory_gib == 80.0 and switched.cluster.interconnect_gbps == 100
    assert switched.cluster.intra_node_link is None  # the spec's interconnect_gbps still names the link
    assert (switched.pricing.price, switched.pricing.price_source) == (2.0, "spec")


def test_what_if_same_gpu_type_changes_nothing():
    stored = stored_on({"gpu_type": "h100_sxm", "device_memory_gib": 40})
    assert merged_spec(stored, WhatIf(cluster={"gpu_type": "h100_sxm"})).model_dump(mode="json") == stored


def test_what_if_interconnect_replaces_a_catalog_link_like_a_fresh_submission_would():
    stored = stored_on({"gpu_type": "h100_sxm"})
    changed = merged_spec(stored, WhatIf(cluster={"interconnect_gbps": 50}))
    fresh = JobSpec.model_validate(stored_on({"gpu_type": "h100_sxm", "interconnect_gbps": 50}))
    assert changed.cluster == fresh.cluster and changed.cluster.intra_node_link is None


def test_what_if_new_pricing_kind_needs_a_price_when_the_old_one_was_the_catalogs():
    stored = stored_on({"gpu_type": "h100_sxm"})
    with pytest.raises(ValueError, match="pricing.price"):
        merged_spec(stored, WhatIf(pricing={"kind": "node_hour"}))
    assert merged_spec(stored, WhatIf(pricing={"kind": "node_hour", "price": 20})).pricing.price_source == "spec"


def test_what_if_unknown_gpu_type_names_the_field():
    with pytest.raises(ValueError, match="cluster.gpu_type\n.*'b200' is not in the catalog; did you mean h200"):
        merged_spec(stored_on({"gpu_type": "h100_sxm"}), WhatIf(cluster={"gpu_type": "b200"}))


def test_what_if_on_another_gpu_keeps_the_measured_speed_and_refits_memory_limits():
    stored = stored_on({"gpu_type": "h100_sxm"}, batches=BATCHES)
    on_h100 = replan(stored, BIG_POINTS, WhatIf())
    on_a10g = replan(stored, BIG_POINTS, WhatIf(cluster={"gpu_type": "a10g"}))
    assert on_a10g["candidates"]
    assert on_a10g["search_space"]["max_device_batch"]["value"] < on_h100["search_space"]["max_device_batch"]["value"]
    h100_rows = {(r["device_batch"], r["devices"], r["accumulation"]): r for r in on_h100["candidates"]}
    price_ratio = gpu("a10g").default_price_usd_per_hour / gpu("h100_sxm").default_price_usd_per_hour
    for row in on_a10g["candidates"]:  # compute is not rescaled: same iteration time, another price
        same = h100_rows[(row["device_batch"], row["devices"], row["accumulation"])]
        assert row["iter_time_s"] == same["iter_time_s"]
        assert row["cost_usd"]["value"] == pytest.approx(same["cost_usd"]["value"] * price_ratio)


@pytest.mark.e2e
def test_what_if_endpoint_replans_a_finished_job(live_server):
    spec = spec_dict(batch_sizes=[8, 16, 32], profiling={"time_cap_s": 0.2, "grad_iters": 2})
    job = httpx.post(f"{live_server.url}/v1/jobs", json=spec).json()
    from tula_service.client import TulaClient

    with TulaClient(live_server.url) as client:
        assert client.wait(job["id"], poll_s=0.3, timeout_s=600).state == "done"
    stored = httpx.get(f"{live_server.url}/v1/jobs/{job['id']}/recommendation").json()
    same = httpx.post(f"{live_server.url}/v1/jobs/{job['id']}/plan", json={}).json()
    assert same["candidates"] == stored["candidates"] and same["chosen"] == stored["chosen"]
    doubled = httpx.post(f"{live_server.url}/v1/jobs/{job['id']}/plan", json={"cluster": {"gpus_per_node": 2}}).json()
    assert max(r["devices"] for r in doubled["candidates"]) == 2
    bad = httpx.post(f"{live_server.url}/v1/jobs/{job['id']}/plan", json={"pricing": {"price": -1}})
    assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "body.pricing.price"
    switch = {"cluster": {"gpu_type": "a100_40gb_sxm"}}
    a100 = httpx.post(f"{live_server.url}/v1/jobs/{job['id']}/plan", json=switch).json()
    assert a100["chosen"]["iter_time_s"]["value"] > 0 and a100["what_if"] == switch
    unknown = httpx.post(f"{live_server.url}/v1/jobs/{job['id']}/plan", json={"cluster": {"gpu_type": "b200"}})
    assert unknown.status_code == 422 and unknown.json()["errors"][0]["field"] == "body.cluster.gpu_type"


def test_what_if_a_new_reference_run_or_lr_ceiling_replans_without_profiling():
    stored = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, training={"reference_lr": 0.1})).model_dump(mode="json")
    longer = replan(stored, POINTS, WhatIf(training={"reference_epochs": 20}))
    base = replan(stored, POINTS, WhatIf())
    assert longer["chosen"]["epochs"]["value"] == pytest.approx(2 * base["chosen"]["epochs"]["value"])
    capped = replan(stored, POINTS, WhatIf(training={"max_lr": 0.2}))
    assert capped["models"]["efficiency"]["max_step_gain"]["value"] == pytest.approx(2.0)
    assert merged_spec(stored, WhatIf(training={"max_lr": 0.2})).training.reference_lr == 0.1  # merged, not replaced
    with pytest.raises(ValueError, match="below reference_lr"):
        replan(stored, POINTS, WhatIf(training={"max_lr": 0.01}))


def test_what_if_answers_carry_curves_redrawn_for_the_new_inputs():
    stored = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES)).model_dump(mode="json")
    base = replan(stored, POINTS, WhatIf())["curves"]
    longer = replan(stored, POINTS, WhatIf(training={"reference_epochs": 20}))["curves"]
    assert longer["epochs"]["global_batch"] == base["epochs"]["global_batch"]
    assert longer["epochs"]["epochs"] == pytest.approx([2 * epochs for epochs in base["epochs"]["epochs"]])
    assert longer["iter_time"] == base["iter_time"] and longer["memory"] == base["memory"]
    bigger = replan(stored, POINTS, WhatIf(cluster={"device_memory_gib": 64}))["curves"]["memory"]
    assert bigger["device_batch"][-1] > base["memory"]["device_batch"][-1]  # drawn past the new max batch
