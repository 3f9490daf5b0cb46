"""Compute time of one forward + backward + optimizer step on one device.

    T_comp(b) = alpha_s + beta_s_per_sample * b,   alpha, beta >= 0

Same form as Pollux/AdaptDL's `T_comp = alpha_c + beta_c * local_bsz`; fitted with non-negative
least squares (scipy.optimize.nnls) so a noisy point can never make time fall with batch size.
Residuals are relative (each row divided by its measured time): a 10% miss at batch 8 counts as
much as a 10% miss at batch 1024, which is how prediction error is quoted.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import nnls


class ComputeModel:
    def fit(self, device_batch: np.ndarray, iter_time_s: np.ndarray) -> ComputeModel:
        x, y = np.asarray(device_batch, dtype=float), np.asarray(iter_time_s, dtype=float)
        design = np.column_stack([np.ones_like(x), x]) / y[:, None]
        (self.alpha_s_, self.beta_s_per_sample_), _ = nnls(design, np.ones_like(y))
        return self

    def predict(self, device_batch: np.ndarray | float) -> np.ndarray:
        return self.alpha_s_ + self.beta_s_per_sample_ * np.asarray(device_batch, dtype=float)
