"""Gradient noise scale and gradient variability, measured during profiling.

Two-batch estimator (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", App. A.1).
A batch of B samples is split into k micro-batches of b = B / k. With mean-reduced losses the
micro-batch gradients g_b average to the full-batch gradient g_B, and since E|g_b|^2 = |G|^2 + tr(Sigma)/b:

    |G|^2    ~ (B |g_B|^2 - b |g_b|^2) / (B - b)
    tr(Sigma) ~ (|g_b|^2 - |g_B|^2) / (1/b - 1/B)

where |g_b|^2 is the mean over the k micro-batches. Both are unbiased but noisy per iteration, so
each is averaged on its own with a bias-corrected exponential moving average (as in Adam), and only
then is the ratio taken: B_simple = tr(Sigma) / |G|^2. Never average per-iteration ratios.

How many iterations: the estimate has settled when the relative standard error of the mean of
both |G|^2 and tr(Sigma) over the iterations (std / sqrt(n) / |mean|) is below a target
(`relative_stderr`); profiler.measure stops there, or at its share of the point's time, or at
profiling.grad_iters.

An iteration whose norms are not finite (fp16 loss scaling overflows at its first steps; a model that
diverges) says nothing about the noise: it is counted (`nonfinite_iterations`) and left out of both
averages, and a point with no finite iteration reports no estimate (None), never NaN.

Gradient variability (Tula seed paper, Figs. 5-6): the relative change of the full-batch gradient
norm between consecutive iterations, |(|g_t| - |g_{t-1}|)| / |g_{t-1}|. AGS thresholds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


class BiasCorrectedEMA:
    """m_t = beta m_{t-1} + (1 - beta) x_t, reported as m_t / (1 - beta^t)."""

    def __init__(self, beta: float = 0.9):
        self.beta = beta
        self._value = 0.0
        self._steps = 0

    def update(self, x: float) -> float:
        self._steps += 1
        self._value = self.beta * self._value + (1.0 - self.beta) * x
        return self.value

    @property
    def value(self) -> float:
        return self._value / (1.0 - self.beta**self._steps) if self._steps else float("nan")


def two_batch_estimates(micro_sq_norms: list[float], full_sq_norm: float, micro_batch: int, batch: int) -> tuple[float, float]:
    """Unbiased (|G|^2, tr(Sigma)) from one iteration's micro-batch and full-batch squared norms."""
    if batch <= micro_batch:
        raise ValueError(f"the full batch ({batch}) must be larger than the micro-batch ({micro_batch})")
    small_sq = float(np.mean(micro_sq_norms))
    true_sq = (batch * full_sq_norm - micro_batch * small_sq) / (batch - micro_batch)
    trace_sigma = (small_sq - full_sq_norm) / (1.0 / micro_batch - 1.0 / batch)
    return true_sq, trace_sigma


@dataclass
class GradientNoiseEstimator:
    ema_beta: float = 0.9
    true_sq: list[float] = field(default_factory=list)
    trace: list[float] = field(default_factory=list)
    full_norms: list[float] = field(default_factory=list)
    nonfinite_iterations: int = 0

    def __post_init__(self):
        self._true_ema = BiasCorrectedEMA(self.ema_beta)
        self._trace_ema = BiasCorrectedEMA(self.ema_beta)

    def update(self, micro_sq_norms: list[float], full_sq_norm: float, micro_batch: int, batch: int) -> bool:
        """Add one iteration; False (counted, left out) when a norm is not finite."""
        if not (math.isfinite(full_sq_norm) and all(map(math.isfinite, micro_sq_norms))):
            self.nonfinite_iterations += 1
            return False
        true_sq, trace = two_batch_estimates(micro_sq_norms, full_sq_norm, micro_batch, batch)
        self.true_sq.append(true_sq)
        self.trace.append(trace)
        self.full_norms.append(math.sqrt(full_sq_norm))
        self._true_ema.update(true_sq)
        self._trace_ema.update(trace)
        return True

    def noise_scale(self) -> float | None:
        """B_simple = EMA(tr Sigma) / EMA(|G|^2); None when |G|^2 is not resolved (<= 0) or nothing was added."""
        if not self.true_sq:
            return None
        true_sq = self._true_ema.value
        return self._trace_ema.value / true_sq if true_sq > 0 else None

    def noise_scale_stderr(self) -> float | None:
        """Delta-method standard error of mean(tr) / mean(|G|^2) over the iterations."""
        n = len(self.true_sq)
        g, s = np.array(self.true_sq), np.array(self.trace)
        if n < 3 or g.mean() <= 0:
            return None
        ratio = s.mean() / g.mean()
        cov = np.cov(np.vstack([s, g])) / n
        rel_var = cov[0, 0] / s.mean() ** 2 + cov[1, 1] / g.mean() ** 2 - 2 * cov[0, 1] / (s.mean() * g.mean())
        return float(abs(ratio) * math.sqrt(max(rel_var, 0.0)))

    def relative_stderr(self) -> dict[str, float | None]:
        """Std. error of the mean over |mean| of |G|^2 and of tr(Sigma); None below two iterations or at
        a zero mean."""
        return {"true_grad_sq_norm": _relative_stderr(self.true_sq), "trace_sigma": _relative_stderr(self.trace)}

    def settled(self, target_rse: float) -> bool:
        """Both the numerator and the denominator of the noise scale are known to within `target_rse`."""
        errors = self.relative_stderr().values()
        return all(error is not None and error <= target_rse for error in errors)

    def variability(self) -> list[float]:
        norms = self.full_norms
        return [abs(b - a) / a for a, b in zip(norms, norms[1:]) if a > 0]

    def summary(self, micro_batch: int, batch: int) -> dict:
        variability = self.variability()
        return {
            "estimator": "two-batch (McCandlish et al. 2018, App. A.1), bias-corrected EMA of numerator and denominator",
            "micro_batch": micro_batch,
            "batch": batch,
            "iterations": len(self.true_sq),
            "nonfinite_iterations": self.nonfinite_iterations,
            "relative_stderr": self.relative_stderr(),
            "ema_beta": self.ema_beta,
            "true_grad_sq_norm": self._true_ema.value if self.true_sq else None,
            "trace_sigma": self._trace_ema.value if self.true_sq else None,
            "noise_scale": self.noise_scale(),
            "noise_scale_stderr": self.noise_scale_stderr(),
            "grad_norm_series": self.full_norms,
            "variability_series": variability,
            "variability_median": float(np.median(variability)) if variability else None,
            "variability_p90": float(np.percentile(variability, 90)) if variability else None,
        }


def _relative_stderr(values: list[float]) -> float | None:
    x = np.asarray(values, dtype=float)
    if x.size < 2 or x.mean() == 0:
        return None
    return float(x.std(ddof=1) / math.sqrt(x.size) / abs(x.mean()))
