"""The two-batch noise-scale estimator against a problem whose answer is known in closed form."""

import json
import math

import pytest

torch = pytest.importorskip("torch")

from profiler.gradstats import BiasCorrectedEMA, GradientNoiseEstimator, two_batch_estimates  # noqa: E402


def _least_squares_truth(delta: torch.Tensor, noise_std: float) -> tuple[float, float]:
    """Loss 0.5 (x.w - y)^2, x ~ N(0, I_d), y = x.w* + eps, eps ~ N(0, s^2), delta = w - w*.
    Per-example gradient g = x (x.delta - eps): G = delta, Sigma = (|delta|^2 + s^2) I + delta delta^T,
    so |G|^2 = |delta|^2 and tr(Sigma) = d (|delta|^2 + s^2) + |delta|^2."""
    d = delta.numel()
    true_sq = float(delta @ delta)
    return true_sq, d * (true_sq + noise_std**2) + true_sq


def test_noise_scale_of_least_squares_is_within_ten_percent_of_the_truth():
    generator = torch.Generator().manual_seed(0)
    dim, noise_std, batch, microbatches = 20, 0.5, 256, 8
    w_star = torch.randn(dim, generator=generator)
    w = w_star + 0.3 * torch.randn(dim, generator=generator)
    true_sq, trace = _least_squares_truth(w - w_star, noise_std)
    micro = batch // microbatches
    estimator = GradientNoiseEstimator()
    for _ in range(200):
        x = torch.randn(batch, dim, generator=generator)
        y = x @ w_star + noise_std * torch.randn(batch, generator=generator)
        grads = []
        for i in range(microbatches):
            xs, ys = x[i * micro : (i + 1) * micro], y[i * micro : (i + 1) * micro]
            grads.append(xs.T @ (xs @ w - ys) / micro)  # gradient of the mean loss over the micro-batch
        full = torch.stack(grads).mean(0)
        estimator.update([float(g @ g) for g in grads], float(full @ full), micro, batch)
    assert estimator.noise_scale() == pytest.approx(trace / true_sq, rel=0.10)
    summary = estimator.summary(micro, batch)
    assert summary["true_grad_sq_norm"] == pytest.approx(true_sq, rel=0.25)
    assert summary["trace_sigma"] == pytest.approx(trace, rel=0.10)
    assert summary["noise_scale_stderr"] < 0.05 * summary["noise_scale"]


def test_two_batch_estimates_invert_the_expected_norms():
    # E|g_b|^2 = |G|^2 + tr/b exactly: the estimator must return (|G|^2, tr) exactly
    true_sq, trace, b, big = 2.0, 300.0, 8, 64
    assert two_batch_estimates([true_sq + trace / b] * 4, true_sq + trace / big, b, big) == pytest.approx((true_sq, trace))


def test_two_batch_estimates_need_a_larger_full_batch():
    with pytest.raises(ValueError, match="must be larger"):
        two_batch_estimates([1.0], 1.0, 8, 8)


def test_bias_corrected_ema_of_a_constant_is_that_constant_from_the_first_step():
    ema = BiasCorrectedEMA(0.9)
    assert [round(ema.update(5.0), 12) for _ in range(3)] == [5.0, 5.0, 5.0]


def test_variability_is_the_relative_change_of_the_gradient_norm():
    estimator = GradientNoiseEstimator()
    for norm in (2.0, 3.0, 1.5):
        estimator.update([norm**2 * 2] * 2, norm**2, 4, 8)
    assert estimator.variability() == pytest.approx([0.5, 0.5])
    assert estimator.full_norms == pytest.approx([2.0, 3.0, 1.5])
    assert math.isfinite(estimator.summary(4, 8)["variability_median"])


def test_an_iteration_with_a_norm_that_is_not_finite_is_counted_and_left_out():
    # fp16 loss scaling overflows at its first steps: those iterations say nothing about the noise
    estimator = GradientNoiseEstimator()
    assert estimator.update([math.inf, 3.0], 1.0, 4, 8) is False
    assert estimator.update([2.0, 2.0], math.nan, 4, 8) is False
    assert estimator.update([300.0 / 4 + 2.0] * 2, 300.0 / 8 + 2.0, 4, 8) is True
    assert estimator.noise_scale() == pytest.approx(150.0)
    summary = estimator.summary(4, 8)
    assert (summary["iterations"], summary["nonfinite_iterations"]) == (1, 2)
    assert len(summary["grad_norm_series"]) == 1


def test_a_point_whose_every_iteration_overflowed_reports_no_estimate_and_no_nan():
    estimator = GradientNoiseEstimator()
    for _ in range(3):
        estimator.update([math.inf] * 2, math.inf, 4, 8)
    summary = estimator.summary(4, 8)
    assert estimator.noise_scale() is None
    assert (summary["true_grad_sq_norm"], summary["trace_sigma"], summary["noise_scale"]) == (None, None, None)
    assert summary["nonfinite_iterations"] == 3
    json.dumps(summary, allow_nan=False)  # the record the worker writes stays valid JSON
