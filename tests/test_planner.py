import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.handmade import comm_record, measurement, oom, spec_dict
from tula_service.fit.fitting import fit_models
from tula_service.measurement import parse_measurement
from tula_service.plan.planner import pareto_mask
from tula_service.plan.recommend import NotEnoughMeasurements, plan
from tula_service.spec.job_spec import JobSpec

BATCHES = [8, 16, 32, 64, 128, 256, 512, 1024]


def _plan(spec_overrides=None, batches=BATCHES, **params):
    spec = JobSpec.model_validate(spec_dict(batch_sizes=batches, **(spec_overrides or {})))
    return plan(spec, [measurement(b, **params) for b in batches])


def test_known_lines_are_recovered_in_the_report():
    rec = _plan(static_bytes=2e8, act_bytes_per_sample=3e6, alpha_s=0.05, beta_s_per_sample=0.002)
    assert rec["models"]["memory"]["static_bytes"] == pytest.approx(2e8)
    assert rec["models"]["memory"]["act_bytes_per_sample"] == pytest.approx(3e6)
    assert rec["models"]["compute"]["name"] == "linear"
    assert rec["models"]["compute"]["params"]["alpha_s"] == pytest.approx(0.05)
    assert rec["models"]["compute"]["params"]["beta_s_per_sample"] == pytest.approx(0.002)
    assert rec["models"]["compute"]["leave_one_out"]["max_rel_err"] < 1e-9


def test_known_noise_scale_gives_the_known_knee():
    # T_comp = alpha at any batch (so b = 1024 always), free communication, 64 devices, B_noise = 8192:
    # along the front B = 1024 n and time ~ 1/B + 1/8192, cost ~ 1 + B/8192 -> knee near B_noise.
    rec = _plan(
        {"cluster": {"nodes": 8, "gpus_per_node": 8, "interconnect_gbps": 1000}},
        batches=[512, 1024],
        alpha_s=0.1,
        beta_s_per_sample=0.0,
        trace_sigma=8192.0,
        gradient_bytes=4000,
    )
    assert rec["models"]["efficiency"]["noise_scale"]["value"] == pytest.approx(8192.0)
    front = [rec["candidates"][i] for i in rec["pareto_front"]]
    assert sorted(r["global_batch"] for r in front) == [1024 * n for n in (1, 2, 4, 8, 16, 32, 64)]
    assert rec["knee"]["method"] == "kneedle"
    assert 4096 <= rec["chosen"]["global_batch"] <= 16384
    assert rec["chosen"]["global_batch"] == rec["knee"]["global_batch"] and rec["chosen"]["pareto"]


def test_every_candidate_has_time_cost_and_source_labels():
    rec = _plan({"cluster": {"nodes": 2, "gpus_per_node": 4}})
    # 1, 2, 4 and 8 devices packed, and 2 and 4 spread over both nodes (8 fills both either way)
    placements = {(tuple(row["placement"]), row["placement_kind"]) for row in rec["candidates"]}
    assert placements == {((1,), "packed"), ((2,), "packed"), ((4,), "packed"), ((4, 4), "packed"),
                          ((1, 1), "spread"), ((2, 2), "spread")}  # fmt: skip
    assert len(rec["candidates"]) == len(rec["search_space"]["device_batches"]) * len(placements) * 4
    for row in rec["candidates"]:
        for key in ("memory_bytes", "iter_time_s", "total_time_s", "cost_usd", "epochs"):
            assert row[key]["value"] > 0
            assert row[key]["source"] in ("measured", "predicted", "assumed", *(("spec",) if key == "epochs" else ()))


def test_the_reference_runs_own_epochs_are_labelled_as_given_and_predictions_elsewhere():
    """At the reference batch the model anchored on the reference run returns the spec's reference_epochs: given
    (`spec`), on every placement and accumulation that makes that global batch; every other batch's are predicted.
    Fitted to other runs, the curve need not pass through it, and the value there stays a prediction."""
    rec = _plan({"cluster": {"nodes": 1, "gpus_per_node": 4}})
    given = [row for row in rec["candidates"] if row["epochs"]["source"] == "spec"]
    assert given and {row["global_batch"] for row in given} == {32} and len({row["devices"] for row in given}) > 1
    assert all(row["epochs"]["value"] == 10 and "training.reference_epochs" in row["epochs"]["why"] for row in given)
    assert all(row["epochs"]["source"] == "predicted" for row in rec["candidates"] if row["global_batch"] != 32)
    runs = {"training": {"reference_batch": 32, "reference_epochs": 10, "other_runs": [{"batch": 128, "epochs": 31}, {"batch": 512, "epochs": 60}]}}
    fitted = [row["epochs"] for row in _plan(runs)["candidates"] if row["global_batch"] == 32]
    assert fitted and all(e["source"] == "predicted" and e["value"] != pytest.approx(10, rel=1e-6) for e in fitted)


def test_measured_values_are_marked_measured_only_where_they_were_measured():
    rec = _plan({"cluster": {"nodes": 1, "gpus_per_node": 2}}, batches=[8, 32, 128])
    single = [r for r in rec["candidates"] if r["devices"] == 1 and r["accumulation"] == 1 and r["device_batch"] == 32][0]
    assert single["iter_time_s"]["source"] == "measured" and single["memory_bytes"]["source"] == "measured"
    unprofiled = [r for r in rec["candidates"] if r["device_batch"] == 16][0]
    assert unprofiled["memory_bytes"]["source"] == "predicted"
    multi = [r for r in rec["candidates"] if r["devices"] == 2 and r["device_batch"] == 32][0]
    assert multi["iter_time_s"]["source"] == "predicted"


def test_pareto_front_of_a_multi_gpu_cluster_trades_time_for_cost():
    rec = _plan({"cluster": {"nodes": 2, "gpus_per_node": 8, "interconnect_gbps": 10}}, gradient_bytes=400_000_000, trace_sigma=1e5)
    front = sorted((rec["candidates"][i] for i in rec["pareto_front"]), key=lambda r: r["total_time_s"]["value"])
    assert len(front) >= 3
    costs = [r["cost_usd"]["value"] for r in front]
    assert costs == sorted(costs, reverse=True)  # faster costs more along the front
    assert rec["chosen"]["pareto"]


def test_min_time_and_min_cost_bracket_the_knee():
    overrides = {"cluster": {"nodes": 2, "gpus_per_node": 8, "interconnect_gbps": 10}}
    picks = {
        objective: _plan({**overrides, "objective": objective}, gradient_bytes=400_000_000, trace_sigma=1e5)["chosen"]
        for objective in ("knee", "min_time", "min_cost")
    }
    time = {k: v["total_time_s"]["value"] for k, v in picks.items()}
    cost = {k: v["cost_usd"]["value"] for k, v in picks.items()}
    assert time["min_time"] <= time["knee"] <= time["min_cost"]
    assert cost["min_cost"] <= cost["knee"] <= cost["min_time"]


def test_memory_limit_and_oom_points_exclude_large_device_batches():
    spec = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, cluster={"device_memory_gib": 1.0}))
    measurements = [measurement(b, static_bytes=2e8, act_bytes_per_sample=2e6) for b in BATCHES[:-1]] + [oom(1024)]
    rec = plan(spec, measurements)
    # (1 GiB * 0.95 - 0.2 GB) / 2 MB = 410 samples: 512 does not fit; 1024 went out of memory
    assert rec["search_space"]["max_device_batch"]["value"] == 410
    assert max(r["device_batch"] for r in rec["candidates"]) == 256
    assert rec["profiled"]["oom_batches"] == [1024]


def test_memory_gb_hour_pricing_charges_for_memory_used():
    rec = _plan({"pricing": {"kind": "memory_gb_hour", "price": 0.15}})
    row = rec["candidates"][0]
    expected = row["total_time_s"]["value"] / 3600 * row["devices"] * row["memory_bytes"]["value"] / 2**30 * 0.15
    assert row["cost_usd"]["value"] == pytest.approx(expected)


def test_without_informative_noise_scale_epochs_are_assumed_and_conservative():
    rec = _plan(true_grad_sq_norm=-0.5)  # reference run: 10 epochs at batch 32
    assert rec["models"]["efficiency"]["source"] == "assumed"
    epochs = {r["global_batch"]: r["epochs"]["value"] for r in rec["candidates"]}
    assert epochs[16] == 10.0 and epochs[32] == 10.0 and epochs[128] == 40.0
    assert all(r["epochs"]["source"] == "assumed" for r in rec["candidates"])


def test_fewer_than_two_usable_points_is_a_clear_error():
    spec = JobSpec.model_validate(spec_dict(batch_sizes=[8, 16]))
    with pytest.raises(NotEnoughMeasurements, match="out of memory at \\[16\\]"):
        plan(spec, [measurement(8), oom(16)])


def test_plan_is_a_pure_function_of_its_inputs():
    assert _plan() == _plan()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 100), st.floats(0.1, 100)), min_size=1, max_size=60))
def test_pareto_set_is_non_dominated_and_covers_every_other_point(points):
    time_s, cost = (np.array(v) for v in zip(*points))
    mask = pareto_mask(time_s, cost)
    for i in np.flatnonzero(mask):
        dominated_by = (time_s <= time_s[i]) & (cost <= cost[i]) & ((time_s < time_s[i]) | (cost < cost[i]))
        assert not dominated_by.any()
    for j in np.flatnonzero(~mask):
        assert ((time_s[mask] <= time_s[j]) & (cost[mask] <= cost[j])).any()


def _plan_with_comm(backend: str):
    spec = JobSpec.model_validate(spec_dict(batch_sizes=[8, 16, 32], cluster={"gpus_per_node": 8}))
    return plan(spec, [measurement(b) for b in (8, 16, 32)] + [comm_record(backend, 2e-5, 200.0)])


def test_nccl_benchmark_replaces_the_spec_bandwidth():
    network = _plan_with_comm("nccl")["models"]["network"]
    assert network["intra_node"]["bandwidth_gbps"] == {"value": pytest.approx(200.0), "source": "fitted"}
    assert network["intra_node"]["latency_s"]["value"] == pytest.approx(2e-5)


def test_cpu_gloo_benchmark_is_reported_but_the_spec_bandwidth_is_used():
    network = _plan_with_comm("gloo")["models"]["network"]
    assert network["intra_node"]["bandwidth_gbps"] == {"value": 100.0, "source": "spec"}
    assert network["measured_link"]["bandwidth_gbps"] == pytest.approx(200.0)
    assert "not the cluster's GPU interconnect" in network["note"]


def test_links_named_in_the_spec_come_from_the_catalog_and_say_so():
    cluster = {"nodes": 4, "gpus_per_node": 8, "interconnect_gbps": None, "intra_node_link": "nvlink4", "inter_node_link": "infiniband_ndr"}
    spec = JobSpec.model_validate(spec_dict(batch_sizes=[8, 16, 32], cluster=cluster))
    network = plan(spec, [measurement(b) for b in (8, 16, 32)])["models"]["network"]
    assert network["intra_node"]["name"] == "nvlink4" and network["inter_node"]["name"] == "infiniband_ndr"
    assert network["intra_node"]["bandwidth_gbps"]["source"] == "catalog-assumed"


def test_without_any_link_the_conservative_defaults_are_assumed_and_named():
    cluster = {"nodes": 2, "gpus_per_node": 4, "interconnect_gbps": None}
    spec = JobSpec.model_validate(spec_dict(batch_sizes=[8, 16, 32], cluster=cluster))
    network = plan(spec, [measurement(b) for b in (8, 16, 32)])["models"]["network"]
    assert (network["intra_node"]["name"], network["inter_node"]["name"]) == ("pcie4_x16", "ethernet_100g")


def test_multi_node_all_reduce_is_slower_than_one_node_of_the_same_size():
    def iter_time(nodes, gpus):
        cluster = {"nodes": nodes, "gpus_per_node": gpus, "interconnect_gbps": None, "intra_node_link": "nvlink4", "inter_node_link": "ethernet_10g"}
        spec = JobSpec.model_validate(spec_dict(batch_sizes=[8, 16], cluster=cluster, objective="min_time"))
        rows = plan(spec, [measurement(b, gradient_bytes=10**8) for b in (8, 16)])["candidates"]
        return [r for r in rows if r["devices"] == 8 and r["device_batch"] == 16 and r["accumulation"] == 1][0]["iter_time_s"]["value"]
    assert iter_time(2, 4) > iter_time(1, 8)


def test_unknown_link_names_the_catalog():
    with pytest.raises(ValueError, match="interconnect 'nvlink9' is not in the catalog; did you mean nvlink4"):
        JobSpec.model_validate(spec_dict(cluster={"intra_node_link": "nvlink9"}))


def test_language_model_batches_are_also_counted_in_tokens():
    spec = JobSpec.model_validate(spec_dict(batch_sizes=[8, 16, 32]))
    points = [measurement(b) for b in (8, 16, 32)]
    for point in points:
        point["model"]["tokens_per_sample"] = 128
    rec = plan(spec, points)
    assert rec["batch_unit"] == {"unit": "sequences", "tokens_per_sample": 128}
    assert all(r["global_batch_tokens"] == 128 * r["global_batch"] for r in rec["candidates"])


def _row(rec: dict, device_batch: int, devices: int = 1, accumulation: int = 1) -> dict:
    return next(
        r for r in rec["candidates"] if (r["device_batch"], r["devices"], r["accumulation"]) == (device_batch, devices, accumulation)
    )


BATCHES_UP_TO_D = [8, 16, 32, 64, 128, 256, 512]  # D = 1000 below


def test_the_last_step_of_an_epoch_holds_only_the_samples_left_over():
    # D = 1000 samples, T_comp(b) = 0.05 + 0.002 b on one device: B = 512 is one full step and one of 488
    # samples (not two full steps). (No batch above D is profiled: the spec refuses it.)
    rec = _plan({"dataset": {"num_samples": 1000}}, batches=BATCHES_UP_TO_D, alpha_s=0.05, beta_s_per_sample=0.002)
    t_comp = lambda b: 0.05 + 0.002 * b  # noqa: E731
    assert _row(rec, 512)["epoch_time_s"]["value"] == pytest.approx(t_comp(512) + t_comp(488))
    assert _row(rec, 8)["epoch_time_s"]["value"] == pytest.approx(125 * t_comp(8))  # 8 divides 1000: no partial step
    row = _row(rec, 256)
    assert row["total_time_s"]["value"] == pytest.approx(row["epochs"]["value"] * (3 * t_comp(256) + t_comp(232)))


def test_the_left_over_step_is_split_over_devices_and_micro_batches():
    # 2 devices x 2 micro-batches of 128: B = 512; D = 1000 leaves 488 samples, 244 per device: a full
    # micro-batch of 128, then 116 with the all-reduce (overlap g = 1: added).
    rec = _plan({"dataset": {"num_samples": 1000}, "cluster": {"nodes": 1, "gpus_per_node": 2}}, batches=BATCHES_UP_TO_D,
                alpha_s=0.05, beta_s_per_sample=0.002)  # fmt: skip
    t_comp = lambda b: 0.05 + 0.002 * b  # noqa: E731
    row = _row(rec, 128, devices=2, accumulation=2)
    t_net = row["iter_time_s"]["value"] - t_comp(128)
    assert t_net > 0
    assert row["step_time_s"]["value"] == pytest.approx(t_comp(128) + t_comp(128) + t_net)
    assert row["epoch_time_s"]["value"] == pytest.approx(row["step_time_s"]["value"] + t_comp(128) + t_comp(116) + t_net)


def _saturating_noisy_points(batches=BATCHES) -> list[dict]:
    """Flat time up to batch 64, then linear; memory off its line by a few percent (a non-zero interval)."""
    points = [measurement(b) for b in batches]
    for i, point in enumerate(points):
        point["iter_time"] = {**point["iter_time"], "median_s": 0.01 + 0.001 * max(point["batch_size"], 64)}
        point["memory"] = {**point["memory"], "peak_bytes": point["memory"]["peak_bytes"] * (1 + 0.03 * (-1) ** i)}
    return points


def test_the_recommendation_carries_curves_evaluated_by_the_planners_models():
    spec = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, training={"reference_lr": 0.1, "max_lr": 0.3}))
    points = _saturating_noisy_points()
    curves = plan(spec, points)["curves"]
    models, report = fit_models(spec, [parse_measurement(point) for point in points])
    assert report["compute"]["name"] == "saturating"
    iter_time, memory, epochs = curves["iter_time"], curves["memory"], curves["epochs"]
    device_batch = np.array(iter_time["device_batch"])
    assert iter_time["iter_time_s"] == pytest.approx(models.compute.predict(device_batch).tolist(), rel=1e-12)
    assert iter_time["samples_per_s"] == pytest.approx((device_batch / models.compute.predict(device_batch)).tolist(), rel=1e-12)
    assert (iter_time["model"], iter_time["source"]) == ("saturating", "predicted")
    assert iter_time["rel_err"] == report["compute"]["leave_one_out"]["median_rel_err"]
    memory_batch = np.array(memory["device_batch"])
    assert memory["memory_bytes"] == pytest.approx(models.memory.predict(memory_batch).tolist(), rel=1e-12)
    assert memory["memory_upper_bytes"] == pytest.approx(models.memory.predict_interval(memory_batch)[1].tolist(), rel=1e-12)
    assert epochs["epochs"] == pytest.approx(models.epochs.predict(np.array(epochs["global_batch"])).tolist(), rel=1e-12)
    assert epochs["source"] == "predicted" and "max_step_gain" in epochs["formula"]


def test_the_memory_curves_upper_bound_fits_the_device_exactly_up_to_the_max_batch():
    rec = plan(JobSpec.model_validate(spec_dict(batch_sizes=BATCHES)), _saturating_noisy_points())
    memory, max_batch = rec["curves"]["memory"], rec["search_space"]["max_device_batch"]["value"]
    usable_bytes = rec["device"]["memory_gib"]["value"] * 2**30 * (1 - rec["search_space"]["memory_margin"]["value"])
    fits = [upper <= usable_bytes for upper in memory["memory_upper_bytes"]]
    assert fits == [batch <= max_batch for batch in memory["device_batch"]]
    assert memory["device_batch"][-1] == pytest.approx(1.5 * max_batch, rel=1e-3)  # past the max batch (to 4 digits)
    assert any(upper > center for upper, center in zip(memory["memory_upper_bytes"], memory["memory_bytes"]))


def test_curves_are_bounded_and_cover_what_the_plots_mark():
    rec = _plan(batches=[8, 16, 32, 64], spec_overrides={"training": {"other_runs": [{"batch": 4096, "epochs": 40}]}})
    for curve in rec["curves"].values():
        lengths = {len(values) for values in curve.values() if isinstance(values, list)}
        assert len(lengths) == 1 and 10 <= lengths.pop() <= 300
    iter_time, epochs = rec["curves"]["iter_time"], rec["curves"]["epochs"]
    assert iter_time["device_batch"][0] < 8 and iter_time["device_batch"][-1] > 64
    marked = [r["global_batch"] for r in rec["candidates"]] + [rec["models"]["efficiency"]["noise_scale"]["value"], 4096]
    assert epochs["global_batch"][0] < min(marked) and epochs["global_batch"][-1] > max(marked)


def test_without_a_noise_scale_the_epochs_curve_is_labelled_assumed():
    rec = _plan(true_grad_sq_norm=0.0)
    assert rec["curves"]["epochs"]["source"] == "assumed" == rec["chosen"]["epochs"]["source"]


def test_the_knee_names_its_candidate():
    rec = _plan()
    knee = rec["candidates"][rec["knee"]["candidate"]]
    assert knee == rec["chosen"] and knee["global_batch"] == rec["knee"]["global_batch"] and knee["pareto"]


def test_a_pick_that_the_range_set_says_so_and_one_inside_the_range_does_not():
    """Step time flat in the batch (launch-bound steps, as on an H200): min_time keeps improving with the batch and
    takes the largest the search allows; the answer says the range set the pick and how far its epochs are
    extrapolated. Step time proportional to the batch: the pick is inside the range, and nothing is said."""
    spec = JobSpec.model_validate(spec_dict(objective="min_time"))
    flat = plan(spec, [measurement(b, beta_s_per_sample=1e-6) for b in [8, 16, 32, 64, 128]])
    edge = flat["search_space"]["chosen_at_edge"]
    assert flat["chosen"]["device_batch"] == 128 and edge["global_batch"] == flat["chosen"]["global_batch"]
    assert edge["next_smaller_global_batch"] == 64 * flat["chosen"]["accumulation"] and edge["improvement"] > 0
    assert edge["batch_over_reference"] == pytest.approx(flat["chosen"]["global_batch"] / 32)
    assert "the range set this pick" in edge["why"] and "farthest extrapolation" in edge["why"]
    inside = plan(spec, [measurement(b, beta_s_per_sample=1e-3) for b in [8, 16, 32, 64, 128]])
    assert inside["chosen"]["device_batch"] < 128 and inside["search_space"]["chosen_at_edge"] is None
    knee = plan(JobSpec.model_validate(spec_dict(objective="knee")), [measurement(b, beta_s_per_sample=1e-6) for b in [8, 16, 32, 64, 128]])
    assert knee["search_space"]["chosen_at_edge"] is None  # the knee, a deadline or a budget set their own picks
