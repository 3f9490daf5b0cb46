"""Peak device memory as a line in the per-device batch, with a prediction interval.

    M(b) = static_bytes + act_bytes_per_sample * b
    M(b) +- t_{n-2, (1+level)/2} * s * sqrt(1 + 1/n + (b - mean_b)^2 / S_bb)     (prediction interval)

static = weights + gradients + optimizer state (+ workspace); activations grow with b
(Tula seed paper, Fig. 4a/4b). Fitted by ordinary least squares on the profiled points. The interval
is the textbook OLS interval for one new measurement at b (e.g. Montgomery, Peck & Vining,
"Introduction to Linear Regression Analysis", ch. 2): s^2 = residual sum of squares / (n - 2),
S_bb = sum (b_i - mean_b)^2, Student's t with n - 2 degrees of freedom. It has zero width when the
points lie on the line, and also with only two points (no residual is left to estimate the noise
from: `residual_dof_ == 0` says the width is not informative then).
"""

from __future__ import annotations

import numpy as np
from scipy import stats

MAX_DEVICE_BATCH = 2**40  # stands for 'unbounded by memory' when activations cost nothing
EXACT_FIT_RELATIVE_STD = 1e-9  # residual std below this fraction of the largest peak is rounding, not noise


class MemoryModel:
    def fit(self, device_batch: np.ndarray, peak_bytes: np.ndarray) -> MemoryModel:
        x, y = np.asarray(device_batch, dtype=float), np.asarray(peak_bytes, dtype=float)
        self.act_bytes_per_sample_, self.static_bytes_ = np.polyfit(x, y, 1)
        residual = y - self.predict(x)
        total = np.sum((y - y.mean()) ** 2)
        self.r2_ = float(1.0 - np.sum(residual**2) / total) if total > 0 else 1.0
        self.n_points_ = int(x.size)
        self.mean_batch_ = float(x.mean())
        self.batch_sum_squares_ = float(np.sum((x - x.mean()) ** 2))
        self.residual_dof_ = self.n_points_ - 2
        std = float(np.sqrt(np.sum(residual**2) / self.residual_dof_)) if self.residual_dof_ > 0 else 0.0
        self.residual_std_bytes_ = std if std > EXACT_FIT_RELATIVE_STD * np.max(np.abs(y)) else 0.0
        return self

    def predict(self, device_batch: np.ndarray | float) -> np.ndarray:
        return self.static_bytes_ + self.act_bytes_per_sample_ * np.asarray(device_batch, dtype=float)

    def predict_interval(self, device_batch: np.ndarray | float, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
        """(low, high) bytes that hold one new measurement at b with probability `level` (formula above)."""
        if not 0.0 < level < 1.0:
            raise ValueError(f"level must be strictly between 0 and 1, got {level}")
        batch = np.asarray(device_batch, dtype=float)
        center = self.predict(batch)
        if self.residual_std_bytes_ == 0.0:
            return center, center.copy()
        t_quantile = stats.t.ppf(0.5 + level / 2.0, self.residual_dof_)
        leverage = 1.0 + 1.0 / self.n_points_ + (batch - self.mean_batch_) ** 2 / self.batch_sum_squares_
        half_width = t_quantile * self.residual_std_bytes_ * np.sqrt(leverage)
        return center - half_width, center + half_width

    def max_device_batch(
        self, capacity_bytes: float, margin: float = 0.05, upper: bool = False, level: float = 0.95
    ) -> int:
        """Largest b with M(b) <= capacity * (1 - margin); 0 when even the static part does not fit.

        With `upper=True` the interval's upper bound at `level` must fit instead (conservative). That
        bound is convex in b, so the batches that fit are 0..b_max and b_max is found by bisection
        below the point estimate's answer.
        """
        usable = capacity_bytes * (1.0 - margin) - self.static_bytes_
        if usable < 0:
            return 0
        if self.act_bytes_per_sample_ <= 0 or not np.isfinite(usable):  # a memory of 1e308 GiB is inf bytes: unbounded
            largest = MAX_DEVICE_BATCH
        else:
            largest = min(MAX_DEVICE_BATCH, int(usable // self.act_bytes_per_sample_))
        if not upper or self.residual_std_bytes_ == 0.0:
            return largest

        def fits(batch: int) -> bool:
            return bool(self.predict_interval(batch, level)[1] <= capacity_bytes * (1.0 - margin))

        if fits(largest):
            return largest
        if not fits(0):
            return 0
        low, high = 0, largest  # fits(low) and not fits(high)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low


class UnmeasuredMemory:
    """No memory was measured: the steps came from a trainer, a trace or a CSV, not from a profiling point.
    The per-device batches that ran are taken to fit and no larger one is offered (an assumption the
    report states); memory itself is unknown (NaN), so nothing is billed or plotted by it."""

    def __init__(self, largest_batch_that_ran: int):
        self.largest_batch_that_ran = int(largest_batch_that_ran)

    def predict(self, device_batch: np.ndarray | float) -> np.ndarray:
        return np.full(np.shape(device_batch), np.nan)

    def predict_interval(self, device_batch: np.ndarray | float, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
        return self.predict(device_batch), self.predict(device_batch)

    def max_device_batch(self, capacity_bytes: float, margin: float = 0.05, upper: bool = False, level: float = 0.95) -> int:
        return self.largest_batch_that_ran

    def report(self) -> dict:
        return {
            "formula": "not measured: the batches that ran are taken to fit",
            "static_bytes": None, "act_bytes_per_sample": None, "r2": None, "residual_std_bytes": None,
            "max_batch_rule": f"no per-device batch above the largest that ran ({self.largest_batch_that_ran})",
            "leave_one_out": {"median_rel_err": None, "max_rel_err": None, "points": 0},
            "source": "assumed",
        }  # fmt: skip
