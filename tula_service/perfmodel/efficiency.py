"""Statistical efficiency: how many epochs a global batch B needs to reach the user's target.

Gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"):
the expected squared norm of a batch-b gradient is

    E|g_b|^2 = |G|^2 + tr(Sigma) / b,

so a weighted least-squares line of mean |g_b|^2 against 1/b gives |G|^2 (intercept) and tr(Sigma)
(slope), and B_noise = tr(Sigma) / |G|^2 (the "simple" noise scale). Epochs then follow

    E(B) = E_min (1 + B / B_noise),

with E_min calibrated so that E(reference_batch) = reference_epochs (the user's reference run).

Without an informative noise-scale fit the assumption is conservative: epochs stay at the reference
value up to the reference batch, and beyond it the run needs as many optimizer steps as the reference
(E(B) = E_ref * B / B_ref): no speed-up from a larger batch is promised without evidence for it.
"""

from __future__ import annotations

import numpy as np


class NoiseScaleModel:
    def fit(self, device_batch: np.ndarray, grad_sq_norm: np.ndarray, grad_sq_norm_sem: np.ndarray | None = None):
        b = np.asarray(device_batch, dtype=float)
        y = np.asarray(grad_sq_norm, dtype=float)
        sem = np.ones_like(y) if grad_sq_norm_sem is None else np.asarray(grad_sq_norm_sem, dtype=float)
        weight = 1.0 / np.maximum(sem, 1e-12 * np.abs(y).max())
        design = np.column_stack([np.ones_like(b), 1.0 / b]) * weight[:, None]
        coef, *_ = np.linalg.lstsq(design, y * weight, rcond=None)
        self.true_grad_sq_norm_, self.trace_sigma_ = (float(c) for c in coef)
        self.informative_ = b.size >= 2 and self.true_grad_sq_norm_ > 0 and self.trace_sigma_ > 0
        self.noise_scale_ = self.trace_sigma_ / self.true_grad_sq_norm_ if self.informative_ else None
        self.noise_scale_stderr_ = self._stderr(design, y * weight, coef) if self.informative_ else None
        return self

    def predict(self, device_batch: np.ndarray | float) -> np.ndarray:
        return self.true_grad_sq_norm_ + self.trace_sigma_ / np.asarray(device_batch, dtype=float)

    def _stderr(self, design: np.ndarray, target: np.ndarray, coef: np.ndarray) -> float | None:
        """Delta-method standard error of B = tr/G2 from the coefficient covariance."""
        dof = design.shape[0] - design.shape[1]
        if dof <= 0:
            return None
        residual = target - design @ coef
        covariance = np.linalg.inv(design.T @ design) * float(residual @ residual) / dof
        g2, tr = coef
        gradient = np.array([-tr / g2**2, 1.0 / g2])
        return float(np.sqrt(max(gradient @ covariance @ gradient, 0.0)))


class EpochModel:
    """E(B) = E_min (1 + B / B_noise), E_min from the reference run; E_ref max(1, B / B_ref) without B_noise."""

    def __init__(self, reference_batch: int, reference_epochs: float, noise_scale: float | None):
        self.reference_batch = reference_batch
        self.reference_epochs = reference_epochs
        self.noise_scale = noise_scale
        self.min_epochs = (
            reference_epochs / (1.0 + reference_batch / noise_scale) if noise_scale else reference_epochs
        )

    def predict(self, global_batch: np.ndarray | float) -> np.ndarray:
        batch = np.asarray(global_batch, dtype=float)
        if not self.noise_scale:
            return self.reference_epochs * np.maximum(1.0, batch / self.reference_batch)
        return self.min_epochs * (1.0 + batch / self.noise_scale)
