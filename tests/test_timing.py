"""The timing pass's stopping rules (profiler.timing), on a scripted clock: what a point's median
is worth decides when sampling stops, and a few slow iterations do not keep it sampling."""

import numpy as np
import pytest
import torch

from profiler import timing
from profiler.timing import TimingPolicy, median_rel_se, robust_cv, summarize, time_iterations


class ScriptedClock:
    """Stands in for `time` in profiler.timing: each step advances it by the next scripted duration."""

    def __init__(self, iteration_s):
        self.now_s = 0.0
        self.iteration_s = iteration_s
        self.steps = 0

    def perf_counter(self) -> float:
        return self.now_s

    def step(self, clock) -> None:
        """Four phases (data, forward, backward, optimizer) sharing the iteration's duration."""
        duration_s = self.iteration_s(self.steps)
        clock.mark()
        for _ in timing.PHASES:
            self.now_s += duration_s / len(timing.PHASES)
            clock.mark()
        self.steps += 1


def _run(monkeypatch, iteration_s, **policy) -> dict:
    scripted = ScriptedClock(iteration_s)
    monkeypatch.setattr(timing, "time", scripted)
    return time_iterations(scripted.step, torch.device("cpu"), TimingPolicy(**policy)).summary()


def test_one_slow_iteration_in_ten_moves_the_cv_but_not_the_robust_cv():
    values = np.array([0.010] * 9 + [0.100] * 1)
    assert summarize(values)["cv"] > 1.0
    assert robust_cv(values) == 0.0 and summarize(values)["median_s"] == pytest.approx(0.010)


def test_the_medians_standard_error_is_the_normal_one():
    """sqrt(pi/2) sigma / sqrt(n) for normal data: checked against the spread of many sample medians."""
    rng = np.random.default_rng(0)
    samples = 1.0 + 0.1 * rng.standard_normal((4000, 50))
    observed_rel_se = np.median(samples, axis=1).std()
    predicted = np.median([median_rel_se(row) for row in samples])
    assert predicted == pytest.approx(observed_rel_se, rel=0.1)


def test_a_point_with_rare_outliers_stops_once_its_median_is_known(monkeypatch):
    """Every 10th iteration waits 10x longer (another process took the core): the CV stays above its
    target, the median's relative standard error falls under 1% and ends the sampling long before
    the time cap."""
    steady = lambda step: 0.010 * (1.0 + 0.05 * ((step * 7) % 5 - 2) / 2)  # noqa: E731: +-5% scatter
    result = _run(monkeypatch, lambda step: 0.100 if step % 10 == 9 else steady(step), time_cap_s=60.0)
    assert result["cv"] > 0.03
    assert result["stopped_by"] == "median_rse_target" and result["median_rel_se"] <= 0.01
    assert result["count"] < 100


def test_a_widely_scattered_point_samples_to_its_time_cap(monkeypatch):
    scattered = lambda step: 0.010 * (1.0 + 0.9 * ((step * 7) % 11 - 5) / 5)  # noqa: E731: +-90%
    result = _run(monkeypatch, scattered, time_cap_s=2.0, target_median_rse=1e-4)
    assert result["stopped_by"] == "time_cap"


def test_a_steady_point_stops_at_the_cv_target_after_the_least_iterations(monkeypatch):
    result = _run(monkeypatch, lambda step: 0.010, time_cap_s=60.0, min_iters=12)
    assert (result["stopped_by"], result["count"]) == ("cv_target", 12)
