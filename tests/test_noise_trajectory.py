"""The noise scale for the target read from a training run's gradient statistics, and E_min/B_noise from runs."""

import math

import numpy as np
import pytest

from tula_service.fit.perfmodel.efficiency import PERFECT_SCALING_NOISE_SCALE_FACTOR, EpochModel, fit_epochs_to_runs
from tula_service.fit.perfmodel.noise_trajectory import TrajectoryNoiseScale


def power_law_records(count: int, last_samples: float, slope: float = 1.0, level: float = 100.0, start: float = 1000.0, noise: float = 0.0, seed: int = 0):
    """Records whose noise scale is level (samples / start)^slope, |G|^2 = 1 (times multiplicative noise)."""
    rng = np.random.default_rng(seed)
    samples = np.geomspace(start, last_samples, count)
    records = []
    for s in samples:
        grad_sqr = 1.0 * (1 + noise * rng.standard_normal())
        records.append({"samples": int(s), "batch": 32, "grad_sqr": grad_sqr, "trace_sigma": level * (s / start) ** slope, "window_steps": 10})
    return records


def progress_weighted(records, low, high):
    """B_eff = sum n (1 - r) / sum (n / b) r, r = |G|^2 / (|G|^2 + tr / b), over the records in [low, high]; n the
    samples each stands for (trapezoidal rule, the end records held to the window's edges)."""
    inside = [r for r in records if low <= r["samples"] <= high]
    samples = np.array([r["samples"] for r in inside], dtype=float)
    spans = np.diff(np.concatenate([[low], (samples[1:] + samples[:-1]) / 2, [high]]))
    batch = np.array([r["batch"] for r in inside], dtype=float)
    signal = np.array([r["grad_sqr"] / (r["grad_sqr"] + r["trace_sigma"] / r["batch"]) for r in inside])
    return float(np.sum(spans * (1 - signal)) / np.sum(spans / batch * signal))


def test_a_full_trajectory_is_read_over_the_second_half_of_the_run_weighted_by_progress():
    target = 1e6
    records = power_law_records(40, target)
    estimate = TrajectoryNoiseScale().fit(records, target)
    assert estimate.noise_scale_ == pytest.approx(progress_weighted(records, target / 2, target))
    assert "progress-weighted mean of the records between 50% and 100%" in estimate.method_
    assert not estimate.extrapolated_ and estimate.coverage_ == pytest.approx(1.0, rel=0.01)


def test_the_window_can_also_be_read_as_bins_or_one_pooled_ratio():
    target = 1e6
    records = power_law_records(40, target)
    second_half = [r for r in records if r["samples"] >= target / 2]
    bins = np.array_split(np.arange(len(second_half)), min(8, len(second_half)))
    ratios = [sum(second_half[i]["trace_sigma"] for i in b) / sum(second_half[i]["grad_sqr"] for i in b) for b in bins]
    assert TrajectoryNoiseScale(window_average="geometric").fit(records, target).noise_scale_ == pytest.approx(np.exp(np.mean(np.log(ratios))))
    pooled = TrajectoryNoiseScale(window_average="pooled").fit(records, target).noise_scale_
    assert pooled == pytest.approx(sum(r["trace_sigma"] for r in second_half) / sum(r["grad_sqr"] for r in second_half))
    assert TrajectoryNoiseScale(window_average="median").fit(records, target).noise_scale_ == pytest.approx(np.median(ratios))


def test_the_progress_weighted_noise_scale_makes_the_epochs_model_reproduce_a_varying_noise_scale():
    # the window's first half at B_noise 50, its second at 800, run at b = 32; the theory (McCandlish et al.
    # 2018): S(B) = sum dS_min (1 + B_noise / B), dS_min = steps / (1 + B_noise / b) in the run at b
    target, b = 1e6, 32
    records = [{"samples": int(s), "batch": b, "grad_sqr": 1.0, "trace_sigma": 50.0 if s <= 0.75 * target else 800.0}
               for s in np.linspace(0.5 * target, target, 101)[1:]]  # fmt: skip
    noise_scale = TrajectoryNoiseScale().fit(records, target).noise_scale_
    progress = {level: (target / 4 / b) / (1 + level / b) for level in (50.0, 800.0)}  # dS_min of each half
    steps = lambda batch: sum(p * (1 + level / batch) for level, p in progress.items())  # noqa: E731
    for batch in (32, 256, 4096):
        epochs_ratio = (batch * steps(batch)) / (b * steps(b))
        assert EpochModel(b, 1.0, noise_scale).predict(batch) == pytest.approx(epochs_ratio, rel=0.01)
    harmonic, arithmetic = 2 / (1 / 50 + 1 / 800), (50 + 800) / 2
    assert harmonic < noise_scale < arithmetic


def test_a_record_whose_signal_vanished_moves_the_progress_weighted_estimate_by_its_share_only():
    target = 1e5
    records = [{"samples": 5000 * (i + 1), "batch": 32, "grad_sqr": 1.0, "trace_sigma": 100.0} for i in range(20)]
    records[15] = dict(records[15], grad_sqr=1e-3)  # an all-but-zero |G|^2 window: its own ratio is 1e5
    estimate = TrajectoryNoiseScale().fit(records, target).noise_scale_
    assert estimate == pytest.approx(progress_weighted(records, target / 2, target))
    signal = 1 / (1 + 100 / 32)
    assert 100 < estimate < 32 * (1 / (signal * (1 - 5000 / 50_000)) - 1) + 1e-9  # at most its 1/10 of the window's progress lost


def test_one_bin_whose_signal_vanished_moves_the_geometric_mean_by_its_share_in_log_space_only():
    target = 1e5
    records = [{"samples": 5000 * (i + 1), "batch": 32, "grad_sqr": 1.0, "trace_sigma": 100.0} for i in range(20)]
    records[15] = dict(records[15], grad_sqr=1e-3)
    estimate = TrajectoryNoiseScale(window_average="geometric").fit(records, target)
    assert estimate.noise_scale_ == pytest.approx(100.0 * 1000 ** (1 / 8))  # one bin of 8, 1000x off


def test_records_are_placed_where_their_statistics_were_taken():
    """statistics_samples (the logger's, under sparse sampling a window's first steps) places a record, not the window's
    end: the records' window and coverage follow it, and a record closed past the target whose statistics came before it
    is read."""
    records = power_law_records(40, 200_000)
    moved = [{**r, "samples": r["samples"] + 5_000, "statistics_samples": r["samples"]} for r in records]
    target = 200_000
    at_end = TrajectoryNoiseScale().fit([{k: v for k, v in r.items() if k != "statistics_samples"} for r in moved], target)
    placed = TrajectoryNoiseScale().fit(moved, target)
    assert placed.noise_scale_ == pytest.approx(TrajectoryNoiseScale().fit(records, target).noise_scale_, rel=1e-12)
    assert placed.records_ == 40 and at_end.records_ < 40  # the last record closed past the target, its statistics before it
    early = [{**records[0], "samples": 150_000, "statistics_samples": 1_000}]  # the first window's pair, at 0.5% of the run
    assert TrajectoryNoiseScale().fit(early, target).coverage_ == pytest.approx(0.005)


def test_the_trend_alternative_is_read_at_a_fraction_of_the_run():
    target = 1e6
    estimate = TrajectoryNoiseScale(run_fraction=0.5, window=None).fit(power_law_records(40, target), target)
    assert estimate.noise_scale_ == pytest.approx(100.0 * (0.5 * target / 1000.0), rel=0.02)
    assert estimate.slope_ == pytest.approx(1.0, abs=0.01)


def test_records_past_the_target_are_not_used():
    target = 1e5
    longer = power_law_records(30, 1e5) + [{"samples": 10**7, "batch": 32, "grad_sqr": 1e-6, "trace_sigma": 1.0}] * 10
    assert TrajectoryNoiseScale().fit(longer, target).noise_scale_ == pytest.approx(
        TrajectoryNoiseScale().fit(power_law_records(30, 1e5), target).noise_scale_)


def test_the_report_carries_the_binned_trajectory_up_to_the_target_for_a_plot():
    target = 1e5
    records = power_law_records(30, 1e5, slope=0.5) + [{"samples": 10**7, "batch": 32, "grad_sqr": 1e-6, "trace_sigma": 1.0}]
    described = TrajectoryNoiseScale().fit(records, target).describe()
    bins = described["bins"]
    assert len(bins["samples"]) == len(bins["noise_scale"]) == 15  # 30 records within the target, 2 a bin
    assert max(bins["samples"]) < target and described["covered_samples"] == pytest.approx(1e5, rel=1e-4)
    first = records[:2]  # a bin: numerator and denominator pooled over its records, at their geometric mean
    assert bins["noise_scale"][0] == pytest.approx(sum(r["trace_sigma"] for r in first) / sum(r["grad_sqr"] for r in first))
    assert bins["samples"][0] == pytest.approx(math.sqrt(first[0]["samples"] * first[1]["samples"]))
    assert np.all(np.diff(bins["noise_scale"]) > 0)  # the noise scale grows along this run, as the bins show


def test_a_short_run_is_extrapolated_with_the_later_trend_and_says_so():
    target = 1e7
    estimate = TrajectoryNoiseScale().fit(power_law_records(30, 1e5, slope=0.5), target)
    assert estimate.extrapolated_ and estimate.coverage_ == pytest.approx(0.01, rel=0.05)
    assert estimate.noise_scale_ == pytest.approx(100.0 * (0.75 * target / 1000.0) ** 0.5, rel=0.05)  # the window's middle


def test_a_falling_early_trend_is_not_extended():
    target = 1e7
    falling = power_law_records(30, 1e5, slope=-0.5)
    estimate = TrajectoryNoiseScale().fit(falling, target)
    last = 100.0 * (1e5 / 1000.0) ** -0.5
    assert estimate.slope_ == 0.0 and estimate.noise_scale_ == pytest.approx(last, rel=0.1)


def test_a_trend_steeper_than_the_samples_is_extended_at_slope_one():
    """B_noise grows no faster than the samples seen (noise_trajectory's docstring, item 2): a pilot's cubic trend
    is extended from its last bin in proportion to the samples, not cubed."""
    target = 1e7
    steep = TrajectoryNoiseScale().fit(power_law_records(30, 1e5, slope=3.0), target)
    last = steep.bins_[-1]
    assert steep.slope_ == 1.0 and steep.extrapolated_
    assert steep.noise_scale_ == pytest.approx(last.noise_scale * 0.75 * target / last.samples, rel=0.05)
    assert steep.noise_scale_ < 100.0 * (0.75 * target / 1000.0) ** 3.0 / 1e3  # the cubic read gives thousands of times more


def test_a_run_evaluated_a_few_times_is_read_by_the_trend_through_its_records_not_their_pooled_ratio():
    """A trace with a row per epoch has three rows before an early target (the Pollux CIFAR-10 run at 90% of its best
    accuracy, every fourth row): one record in the window's second half, too few to pair into three bins. Each record
    is then its own bin and the trend through them is read at the window's middle; pooled over all of them, the first
    record's large |G|^2 weighed most, and the read was 104 where the whole trace reads 642 (122% epochs error)."""
    target = 12.0
    records = [{"samples": s, "batch": 32, "grad_sqr": 1.0, "trace_sigma": 10.0 * s} for s in (1.0, 5.0, 9.0)]  # B = 10 x samples
    estimate = TrajectoryNoiseScale().fit(records, target)
    assert "power-law trend" in estimate.method_ and len(estimate.bins_) == 3
    assert estimate.noise_scale_ == pytest.approx(10.0 * 0.75 * target, rel=0.02)  # the window's middle, on the trend
    pooled = sum(r["trace_sigma"] for r in records) / sum(r["grad_sqr"] for r in records)
    assert pooled < 0.6 * estimate.noise_scale_
    two = TrajectoryNoiseScale().fit(records[::2], target)  # two records: the trend through both, its slope held to [0, 1]
    assert two.noise_scale_ == pytest.approx(10.0 * 0.75 * target, rel=0.02) and two.slope_ == pytest.approx(1.0)
    low, high = two.interval_  # no resampling varies a trend through two bins: the bins' spread, the estimate inside
    assert low == pytest.approx(10.0) and high >= two.noise_scale_


def test_records_that_stop_short_of_the_windows_middle_are_bracketed_by_the_first_record_past_the_target():
    """A trace with a row every few epochs can leave one row before an early target, and a log usually goes on past
    the target. The first record past it then brackets the window's middle, and the trend through the records is
    interpolated there instead of the one record's value standing for the run (noise_trajectory's docstring, item 4);
    records further on are not used, nor any past the target where the records before it reach the middle."""
    target = 12.0
    before, after = {"samples": 1.0, "batch": 32, "grad_sqr": 1.0, "trace_sigma": 10.0}, {"samples": 24.0, "batch": 32, "grad_sqr": 1.0, "trace_sigma": 240.0}
    alone = TrajectoryNoiseScale().fit([before], target)
    assert alone.noise_scale_ == pytest.approx(10.0) and alone.extrapolated_ and alone.records_past_target_ == 0
    further = {"samples": 1e4, "batch": 32, "grad_sqr": 1e-6, "trace_sigma": 1.0}
    bracketed = TrajectoryNoiseScale().fit([before, after, further], target)
    assert bracketed.noise_scale_ == pytest.approx(10.0 * 0.75 * target)  # B = 10 x samples, read at 9
    assert not bracketed.extrapolated_ and bracketed.coverage_ == 1.0 and bracketed.records_ == 1
    assert bracketed.describe()["records_past_target"] == 1 and bracketed.describe()["covered_samples"] == 24.0
    dense = power_law_records(30, 1e5)  # a window it can read: the records past the target change nothing
    assert TrajectoryNoiseScale().fit(dense + [{**after, "samples": 2e5}], 1e5).records_past_target_ == 0
    late = {**before, "samples": 11.0, "trace_sigma": 110.0}  # one record, past the middle: nothing to bracket
    assert TrajectoryNoiseScale().fit([late, after], target).records_past_target_ == 0
    assert TrajectoryNoiseScale().fit([after], target).noise_scale_ is None  # none before the target: nothing read


def test_numerator_and_denominator_are_pooled_in_a_bin_before_dividing():
    # two records in one bin: |G|^2 of 2 and -0.5 (a noisy window) pool to 0.75, tr Sigma 150: B = 200
    records = [{"samples": 100, "batch": 8, "grad_sqr": 2.0, "trace_sigma": 100.0}, {"samples": 120, "batch": 8, "grad_sqr": -0.5, "trace_sigma": 50.0}]
    estimate = TrajectoryNoiseScale().fit(records, 1000.0)
    assert estimate.noise_scale_ == pytest.approx(100.0)  # sum w tr / sum w g = 150 / 1.5
    assert "pooled ratio" in estimate.method_


def test_the_interval_widens_with_noisier_records_and_holds_the_estimate():
    target = 1e6
    quiet = TrajectoryNoiseScale().fit(power_law_records(60, target, noise=0.05), target)
    noisy = TrajectoryNoiseScale().fit(power_law_records(60, target, noise=0.4), target)
    for estimate in (quiet, noisy):
        low, high = estimate.interval_
        assert low <= estimate.noise_scale_ <= high
    assert math.log(noisy.interval_[1] / noisy.interval_[0]) > math.log(quiet.interval_[1] / quiet.interval_[0])


def test_unresolved_statistics_give_no_noise_scale():
    records = [{"samples": 100 * i, "batch": 8, "grad_sqr": -1.0, "trace_sigma": 5.0} for i in range(1, 10)]
    estimate = TrajectoryNoiseScale().fit(records, 1e4)
    assert estimate.noise_scale_ is None and estimate.interval_ is None


def test_preconditioned_statistics_are_read_when_asked():
    records = [dict(r, trace_sigma=100.0, precond_grad_sqr=1.0, precond_trace_sigma=1000.0) for r in power_law_records(20, 1e5)]
    assert TrajectoryNoiseScale().fit(records, 1e5).noise_scale_ == pytest.approx(100.0)
    assert TrajectoryNoiseScale(statistic="preconditioned").fit(records, 1e5).noise_scale_ == pytest.approx(1000.0)


def test_runs_at_several_batches_give_e_min_and_b_noise():
    batches = [32, 128, 512, 2048]
    epochs = [10.0 * (1 + b / 400.0) for b in batches]
    fit = fit_epochs_to_runs(batches, epochs)
    assert fit["min_epochs"] == pytest.approx(10.0, rel=1e-4) and fit["noise_scale"] == pytest.approx(400.0, rel=1e-4)
    assert not fit["lower_bound"] and fit["rms_log_error"] < 1e-6


def test_epochs_that_blow_up_at_the_largest_batch_are_fitted_not_read_as_perfect_scaling():
    """digits_resnet_sgd_nesterov's truth (benchmarks/efficiency_tasks.py): 37 epochs at 512 against 6.3 at 256 put the
    straight line's intercept below 0; the fit once took that for perfect scaling (B_noise 512 000, a lower bound)."""
    batches = [16, 32, 64, 128, 256, 512]
    fit = fit_epochs_to_runs(batches, [3.12, 2.54, 2.94, 3.92, 6.32, 37.1])
    assert not fit["lower_bound"] and 20 < fit["noise_scale"] < 200 and fit["rms_log_error"] < 0.5


def test_runs_that_scale_perfectly_bound_b_noise_from_below():
    fit = fit_epochs_to_runs([32, 256], [10.0, 9.5])
    assert fit["lower_bound"] and fit["noise_scale"] == PERFECT_SCALING_NOISE_SCALE_FACTOR * 256


def test_a_prior_that_agrees_with_exact_runs_changes_nothing_and_its_interval_narrows_with_the_runs_reach():
    """With a prior centred on the truth, exact runs are fitted exactly; the 80% interval of B_noise (Laplace) holds it
    and is narrower when the runs span 64x than 2x. Runs that scale perfectly get a finite posterior instead of the
    lower bound (the prior bounds it), and a prior needs positive parameters."""
    prior = {"center": 400.0, "sigma_log": 1.0, "run_scatter_log": 0.08}
    widths = {}
    for largest in (64, 2048):
        batches = [32, largest]
        fit = fit_epochs_to_runs(batches, [10.0 * (1 + b / 400.0) for b in batches], prior)
        assert fit["noise_scale"] == pytest.approx(400.0, rel=1e-3) and fit["min_epochs"] == pytest.approx(10.0, rel=1e-3)
        low, high = fit["interval"]
        assert low < 400.0 < high and fit["runs_alone"]["noise_scale"] == pytest.approx(400.0, rel=1e-3)
        widths[largest] = np.log(high / low)
    assert widths[2048] < widths[64] / 2
    flat = fit_epochs_to_runs([32, 256], [10.0, 9.5], prior)
    assert flat["runs_alone"]["lower_bound"] and not flat["lower_bound"] and 400.0 < flat["noise_scale"] < PERFECT_SCALING_NOISE_SCALE_FACTOR * 256
    with pytest.raises(ValueError, match="run_scatter_log"):
        fit_epochs_to_runs([32, 256], [10.0, 12.0], {**prior, "run_scatter_log": 0.0})


def test_a_fit_to_runs_gives_a_prediction_interval_of_the_curve_and_a_runs_scatter():
    """EpochModel.interval of a fit with a covariance: E(B) exp(-+ z sqrt(J C J^T + s^2)), J = [1, -(B/B_n)/(1 + B/B_n)]:
    with no parameter uncertainty only the run's scatter s is left; the uncertainty of ln B_noise alone counts for
    nothing at B -> 0 and in full as B grows past B_noise."""
    from tula_service.fit.perfmodel.efficiency import INTERVAL_Z

    exact = EpochModel(32, 10.4, noise_scale=400.0, min_epochs=10.0, log_covariance=[[0.0, 0.0], [0.0, 0.0]], run_scatter_log=0.1)
    low, high = exact.interval(800)
    assert (low, high) == pytest.approx((30.0 * np.exp(-INTERVAL_Z * 0.1), 30.0 * np.exp(INTERVAL_Z * 0.1)))
    noise_only = EpochModel(32, 10.4, noise_scale=400.0, min_epochs=10.0, log_covariance=[[0.0, 0.0], [0.0, 0.25]])
    small, large = (np.log(np.divide(*noise_only.interval(b)[::-1])) / (2 * INTERVAL_Z) for b in (1e-6, 4e6))
    assert small == pytest.approx(0.0, abs=1e-6) and large == pytest.approx(0.5, rel=1e-3)
    assert EpochModel(32, 10.4, noise_scale=400.0, min_epochs=10.0).interval(800) is None  # no covariance: none


def test_one_run_is_not_enough_to_fit():
    with pytest.raises(ValueError, match="two or more"):
        fit_epochs_to_runs([32, 32], [10.0, 11.0])


def test_epoch_model_takes_a_fitted_e_min():
    model = EpochModel(32, 12.0, noise_scale=400.0, min_epochs=10.0)
    assert model.predict(400) == pytest.approx(20.0)  # not anchored to the reference run's 12


def test_a_ratio_past_any_batch_that_can_run_is_no_resolved_signal():
    """tr(Sigma) / |G|^2 past MAX_RESOLVED_NOISE_SCALE samples: |G|^2 is nil beside the noise at any batch a spec
    allows, so it reads as unresolved (as |G|^2 <= 0 does), and the fit has no noise scale rather than an inf."""
    from tula_service.fit.perfmodel.efficiency import NoiseScaleModel
    from tula_service.fit.perfmodel.noise_trajectory import MAX_RESOLVED_NOISE_SCALE

    records = power_law_records(40, 1e6, slope=0.0, level=1e100)
    assert TrajectoryNoiseScale().fit(records, 1e6).noise_scale_ is None
    assert TrajectoryNoiseScale(window_average="geometric").fit(records, 1e6).noise_scale_ is None
    just_inside = power_law_records(40, 1e6, slope=0.0, level=MAX_RESOLVED_NOISE_SCALE / 2)
    assert TrajectoryNoiseScale().fit(just_inside, 1e6).noise_scale_ == pytest.approx(MAX_RESOLVED_NOISE_SCALE / 2, rel=1e-3)
    assert NoiseScaleModel().fit([1e-10] * 3, [1e300] * 3).noise_scale_ is None
