"""Batch-size schedules (tula_service.plan.schedule): the closed forms minimize the model they come from, the
noise profile keeps the plan's mean, a constant batch is predicted as the plan predicts it, and a plan with a
growing noise scale recommends a schedule while one without a trajectory keeps the batch constant."""

import math

import numpy as np
import pytest

from tests.handmade import measurement, spec_dict
from tula_service.fit.perfmodel.efficiency import adascale_gain
from tula_service.plan.recommend import plan
from tula_service.plan.schedule import Config, closed_form_batch, evaluate, flat_profile, noise_profile, progress_per_step
from tula_service.spec.job_spec import JobSpec

BATCHES = [8, 16, 32, 64, 128]
REFERENCE_BATCH, SAMPLES = 32, 50_000


def growing_records(records=49, growth=1.0):
    """A reference run at batch 32 whose |G|^2 falls as 1 / (1 + i): the noise scale grows about 50x."""
    return [{"samples": 10_000 * i, "batch": REFERENCE_BATCH, "grad_sqr": 1.0 / (1 + i) ** growth, "trace_sigma": 20.0, "variability": 0.2}
            for i in range(1, records + 1)]  # fmt: skip


@pytest.mark.parametrize("x, noise, alpha, beta", [(0.3, 500.0, 0.01, 1e-4), (0.8, 50.0, 0.2, 1e-3), (0.05, 5000.0, 0.0, 1e-5), (1.0, 200.0, 0.05, 1e-4)])
def test_the_closed_form_minimizes_time_per_progress_at_a_prescribed_lr(x, noise, alpha, beta):
    grid = np.geomspace(1e-2, 1e6, 400_001)
    gain = 2 * x - x**2 * (1 + noise / grid)
    cost = np.where(gain > 0, (alpha + beta * grid) / np.maximum(gain, 1e-300), np.inf)
    assert closed_form_batch(x, noise, alpha, beta) == pytest.approx(grid[np.argmin(cost)], rel=1e-3)


def test_without_a_step_overhead_the_batch_is_proportional_to_the_lr():
    # alpha -> 0: B* = 2 x B_noise / (2 - x), linear in x for small x (the convex bound's B_t proportional to eta_t)
    for x in (0.01, 0.02, 0.04):
        assert closed_form_batch(x, 1000.0, 0.0, 1e-4) == pytest.approx(2 * x * 1000.0 / (2 - x))
    assert closed_form_batch(0.04, 1000.0, 0.0, 1e-4) / closed_form_batch(0.01, 1000.0, 0.0, 1e-4) == pytest.approx(4, rel=0.02)


def test_the_best_lr_for_the_batch_makes_one_over_one_plus_noise_over_batch_steps_of_progress():
    for batch, noise in ((64, 100.0), (1024, 10.0)):
        best = 1 / (1 + noise / batch)
        assert progress_per_step(best, batch, noise) == pytest.approx(progress_per_step(None, batch, noise))
        assert progress_per_step(best * 1.3, batch, noise) < progress_per_step(best, batch, noise) > progress_per_step(best * 0.7, batch, noise)


def test_the_noise_profile_keeps_the_models_mean_and_grows_along_the_run():
    records = growing_records()
    profile = noise_profile(records, "raw", target_samples=10 * SAMPLES, batch=REFERENCE_BATCH, noise_scale=1500.0, source="reference run")
    widths = np.diff(profile.edges)
    assert profile.edges[0] == 0 and profile.edges[-1] == pytest.approx(1) and (widths > 0).all()
    assert float(np.sum(profile.values * widths)) == pytest.approx(1500.0)  # the progress-weighted mean
    assert profile.values[-1] > 10 * profile.values[0] and not profile.flat
    assert profile.extrapolated_from is not None and profile.coverage == pytest.approx(0.98)


def test_records_that_stop_early_are_extended_by_their_trend_and_say_so():
    profile = noise_profile(growing_records(records=10), "raw", 10 * SAMPLES, REFERENCE_BATCH, 1500.0, "pilot")
    assert profile.coverage == pytest.approx(0.2)
    tail = profile.values[profile.edges[:-1] >= profile.extrapolated_from]
    assert tail.size == 4 and (np.diff(tail) >= 0).all()


def test_a_constant_batch_at_the_best_lr_takes_the_epochs_model_epochs():
    profile = noise_profile(growing_records(), "raw", 10 * SAMPLES, REFERENCE_BATCH, 1500.0, "reference run")
    min_steps = 10 * SAMPLES / (REFERENCE_BATCH + 1500.0)
    for batch in (32, 256, 4096):
        config = Config({"global_batch": batch, "step_time_s": {"value": 0.1}})
        predicted = evaluate(profile, [config] * profile.values.size, [None] * profile.values.size, min_steps)
        epochs = 10 / (1 + REFERENCE_BATCH / 1500.0) * (1 + batch / 1500.0)  # E_min (1 + B / B_noise)
        assert predicted["samples"] / SAMPLES == pytest.approx(epochs)
        assert predicted["seconds"] == pytest.approx(predicted["steps"] * 0.1)


def test_an_lr_too_high_for_the_noise_makes_no_progress():
    profile = flat_profile(1000.0, "test")
    config = Config({"global_batch": 10, "step_time_s": {"value": 0.1}})
    assert math.isinf(evaluate(profile, [config], [0.5], 100.0)["seconds"])  # 2x - x^2 (1 + 100) < 0


def _plan_with(records, **overrides):
    training = {"reference_lr": 0.1, **({"reference_run": {"gradient_stats": records}} if records else {})}
    spec = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, objective="min_time", training=training, **overrides))
    return plan(spec, [measurement(b) for b in BATCHES])


def test_a_growing_noise_scale_on_many_devices_gets_a_growing_schedule():
    rec = _plan_with(growing_records(), cluster={"gpus_per_node": 16, "interconnect_gbps": 1000})
    schedule, chosen = rec["training_advice"]["batch_schedule"], rec["chosen"]
    constant = schedule["schedules"]["constant"]
    assert constant["total_time_s"]["value"] == pytest.approx(chosen["total_time_s"]["value"], rel=2e-3)
    assert constant["stages"] == [pytest.approx(constant["stages"][0])] and constant["stages"][0]["global_batch"] == chosen["global_batch"]
    assert schedule["recommended"] != "constant" and schedule["predicted_gain"] >= 0.05
    best = schedule["schedules"][schedule["recommended"]]
    assert best["total_time_s"]["value"] == pytest.approx(constant["total_time_s"]["value"] * (1 - schedule["predicted_gain"]))
    for name in ("time_optimal", "noise_tracking", "staged_doubling"):
        stages = schedule["schedules"][name]["stages"]
        assert [s["global_batch"] for s in stages] == sorted(s["global_batch"] for s in stages)  # the noise scale only grows
        assert [s["from_epoch"] for s in stages] == sorted(s["from_epoch"] for s in stages) and stages[0]["from_epoch"] == 0
        assert all(s["global_batch"] == s["device_batch"] * s["devices"] * s["accumulation"] for s in stages)
    doubling = [s["global_batch"] for s in schedule["schedules"]["staged_doubling"]["stages"]]
    assert all(b == 2 * a for a, b in zip(doubling, doubling[1:]))
    lr = schedule["schedules"]["time_optimal"]["stages"]
    assert [s["lr_multiplier"] for s in lr] == sorted(s["lr_multiplier"] for s in lr)  # AdaScale: more batch, more LR
    for stage in lr:  # the gain at the stage's own noise scale: the best LR for its batch at that point of the run
        assert stage["lr_multiplier"] == pytest.approx(adascale_gain(stage["global_batch"] / 32, stage["noise_scale"], 32))
    prescribed = schedule["schedules"]["optimal_for_lr"]["stages"]
    assert all(s["lr_multiplier"] == pytest.approx(rec["training_advice"]["lr_rule"]["multiplier"]["value"]) for s in prescribed)
    assert all(c["source"] == "predicted" for c in (best["total_time_s"], best["epochs"]))


def test_without_a_trajectory_the_batch_stays_constant_and_says_why():
    rec = _plan_with(None)
    schedule = rec["training_advice"]["batch_schedule"]
    assert schedule["recommended"] == "constant" and "flat" in schedule["why"]
    assert all(len(s["stages"]) == 1 for s in schedule["schedules"].values())


def test_without_a_noise_scale_there_is_only_the_constant_batch():
    spec = JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, objective="min_time"))
    rec = plan(spec, [measurement(b, true_grad_sq_norm=-1.0) for b in BATCHES])
    schedule = rec["training_advice"]["batch_schedule"]
    assert schedule["recommended"] == "constant" and list(schedule["schedules"]) == ["constant"]
    assert "no noise scale" in schedule["why"]


def test_a_shape_mostly_extrapolated_from_a_short_trajectory_keeps_the_batch_constant():
    """Records over 20% of the run (below efficiency_evidence.WEAK_COVERAGE), extended by their trend: the schedules
    are still computed and shown, but the recommendation stays constant and says why."""
    rec = _plan_with(growing_records(records=10, growth=1.5), cluster={"gpus_per_node": 16, "interconnect_gbps": 1000})
    schedule = rec["training_advice"]["batch_schedule"]
    assert schedule["noise_profile"]["coverage"] == pytest.approx(0.2)
    assert schedule["recommended"] == "constant" and "weak evidence" in schedule["why"] and "20%" in schedule["why"]
    fastest = min(schedule["schedules"].values(), key=lambda s: s["total_time_s"]["value"])["total_time_s"]["value"]
    assert fastest <= 0.95 * schedule["schedules"]["constant"]["total_time_s"]["value"]  # past the 5% that would recommend it
    assert set(schedule["schedules"]) > {"constant", "time_optimal"}
    assert any("extrapolated" in caveat for caveat in schedule["caveats"])


@pytest.mark.parametrize("headroom, optimizer", [(1.0, "sgd"), (1.5, "sgd"), (1.2, "adam")])
def test_under_an_lr_cap_a_constant_batch_takes_the_capped_epochs_models_epochs(headroom, optimizer):
    """The plan's LR capped (a measured headroom, or a plateau's reference LR): a schedule's bins take the capped
    step, predicted as EpochModel predicts a capped batch (the geometric middle of no cost and the quadratic model's),
    so that "constant" is the plan's prediction and a schedule that climbs far past the noise scale at the capped LR
    is predicted slow (the GRU under SGD after the plateau guard: time_optimal was predicted 38% faster and missed)."""
    from tula_service.fit.perfmodel import EpochModel
    from tula_service.fit.perfmodel.efficiency import max_step_gain
    from tula_service.plan.schedule import LRCap, bin_progress

    noise = 1500.0
    model = EpochModel(REFERENCE_BATCH, 10.0, noise, optimizer=optimizer, lr_headroom=headroom)
    cap = LRCap(model.cap_gain(), REFERENCE_BATCH)
    assert model.cap_gain() == pytest.approx(max_step_gain(optimizer, 1.0, headroom))
    profile, min_steps = flat_profile(noise, "test"), 10 * SAMPLES / (REFERENCE_BATCH + noise)
    for batch in (32, 256, 4096):
        config = Config({"global_batch": batch, "step_time_s": {"value": 0.1}})
        predicted = evaluate(profile, [config], [None], min_steps, cap)
        assert predicted["samples"] / SAMPLES == pytest.approx(float(model.predict(batch)), rel=1e-9)
    best = progress_per_step(None, 4096, noise)
    capped = progress_per_step(cap.fraction(noise), 4096, noise)
    assert bin_progress(None, 4096, noise, cap) == pytest.approx(math.sqrt(best * capped)) and capped < best
    assert bin_progress(None, 16, noise, cap) == pytest.approx(progress_per_step(None, 16, noise))  # below the cap: as before
