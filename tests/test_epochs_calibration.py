"""The calibrated interval: how far the noise scale read may be from the one the epochs need, measured across
tasks (tula_service.fit.epochs_calibration), and how it reaches the candidates' epochs, time and cost."""

import json
import math

import numpy as np
import pytest

from tests.handmade import measurement, spec_dict
from tula_service.fit.epochs_calibration import (
    CALIBRATION_PATH, MIN_TASKS, calibrated_interval, calibration_factors, exact_noise_scale, load_calibration,
)  # fmt: skip
from tula_service.fit.perfmodel.efficiency import EpochModel
from tula_service.plan.recommend import plan
from tula_service.spec.job_spec import JobSpec

BATCHES = [8, 16, 32, 64, 128]
POINTS = [measurement(b) for b in BATCHES]  # B_noise at initialization: 100
CALIBRATION = {"measured": "2026-01-01", "evidence": {"reference_run": {
    "factors": [0.5, 4.0], "quantiles": [0.1, 0.9], "tasks": 6, "pairs": 30, "reads": "the reference run's records",
    "leave_one_task_out_inside": {"a": [4, 5], "b": [5, 5]},
}}}  # fmt: skip


def test_the_exact_noise_scale_inverts_the_epochs_model_and_says_0_or_inf_past_its_reach():
    model = EpochModel(32, 10.0, 400.0)
    for batch in (8, 16, 64, 256, 4096):
        assert exact_noise_scale(32, 10.0, batch, float(model.predict(batch))) == pytest.approx(400.0)
    assert exact_noise_scale(32, 10.0, 64, 10.0) == math.inf  # the epochs did not grow: no finite B_noise
    assert exact_noise_scale(32, 10.0, 64, 9.0) == math.inf  # they fell: none either
    assert exact_noise_scale(32, 10.0, 64, 20.0) == 0.0  # as many steps as the reference: B_noise -> 0
    assert exact_noise_scale(32, 10.0, 64, 25.0) == 0.0  # past that bound
    assert exact_noise_scale(32, 10.0, 16, 10.0) == math.inf and exact_noise_scale(32, 10.0, 16, 4.0) == 0.0
    with pytest.raises(ValueError, match="reference batch"):
        exact_noise_scale(32, 10.0, 32, 10.0)


def test_each_task_weighs_the_same_in_the_quantiles_whatever_its_batches():
    even = {f"t{i}": [2.0 ** (i - 3)] for i in range(7)}  # one ratio each: 1/8 .. 8
    crowded = {**even, "t0": [1 / 8] * 50}  # the same task, measured at 50 batches
    assert calibration_factors(even)["factors"] == pytest.approx(calibration_factors(crowded)["factors"])
    factors = calibration_factors(even)
    assert factors["factors"] == pytest.approx([0.125, 8.0]) and factors["median_ratio"] == pytest.approx(1.0)
    assert factors["tasks"] == 7 and factors["pairs"] == 7
    # left out in turn, the two extreme tasks fall outside the others' quantiles, the five in between inside
    assert factors["leave_one_task_out_inside"] == {"t0": [0, 1], "t1": [1, 1], "t2": [1, 1], "t3": [1, 1], "t4": [1, 1],
                                                    "t5": [1, 1], "t6": [0, 1]}  # fmt: skip


def test_zero_and_infinite_ratios_count_and_too_few_tasks_give_no_calibration():
    ratios = {f"t{i}": [1.0] for i in range(MIN_TASKS)} | {"never_moved": [math.inf] * 3, "steps_bound": [0.0]}
    factors = calibration_factors(ratios)
    assert factors["tasks"] == MIN_TASKS + 2 and factors["factors"][0] == 0.0 and factors["factors"][1] == math.inf
    assert calibration_factors({f"t{i}": [1.0] for i in range(MIN_TASKS - 1)}) is None
    assert calibration_factors({f"t{i}": [] for i in range(MIN_TASKS)}) is None


def test_the_interval_is_the_read_times_the_factors_joined_with_the_statistical_one():
    interval = calibrated_interval("reference_run", 200.0, (150.0, 300.0), CALIBRATION)
    assert interval["value"] == [100.0, 800.0] and interval["factors"] == [0.5, 4.0] and interval["source"] == "fitted"
    assert "9 of the 30 batches' epochs fell inside" in interval["why"] and "0.1-0.9" not in interval["why"]
    wide = calibrated_interval("reference_run", 200.0, (50.0, 1000.0), CALIBRATION)
    assert wide["value"] == [50.0, 1000.0]  # a statistical interval wider than the factors stands
    assert calibrated_interval("other_runs", 200.0, None, CALIBRATION) is None  # fitted to epochs: not calibrated this way
    assert calibrated_interval("pilot", 200.0, None, CALIBRATION) is None  # no factors measured for it here
    assert calibrated_interval("reference_run", None, None, CALIBRATION) is None


def test_a_pilot_takes_the_factors_of_the_longest_prefix_it_covers():
    entry = lambda factors, coverage: {**CALIBRATION["evidence"]["reference_run"], "factors": factors, "coverage": coverage}  # noqa: E731
    calibration = {"evidence": {**CALIBRATION["evidence"], "prefix@0.05": entry([1.0, 40.0], 0.05),
                                "prefix@0.25": entry([1.0, 20.0], 0.25), "prefix@0.5": entry([0.5, 10.0], 0.5)}}  # fmt: skip
    for coverage, key, high in ((0.01, "prefix@0.05", 40.0), (0.05, "prefix@0.05", 40.0), (0.3, "prefix@0.25", 20.0),
                                (0.9, "prefix@0.5", 10.0), (1.0, "reference_run", 4.0), (None, "prefix@0.05", 40.0)):
        interval = calibrated_interval("pilot", 100.0, None, calibration, coverage=coverage)
        assert (interval["calibration"], interval["value"][1]) == (key, 100.0 * high)
    cut_short = calibrated_interval("reference_run", 100.0, None, calibration, coverage=0.3)  # records stopping early
    assert cut_short["calibration"] == "prefix@0.25"  # are as far off as a pilot that reached as far
    for coverage in (0.995, None):
        assert calibrated_interval("reference_run", 100.0, None, calibration, coverage=coverage)["calibration"] == "reference_run"


def test_the_epochs_interval_closes_at_the_reference_batch_and_opens_with_the_distance_from_it():
    model = EpochModel(32, 10.0, 400.0, noise_scale_range=(200.0, 1600.0))
    assert model.interval(32) == pytest.approx((10.0, 10.0))
    low, high = model.interval(1024)
    assert low == pytest.approx(float(EpochModel(32, 10.0, 1600.0).predict(1024)))  # the larger B_noise: fewer epochs
    assert high == pytest.approx(float(EpochModel(32, 10.0, 200.0).predict(1024)))
    assert low < float(model.predict(1024)) < high
    small = model.interval(8)  # below the reference the order turns: the smaller B_noise gives fewer epochs there
    assert small[0] == pytest.approx(float(EpochModel(32, 10.0, 200.0).predict(8)))
    width = [model.interval(b)[1] / model.interval(b)[0] for b in (64, 256, 1024)]
    assert width == sorted(width) and width[0] > 1
    assert EpochModel(32, 10.0, 400.0).interval(1024) is None  # no range, no cap: nothing to report
    fitted = EpochModel(32, 10.0, 400.0, min_epochs=8.0, noise_scale_range=(200.0, 1600.0))
    assert fitted.interval(1024) is None  # E_min fitted to measured runs: the range was not measured for that
    with pytest.raises(ValueError, match="noise_scale_range"):
        EpochModel(32, 10.0, 400.0, noise_scale_range=(800.0, 200.0))
    to_zero = EpochModel(32, 10.0, 400.0, noise_scale_range=(0.0, math.inf))  # a statistical interval reaching 0, say
    assert to_zero.interval(128) == pytest.approx((10.0, 40.0))  # from no loss at all to the steps bound E_ref B / B_ref
    assert to_zero.interval(8) == pytest.approx((2.5, 10.0))


def test_with_an_lr_cap_the_interval_holds_the_caps_interval_too():
    capped = EpochModel(32, 4.0, 80.0, lr_headroom=1.1, noise_scale_range=(70.0, 90.0))
    low, high = capped.interval(256)
    cap_low, cap_high = capped.cap_interval(256)
    assert low <= cap_low and high >= cap_high


def test_the_shipped_calibration_is_what_its_own_ratios_give():
    """configs/epochs_calibration.json, written by benchmarks/statistical_efficiency.py: its factors are the quantiles
    of the ratios it lists (a hand edit of either shows here), and the service reads it."""
    shipped = json.loads(CALIBRATION_PATH.read_text())
    assert shipped == load_calibration()
    assert set(shipped["evidence"]) == {"reference_run", "prefix@0.05", "prefix@0.25", "prefix@0.5", "prefix@0.75", "initialization"}
    for entry in shipped["evidence"].values():
        ratios = {name: [math.inf if k == "inf" else k for k in ks] for name, ks in entry["ratios"].items()}
        assert calibration_factors(ratios, tuple(entry["quantiles"]))["factors"] == pytest.approx(entry["factors"])
        assert entry["factors"][0] < entry["median_ratio"] < entry["factors"][1]


def _plan(training, **overrides):
    return plan(JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, training=training, **overrides)), POINTS)


def test_every_candidate_carries_the_calibrated_interval_of_its_epochs_time_and_cost():
    stats = [{"samples": 10_000 * (i + 1), "batch": 32, "grad_sqr": 1.0, "trace_sigma": 500.0, "window_steps": 5} for i in range(50)]
    rec = _plan({"reference_run": {"gradient_stats": stats}}, pricing={"kind": "gpu_hour", "price": 2.0, "fixed_overhead_usd": 10.0})
    noise = rec["models"]["efficiency"]["noise_scale"]
    shipped = load_calibration()["evidence"]["reference_run"]["factors"]
    assert noise["calibrated_interval"]["value"][0] == pytest.approx(min(noise["value"] * shipped[0], noise["interval"][0]))
    assert noise["calibrated_interval"]["value"][1] == pytest.approx(max(noise["value"] * shipped[1], noise["interval"][1]))
    for row in rec["candidates"]:
        low, high = row["epochs"]["calibrated_interval"]
        assert low <= row["epochs"]["value"] <= high
        ratio = (low / row["epochs"]["value"], high / row["epochs"]["value"])
        assert row["total_time_s"]["calibrated_interval"] == pytest.approx([row["total_time_s"]["value"] * f for f in ratio])
        cost = row["cost_usd"]
        assert cost["calibrated_interval"] == pytest.approx([10.0 + (cost["value"] - 10.0) * f for f in ratio])  # overhead stays
    at_reference = [r for r in rec["candidates"] if r["global_batch"] == 32]
    assert at_reference and all(r["epochs"]["calibrated_interval"] == pytest.approx([10.0, 10.0]) for r in at_reference)
    curve = rec["curves"]["epochs"]
    assert all(lo <= e <= hi for lo, e, hi in zip(curve["calibrated_low"], curve["epochs"], curve["calibrated_high"]))


def test_epochs_fitted_to_measured_runs_carry_the_fits_prediction_interval_not_factors():
    """No factors were measured for runs; with the profiled points' noise scale as the prior, the candidates and the
    curve carry the joint fit's 80% prediction interval, which is tight at the measured batches and widens away."""
    rec = _plan({"other_runs": [{"batch": 64, "epochs": 12.0}, {"batch": 128, "epochs": 16.0}]})
    assert rec["models"]["efficiency"]["noise_scale"]["calibrated_interval"] is None
    spread = {row["global_batch"]: np.log(row["epochs"]["calibrated_interval"][1] / row["epochs"]["calibrated_interval"][0])
              for row in rec["candidates"]}  # fmt: skip
    assert all(low < row["epochs"]["value"] < high for row in rec["candidates"] for low, high in [row["epochs"]["calibrated_interval"]])
    assert spread[max(spread)] > spread[128]
    curve = rec["curves"]["epochs"]
    assert len(curve["calibrated_low"]) == len(curve["global_batch"])


def test_a_statistical_interval_reaching_zero_plans_with_the_steps_bound_as_its_end():
    """Initial-weight statistics that scatter so much that 0 is within two standard errors of their B_noise (as a real
    profile of the example CNN gave): the calibrated interval starts at 0 and the epochs' high end is E_ref B / B_ref."""
    points = [measurement(b, trace_sigma=sigma) for b, sigma in zip(BATCHES, (5.0, 2000.0, 1.0, 3000.0, 2.0))]
    rec = plan(JobSpec.model_validate(spec_dict(batch_sizes=BATCHES, objective="min_time")), points)
    noise = rec["models"]["efficiency"]["noise_scale"]
    assert noise["interval"][0] == 0.0 and noise["calibrated_interval"]["value"][0] == 0.0
    for row in rec["candidates"]:
        low, high = row["epochs"]["calibrated_interval"]
        steps_bound = 10.0 * row["global_batch"] / 32  # E_ref B / B_ref of the hand-made spec (B_ref 32, E_ref 10)
        assert (high if row["global_batch"] >= 32 else low) == pytest.approx(steps_bound, rel=1e-6)


def test_a_reference_run_cut_short_of_its_target_is_as_uncertain_as_a_pilot_that_reached_as_far():
    target_samples = 10 * 50_000  # reference_epochs x num_samples of the hand-made spec
    whole = [{"samples": target_samples * (i + 1) // 50, "batch": 32, "grad_sqr": 1.0, "trace_sigma": 500.0} for i in range(50)]
    short = [r for r in whole if r["samples"] <= 0.3 * target_samples]
    noise = {name: _plan({"reference_run": {"gradient_stats": stats}})["models"]["efficiency"]["noise_scale"]
             for name, stats in (("whole", whole), ("short", short))}  # fmt: skip
    assert noise["whole"]["calibrated_interval"]["calibration"] == "reference_run"
    assert noise["short"]["evidence"] == "reference_run" and noise["short"]["calibrated_interval"]["calibration"] == "prefix@0.25"
    width = {name: n["calibrated_interval"]["value"][1] / n["calibrated_interval"]["value"][0] for name, n in noise.items()}
    assert width["short"] > width["whole"]


def test_a_prior_comes_from_the_calibration_and_a_degenerate_one_gives_none():
    """ln B_noise ~ N(ln(read x median ratio), ln(q_hi / q_lo) / (2 z)); factors that meet or reach 0 give no prior (the
    runs alone decide), and so does a calibration without a run scatter."""
    from statistics import NormalDist

    from tula_service.fit.epochs_calibration import noise_scale_prior

    entry = {"factors": [0.5, 2.0], "quantiles": [0.1, 0.9], "median_ratio": 0.8}
    calibration = {"evidence": {"reference_run": entry}, "run_scatter": {"rms_log": 0.1}}
    prior = noise_scale_prior("reference_run", 100.0, calibration)
    assert prior["center"] == pytest.approx(80.0) and prior["run_scatter_log"] == 0.1
    assert prior["sigma_log"] == pytest.approx(np.log(4.0) / (2 * NormalDist().inv_cdf(0.9)))
    for factors in ([1.0, 1.0], [0.0, 2.0]):
        assert noise_scale_prior("reference_run", 100.0, {**calibration, "evidence": {"reference_run": {**entry, "factors": factors}}}) is None
    assert noise_scale_prior("reference_run", 100.0, {"evidence": {"reference_run": entry}}) is None
    assert noise_scale_prior("reference_run", None, calibration) is None
