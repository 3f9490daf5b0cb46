"""Measured multi-device steps enter the plan: the placement model is fitted to them (tula_service.fit.step_time),
the sweep covers packed and spread placements, and each candidate says which, with the error it was
predicted with."""

import numpy as np
import pytest

from tests.handmade import comm_record, measurement, spec_dict
from tula_service.fit.perfmodel.placement import _allreduce_s, _combine
from tula_service.measurement import StepMeasurement, parse_measurement
from tula_service.plan.planner import gpus_on_nodes, placements
from tula_service.plan.recommend import plan
from tula_service.spec.job_spec import JobSpec

BATCHES = [8, 16, 32, 64, 128]
# a cluster of 4 nodes x 4 GPUs that share one NIC and one host per node: each GPU a node adds makes the others
# wait 25% of a compute step (kappa) at the all-reduce, and the nodes are joined by a flat ring
TRUTH = {"lat_a": 2e-4, "xfer_a": 0.004, "lat_e": 1e-3, "xfer_e": 0.03, "gamma": 2.0, "kappa": 0.25}
CLUSTER = {"nodes": 4, "gpus_per_node": 4, "interconnect_gbps": 100}


def compute_s(batch: float) -> float:
    return 0.01 + 0.001 * batch  # handmade measurement()'s T(b)


def true_step_s(placement: list[int], batch: float) -> float:
    g, m, n = float(max(placement)), float(len(placement)), float(sum(placement))
    sync = float(_allreduce_s("flat", g, m, n, TRUTH["lat_a"], TRUTH["xfer_a"], TRUTH["lat_e"], TRUTH["xfer_e"]))
    overlapped_s = float(_combine(np.array(compute_s(batch)), np.array(sync), TRUTH["gamma"]))
    return overlapped_s + TRUTH["kappa"] * (g - 1) * compute_s(batch)


def step(placement: list[int], batch: int) -> dict:
    return {"kind": "step", "placement": placement, "device_batch": batch, "step_time_s": true_step_s(placement, batch), "origin": "test"}


MEASURED_PLACEMENTS = ([2], [4], [1, 1], [2, 2], [1, 1, 1, 1], [4, 4])


def _spec(**overrides) -> JobSpec:
    return JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, cluster=CLUSTER, **overrides))


def _measurements(with_steps: bool = True) -> list[dict]:
    points = [measurement(b) for b in BATCHES]
    if with_steps:
        points += [step(p, b) for p in MEASURED_PLACEMENTS for b in (16, 64)]
    return points


def test_a_step_record_is_a_measurement_that_names_a_bad_field():
    parsed = parse_measurement(step([2, 2], 32))
    assert isinstance(parsed, StepMeasurement) and parsed.devices == 4
    with pytest.raises(ValueError, match="sync_time_s"):
        parse_measurement({**step([2], 8), "sync_time_s": 10.0})
    with pytest.raises(ValueError, match="placement"):
        parse_measurement({**step([2], 8), "placement": [2, 0]})


def test_without_measured_steps_the_links_predict_and_the_report_says_so():
    rec = plan(_spec(), _measurements(with_steps=False))
    step_time = rec["models"]["step_time"]
    assert step_time["model"] == "analytic" and step_time["multi_device_steps"] == 0
    assert "no multi-device step was measured" in step_time["note"]


def test_measured_steps_are_fitted_and_predict_a_placement_left_out():
    rec = plan(_spec(), _measurements())
    step_time = rec["models"]["step_time"]
    assert step_time["model"] == "placement" and step_time["multi_device_steps"] == 2 * len(MEASURED_PLACEMENTS)
    assert step_time["held_out_median_rel_err"] < 0.05
    rows = {(tuple(r["placement"]), r["device_batch"], r["accumulation"]): r for r in rec["candidates"]}
    # [4, 4, 4, 4] at batch 32 was never measured: its prediction is the truth's within a few percent
    unseen = rows[((4, 4, 4, 4), 32, 1)]
    assert unseen["step_time_s"]["source"] == "predicted"
    assert unseen["step_time_s"]["value"] == pytest.approx(true_step_s([4, 4, 4, 4], 32), rel=0.05)
    assert unseen["step_time_s"]["rel_err"] == pytest.approx(step_time["held_out_median_rel_err"])
    # a measured (placement, batch) is given as measured
    seen = rows[((2, 2), 16, 1)]
    assert seen["step_time_s"] == {"value": pytest.approx(true_step_s([2, 2], 16)), "source": "measured"}


def test_with_one_nic_per_node_spreading_is_faster_and_is_recommended_for_min_time():
    rec = plan(_spec(objective="min_time"), _measurements())
    rows = {(tuple(r["placement"]), r["device_batch"], r["accumulation"]): r for r in rec["candidates"]}
    packed, spread = rows[((4,), 64, 1)], rows[((1, 1, 1, 1), 64, 1)]
    assert (packed["placement_kind"], spread["placement_kind"]) == ("packed", "spread")
    assert true_step_s([1, 1, 1, 1], 64) < true_step_s([4], 64)  # the truth: one GPU per NIC syncs faster here
    assert spread["step_time_s"]["value"] < packed["step_time_s"]["value"]
    assert rec["chosen"]["placement_kind"] == "spread"  # one GPU per node, as the truth favours


def test_placements_are_packed_spread_and_even_between():
    n, g, m, kind = placements(np.array([1, 2, 4, 8, 16]), nodes=4, gpus_per_node=4)
    described = sorted(gpus_on_nodes(int(a), int(c), int(b), int(k)) for a, b, c, k in zip(n, g, m, kind))
    assert described == sorted([[1], [2], [1, 1], [4], [2, 2], [1, 1, 1, 1], [4, 4], [2, 2, 2, 2], [4, 4, 4, 4]])
    assert gpus_on_nodes(3, 2, 2, 2) == [2, 1] and gpus_on_nodes(6, 2, 4, 0) == [4, 2]


def test_the_nccl_all_reduce_benchmark_fits_the_intra_node_link_with_the_steps():
    """Steps measured only across nodes say nothing of the intra-node link; the benchmark on one node's GPUs
    joins the fit and pins it (contention within a node stays unmeasured: no step had 2 GPUs on a node)."""
    gradient_bytes = measurement(8)["model"]["gradient_bytes"]
    bandwidth_gbps = gradient_bytes * 8 / TRUTH["xfer_a"] / 1e9
    points = [measurement(b) for b in BATCHES] + [step(p, b) for p in ([1, 1], [1, 1, 1], [1, 1, 1, 1]) for b in (16, 64)]
    benchmark = comm_record("nccl", TRUTH["lat_a"], bandwidth_gbps)
    with_benchmark, without = plan(_spec(), points + [benchmark]), plan(_spec(), points)
    assert with_benchmark["models"]["step_time"]["benchmark_points"] == len(benchmark["points"])
    intra = with_benchmark["models"]["step_time"]["params"]["intra"]
    assert intra["source"] == "fitted" and intra["bandwidth_gbps"] == pytest.approx(bandwidth_gbps, rel=0.1)
    assert intra["latency_s"] == pytest.approx(TRUTH["lat_a"], rel=0.2)
    assert without["models"]["step_time"]["params"]["intra"]["source"] == "assumed"
    gloo = comm_record("gloo", TRUTH["lat_a"], bandwidth_gbps)  # CPU processes: not the GPUs' link, not used
    assert plan(_spec(), points + [gloo])["models"]["step_time"]["benchmark_points"] == 0
