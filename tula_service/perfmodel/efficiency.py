"""Statistical efficiency: how many epochs a global batch B needs to reach the user's target.

Gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"):
B_simple = tr(Sigma) / |G|^2. Each profiling point estimates |G|^2 and tr(Sigma) with the unbiased
two-batch estimator (profiler.gradstats); here the points are pooled: numerator and denominator are
averaged separately, each point weighted by the samples behind it (iterations x batch: a small
batch barely resolves |G|^2 when the noise dominates), and only then divided. Epochs follow

    E(B) = E_min (1 + B / B_noise),

with E_min calibrated so that E(reference_batch) = reference_epochs (the user's reference run).

Without an informative noise scale the assumption is conservative: epochs stay at the reference
value up to the reference batch, and beyond it the run needs as many optimizer steps as the reference
(E(B) = E_ref * B / B_ref): no speed-up from a larger batch is promised without evidence for it.

The noise-scale model assumes the learning rate can keep growing with the batch until a step is
noise-free (S_min = E_min D / B_noise steps). Optimizers stop being stable at some LR first: in
benchmarks/time_to_accuracy.py (docs/validation.md) steps stopped falling at about twice S_min once the
tuned LR hit its ceiling, and epochs at B >= 2.6 B_noise were 38-44% above E(B). When the user gives
the largest stable LR, a step at any batch is worth at most g = max_step_gain reference steps (AdaScale,
Johnson et al. 2020: the LR multiplied by the gain r buys r reference steps per step; r <= max_lr /
reference_lr for SGD, its square for Adam), so S(B) >= S_ref / g, i.e.

    E(B) = max(E_min (1 + B / B_noise), E_ref B / (B_ref g)).
"""

from __future__ import annotations

import numpy as np


class NoiseScaleModel:
    """Pools per-point (|G|^2, tr Sigma) estimates into one B_noise with a delta-method std. error."""

    def fit(self, true_grad_sq_norm: np.ndarray, trace_sigma: np.ndarray, samples: np.ndarray) -> "NoiseScaleModel":
        g = np.asarray(true_grad_sq_norm, dtype=float)
        s = np.asarray(trace_sigma, dtype=float)
        w = np.asarray(samples, dtype=float) / np.sum(samples)
        self.true_grad_sq_norm_ = float(w @ g)
        self.trace_sigma_ = float(w @ s)
        self.points_ = int(g.size)
        self.informative_ = self.true_grad_sq_norm_ > 0 and self.trace_sigma_ > 0
        self.noise_scale_ = self.trace_sigma_ / self.true_grad_sq_norm_ if self.informative_ else None
        self.noise_scale_stderr_ = self._stderr(g, s, w) if self.informative_ else None
        return self

    def _stderr(self, g: np.ndarray, s: np.ndarray, w: np.ndarray) -> float | None:
        if g.size < 3:
            return None
        n_eff = 1.0 / np.sum(w**2)
        cov = np.cov(np.vstack([s, g]), aweights=w) / n_eff
        mean_s, mean_g = self.trace_sigma_, self.true_grad_sq_norm_
        rel_var = cov[0, 0] / mean_s**2 + cov[1, 1] / mean_g**2 - 2 * cov[0, 1] / (mean_s * mean_g)
        return float(self.noise_scale_ * np.sqrt(max(rel_var, 0.0)))


class EpochModel:
    """E(B) = E_min (1 + B / B_noise), E_min from the reference run; E_ref max(1, B / B_ref) without B_noise;
    with a max_step_gain g, never below E_ref B / (B_ref g) (see the module docstring)."""

    def __init__(self, reference_batch: int, reference_epochs: float, noise_scale: float | None, max_step_gain: float | None = None):
        if max_step_gain is not None and max_step_gain < 1:
            raise ValueError(f"max_step_gain must be >= 1 (a step at the reference LR is worth one reference step), got {max_step_gain}")
        self.reference_batch = reference_batch
        self.reference_epochs = reference_epochs
        self.noise_scale = noise_scale
        self.max_step_gain = max_step_gain
        self.min_epochs = (
            reference_epochs / (1.0 + reference_batch / noise_scale) if noise_scale else reference_epochs
        )

    def predict(self, global_batch: np.ndarray | float) -> np.ndarray:
        batch = np.asarray(global_batch, dtype=float)
        if not self.noise_scale:
            return self.reference_epochs * np.maximum(1.0, batch / self.reference_batch)
        epochs = self.min_epochs * (1.0 + batch / self.noise_scale)
        if self.max_step_gain:
            epochs = np.maximum(epochs, self.step_floor_epochs(batch))
        return epochs

    def step_floor_epochs(self, global_batch: np.ndarray | float) -> np.ndarray:
        """E_ref B / (B_ref g): the epochs of S_ref / g steps at batch B."""
        return self.reference_epochs * np.asarray(global_batch, dtype=float) / (self.reference_batch * self.max_step_gain)
