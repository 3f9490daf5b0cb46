"""Training advice that comes with a recommendation: LR rule, warm-up, AGS, runner-ups (the batch schedule: test_schedule.py)."""

import math

import pytest

from tests.handmade import measurement, spec_dict
from tula_service.fit.perfmodel.efficiency import adascale_gain
from tula_service.plan.advice import AGS_MAX_SCALE
from tula_service.plan.recommend import plan
from tula_service.spec.job_spec import JobSpec

BATCHES = [8, 16, 32, 64, 128]


def _plan(params=None, **overrides):
    spec = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, **overrides))
    return plan(spec, [measurement(b, **(params or {})) for b in BATCHES])


def test_adascale_gain_runs_from_one_to_k():
    assert adascale_gain(8, noise_scale=1e-9, reference_batch=32) == pytest.approx(1.0)
    assert adascale_gain(8, noise_scale=1e12, reference_batch=32) == pytest.approx(8.0)
    assert 1 < adascale_gain(8, 32.0, 32) < 8


def test_adascale_gain_equals_the_variance_form():
    # r = (sigma^2 + |G|^2) / (sigma^2 / k + |G|^2), sigma^2 = tr(Sigma) / B_ref; B_noise = tr(Sigma) / |G|^2
    true_sq, trace, k, reference = 0.3, 120.0, 4.0, 32
    variance = trace / reference
    assert adascale_gain(k, trace / true_sq, reference) == pytest.approx((variance + true_sq) / (variance / k + true_sq))


def test_lr_rule_uses_the_measured_adascale_gain_for_sgd():
    rec = _plan(objective="min_time", training={"reference_lr": 0.1})
    rule = rec["training_advice"]["lr_rule"]
    k = rec["chosen"]["global_batch"] / 32
    assert rule["batch_ratio_k"] == pytest.approx(k)
    assert rule["multipliers"]["linear"] == pytest.approx(k) and rule["multipliers"]["sqrt"] == pytest.approx(math.sqrt(k))
    assert rule["recommended"] == "adascale" and rule["multiplier"]["source"] == "fitted"
    assert rule["lr"]["value"] == pytest.approx(0.1 * rule["multipliers"]["adascale"])


@pytest.mark.parametrize(("optimizer", "name"), [("adam", "Adam"), ("rmsprop", "RMSprop"), ("nadam", "NAdam"), ("radam", "RAdam"), ("adamax", "Adamax"),
                                               ("adagrad", "Adagrad"), ("adafactor", "Adafactor")])  # fmt: skip
def test_lr_rule_for_adaptive_optimizers_takes_square_roots(optimizer, name):
    rule = _plan(objective="min_time", training={"optimizer": optimizer})["training_advice"]["lr_rule"]
    k = rule["batch_ratio_k"]
    assert rule["multipliers"]["adascale"] == pytest.approx(math.sqrt(adascale_gain(k, 100.0, 32)))
    assert f"(square root for {name})" in rule["why"]


def test_without_noise_measurement_lr_rule_is_linear_and_assumed():
    rule = _plan({"true_grad_sq_norm": -1.0}, objective="min_time")["training_advice"]["lr_rule"]
    assert rule["recommended"] == "linear" and rule["multiplier"]["source"] == "assumed"


def test_warmup_is_bounded_by_five_epochs_and_a_tenth_of_training():
    rec = _plan(objective="min_time")
    advice, chosen = rec["training_advice"]["warmup"], rec["chosen"]
    if chosen["global_batch"] > 32:
        assert advice["epochs"] == pytest.approx(min(5.0, 0.1 * chosen["epochs"]["value"]))
        assert advice["steps"] > 0
    else:
        assert advice["steps"] == 0


def test_ags_delta_is_the_median_variability_scaled_to_the_chosen_batch_and_s_is_capped():
    spec = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, objective="min_time", cluster={"gpus_per_node": 16, "interconnect_gbps": 1000}))
    points = [measurement(b, trace_sigma=1e3) for b in BATCHES]  # B_noise = 1000 (|G|^2 = 1)
    series = ([0.1, 0.3], [0.2], [0.4, 0.5], [0.6], [0.7])
    for point, values in zip(points, series):
        point["gradient"]["variability_series"] = values
    rec = plan(spec, points)
    ags, chosen = rec["training_advice"]["ags"], rec["chosen"]["global_batch"]
    noise_scale = rec["models"]["efficiency"]["noise_scale"]["value"]
    scaled = [v * math.sqrt((b + noise_scale) / (chosen + noise_scale)) for b, values in zip(BATCHES, series) for v in values]
    assert chosen > max(BATCHES)  # so that the scaling matters
    assert ags["delta"]["value"] == pytest.approx(sorted(scaled)[len(scaled) // 2]) and ags["delta"]["source"] == "predicted"
    assert ags["delta"]["value"] < 0.4  # a larger batch has a steadier gradient norm
    assert ags["s"]["value"] <= AGS_MAX_SCALE and ags["s"]["source"] == "fitted"


def test_ags_delta_comes_from_the_reference_runs_variability_when_given():
    records = [{"samples": 320 * i, "batch": 32, "grad_sqr": 1.0, "trace_sigma": 400.0, "variability": 0.2 + 0.01 * i} for i in range(20)]
    rec = _plan(objective="min_time", training={"reference_run": {"gradient_stats": records}})
    delta = rec["training_advice"]["ags"]["delta"]
    assert delta["evidence"] == "reference run" and "batch 32" in delta["why"]


def test_ags_defaults_to_the_studys_delta_without_measurements():
    assert _plan()["training_advice"]["ags"]["delta"]["value"] == 0.5


def test_runner_ups_come_with_their_deltas():
    rec = _plan(objective="min_time", cluster={"gpus_per_node": 4})
    ups = rec["runner_ups"]
    assert len(ups) == 3
    assert all(u["time_delta_pct"] >= 0 for u in ups)  # min_time: nothing is faster than the chosen
    assert all(u["source"] == "predicted" and u["rel_err"] == rec["chosen"]["total_time_s"]["rel_err"] for u in ups)


def test_lr_advice_never_exceeds_max_lr_and_says_so():
    free = _plan(objective="min_time", training={"reference_batch": 8, "reference_lr": 0.1})["training_advice"]["lr_rule"]["lr"]
    assert free["value"] > 0.15 and "capped_from" not in free  # the rule asks for more than 0.15 here
    rec = _plan(objective="min_time", training={"reference_batch": 8, "reference_lr": 0.1, "max_lr": 0.15})
    lr = rec["training_advice"]["lr_rule"]["lr"]
    assert lr["value"] == 0.15 and lr["capped_from"] == pytest.approx(0.1 * rec["training_advice"]["lr_rule"]["multiplier"]["value"])
    assert "max_lr" in lr["why"]


def test_a_raised_lr_says_whether_its_stability_is_the_users_evidence_or_assumed():
    from tula_service.plan.advice import LR_STABILITY_ASSUMED

    rule = _plan(objective="min_time", training={"reference_batch": 8, "reference_lr": 0.1})["training_advice"]["lr_rule"]
    assert rule["multiplier"]["value"] > 1 and rule["stability"] == {"source": "assumed", "why": LR_STABILITY_ASSUMED}
    capped = _plan(objective="min_time", training={"reference_batch": 8, "reference_lr": 0.1, "max_lr": 0.15})["training_advice"]["lr_rule"]
    assert capped["stability"]["source"] == "spec" and "max_lr" in capped["stability"]["why"]
    below = _plan(objective="min_time", training={"reference_batch": 512})["training_advice"]["lr_rule"]
    assert below["multiplier"]["value"] <= 1 and below.get("stability") is None  # the LR is not raised


def test_an_sgd_lr_rule_says_which_momentum_it_is_for():
    assumed = _plan(objective="min_time", training={"reference_batch": 8})["training_advice"]["lr_rule"]
    assert assumed["momentum"] == {"value": 0.9, "source": "assumed"}
    plain = _plan(objective="min_time", training={"reference_batch": 8, "momentum": 0})["training_advice"]["lr_rule"]
    assert plain["momentum"] == {"value": 0.0, "source": "spec"}
    adam = _plan(objective="min_time", training={"reference_batch": 8, "optimizer": "adam"})["training_advice"]["lr_rule"]
    assert adam.get("momentum") is None
    assert adam["optimizer_settings"]["betas"] == {"value": [0.9, 0.999], "source": "assumed"}
    assert plain["optimizer_settings"]["momentum"] == plain["momentum"] and plain["optimizer_settings"]["nesterov"]["value"] is False


def test_max_lr_makes_the_plan_expect_more_epochs_at_large_batches_and_reports_the_gain():
    free = _plan(objective="min_time", training={"reference_lr": 0.1})
    capped = _plan(objective="min_time", training={"reference_lr": 0.1, "max_lr": 0.2})
    gain = capped["models"]["efficiency"]["max_step_gain"]
    assert gain["value"] == pytest.approx(2.0) and gain["source"] == "spec"
    assert free["models"]["efficiency"]["max_step_gain"] is None
    by_batch = lambda rec: {r["global_batch"]: r["epochs"]["value"] for r in rec["candidates"] if r["devices"] == 1}  # noqa: E731
    free_epochs, capped_epochs = by_batch(free), by_batch(capped)
    assert capped_epochs[32] == pytest.approx(10.0) == free_epochs[32]  # the reference run: B_ref 32, 10 epochs
    largest = max(capped_epochs)
    assert capped_epochs[largest] == pytest.approx(10.0 * largest / (32 * 2.0))
    assert capped_epochs[largest] > free_epochs[largest]
    assert capped["chosen"]["global_batch"] <= free["chosen"]["global_batch"]


def test_a_price_so_small_that_the_cost_underflows_gives_no_cost_delta_instead_of_a_server_error():
    spec = spec_dict(objective="min_cost")
    spec["pricing"] = {"kind": "gpu_hour", "price": 5e-324, "fixed_overhead_usd": 0.0}  # found by schemathesis: a 500 before
    rec = plan(JobSpec.model_validate(spec), [measurement(b) for b in (8, 16, 32, 64, 128)])
    assert rec["chosen"]["cost_usd"]["value"] == 0.0
    assert rec["runner_ups"] and all(r["cost_delta_pct"] is None and r["time_delta_pct"] is not None for r in rec["runner_ups"])


def test_a_device_memory_so_large_that_its_bytes_overflow_plans_as_unbounded_memory():
    spec = spec_dict(objective="min_time")  # 1.3e308 GiB is inf bytes: found by schemathesis, a 500 (int of NaN) before
    spec["cluster"] = {"nodes": 1, "gpus_per_node": 4, "device_memory_gib": 1.3e308}
    rec = plan(JobSpec.model_validate(spec), [measurement(b) for b in (8, 16, 32, 64, 128)])
    assert max(c["device_batch"] for c in rec["candidates"]) >= 128  # memory bounds nothing
    assert all(math.isfinite(c["total_time_s"]["value"]) for c in rec["candidates"])
