"""Compute time of one forward + backward + optimizer step on one device, and the choice of its shape.

    linear      T_comp(b) = alpha_s + beta_s_per_sample * b                       alpha, beta >= 0
    saturating  T_comp(b) = alpha_s + beta_s_per_sample * max(b, saturation_batch)
    power       T_comp(b) = alpha_s + beta_s * b ** exponent,   exponent in [0.5, 1.5]

The linear form is Pollux/AdaptDL's `T_comp = alpha_c + beta_c * local_bsz`. A GPU is under-used at
small batches: time stays flat until the batch fills the device, then grows linearly (saturating),
or grows sub-linearly throughout (power). Every shape is fitted with non-negative least squares
(scipy.optimize.nnls) for (alpha, beta), so a noisy point can never make time fall with batch size;
the one shape parameter (saturation_batch, exponent) is found by a 1-D search around that. Residuals
are relative (each row divided by its measured time): a 10% miss at batch 8 counts as much as a 10%
miss at batch 1024, which is how prediction error is quoted.

`select_compute_model` fits every shape and keeps the one with the lowest median leave-one-out
relative error (cross-validation picks the shape, as design.md asks); the linear model wins ties.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from scipy.optimize import minimize_scalar, nnls

from tula_service.fit.perfmodel.validation import error_summary, leave_one_out_relative_errors

MIN_POINTS_TO_SELECT = 4  # distinct batch sizes; fewer cannot tell the shapes apart by leave-one-out
TIE_TOLERANCE = 1e-3  # a shape must beat the line's median LOO error by more than 0.1 percentage point


def _as_arrays(device_batch, iter_time_s) -> tuple[np.ndarray, np.ndarray]:
    batch = np.asarray(device_batch, dtype=float).ravel()
    seconds = np.asarray(iter_time_s, dtype=float).ravel()
    if batch.size != seconds.size:
        raise ValueError(f"device_batch and iter_time_s differ in length: {batch.size}, {seconds.size}")
    if not (np.all(np.isfinite(seconds)) and np.all(seconds > 0)):
        raise ValueError(f"every iter_time_s must be positive and finite, got {seconds.tolist()}")
    if not (np.all(np.isfinite(batch)) and np.all(batch > 0)):
        raise ValueError(f"every device_batch must be positive, got {batch.tolist()}")
    return batch, seconds


def _fit_line(feature: np.ndarray, iter_time_s: np.ndarray) -> tuple[float, float, float]:
    """NNLS of T = alpha + beta * feature on relative residuals: (alpha, beta, relative residual norm)."""
    design = np.column_stack([np.ones_like(feature), feature]) / iter_time_s[:, None]
    (alpha, beta), residual_norm = nnls(design, np.ones_like(iter_time_s))
    return float(alpha), float(beta), float(residual_norm)


def _search_shape(loss: Callable[[float], float], grid: np.ndarray) -> float:
    """Grid search, then bounded Brent refinement between the best grid point's neighbours."""
    grid = np.unique(grid)
    losses = np.array([loss(value) for value in grid])
    best = int(np.argmin(losses))
    low, high = grid[max(best - 1, 0)], grid[min(best + 1, grid.size - 1)]
    if high > low:
        refined = minimize_scalar(loss, bounds=(low, high), method="bounded", options={"xatol": 1e-9 * high})
        if refined.fun < losses[best]:
            return float(refined.x)
    return float(grid[best])


class _ComputeShape:
    """Shared reporting: `params_()` reads the fitted `<name>_` attributes listed in `param_names`."""

    name: str
    formula: str
    param_names: tuple[str, ...]

    @classmethod
    def n_params(cls) -> int:
        return len(cls.param_names)

    def params_(self) -> dict[str, float]:
        return {name: float(getattr(self, name + "_")) for name in self.param_names}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "formula": self.formula, "params": self.params_()}


class ComputeModel(_ComputeShape):
    """T_comp(b) = alpha_s + beta_s_per_sample * b (the default; what the planner uses today)."""

    name = "linear"
    formula = "T_comp(b) = alpha_s + beta_s_per_sample * b"
    param_names = ("alpha_s", "beta_s_per_sample")

    def fit(self, device_batch: np.ndarray, iter_time_s: np.ndarray) -> ComputeModel:
        batch, seconds = _as_arrays(device_batch, iter_time_s)
        self.alpha_s_, self.beta_s_per_sample_, _ = _fit_line(batch, seconds)
        return self

    def predict(self, device_batch: np.ndarray | float) -> np.ndarray:
        return self.alpha_s_ + self.beta_s_per_sample_ * np.asarray(device_batch, dtype=float)


class SaturatingComputeModel(_ComputeShape):
    """T_comp(b) = alpha_s + beta_s_per_sample * max(b, saturation_batch): flat until the device is full.

    saturation_batch is searched between the smallest and the second-largest measured batch (at least
    two measured batches lie on the slope, so beta is measured, not extrapolated); at the smallest
    batch the model is the linear one.
    """

    name = "saturating"
    formula = "T_comp(b) = alpha_s + beta_s_per_sample * max(b, saturation_batch)"
    param_names = ("alpha_s", "beta_s_per_sample", "saturation_batch")

    def fit(self, device_batch: np.ndarray, iter_time_s: np.ndarray) -> SaturatingComputeModel:
        batch, seconds = _as_arrays(device_batch, iter_time_s)
        distinct = np.unique(batch)
        upper = distinct[max(distinct.size - 2, 0)]
        between = np.clip(np.geomspace(distinct[0], upper, 32), distinct[0], upper)
        grid = np.concatenate([distinct[distinct <= upper], between])
        self.saturation_batch_ = _search_shape(lambda knee: _fit_line(np.maximum(batch, knee), seconds)[2], grid)
        self.alpha_s_, self.beta_s_per_sample_, _ = _fit_line(np.maximum(batch, self.saturation_batch_), seconds)
        return self

    def predict(self, device_batch: np.ndarray | float) -> np.ndarray:
        batch = np.asarray(device_batch, dtype=float)
        return self.alpha_s_ + self.beta_s_per_sample_ * np.maximum(batch, self.saturation_batch_)


class PowerLawComputeModel(_ComputeShape):
    """T_comp(b) = alpha_s + beta_s * b ** exponent, exponent in [0.5, 1.5] (1 is the linear model)."""

    name = "power"
    formula = "T_comp(b) = alpha_s + beta_s * b ** exponent, exponent in [0.5, 1.5]"
    param_names = ("alpha_s", "beta_s", "exponent")
    exponent_bounds = (0.5, 1.5)

    def fit(self, device_batch: np.ndarray, iter_time_s: np.ndarray) -> PowerLawComputeModel:
        batch, seconds = _as_arrays(device_batch, iter_time_s)
        grid = np.linspace(*self.exponent_bounds, 21)
        self.exponent_ = _search_shape(lambda power: _fit_line(batch**power, seconds)[2], grid)
        self.alpha_s_, self.beta_s_, _ = _fit_line(batch**self.exponent_, seconds)
        return self

    def predict(self, device_batch: np.ndarray | float) -> np.ndarray:
        return self.alpha_s_ + self.beta_s_ * np.asarray(device_batch, dtype=float) ** self.exponent_


COMPUTE_MODELS: dict[str, type[_ComputeShape]] = {
    model.name: model for model in (ComputeModel, SaturatingComputeModel, PowerLawComputeModel)
}


def select_compute_model(device_batch: np.ndarray, iter_time_s: np.ndarray) -> tuple[_ComputeShape, dict[str, Any]]:
    """Fit every shape, keep the lowest median leave-one-out relative error; the line on ties or < 4 points.

    A shape with as many parameters as distinct batch sizes (or more) interpolates instead of
    predicting, so it is not eligible. Returns the chosen model fitted on all points, and
    {"chosen", "why", "candidates": {name: {"formula", "params", "eligible", "leave_one_out"}}}.
    """
    batch, seconds = _as_arrays(device_batch, iter_time_s)
    points = int(np.unique(batch).size)
    candidates = {}
    for name, model_class in COMPUTE_MODELS.items():
        eligible = model_class.n_params() < points
        errors = leave_one_out_relative_errors(model_class, batch, seconds) if eligible else []
        candidates[name] = {
            "formula": model_class.formula,
            "params": model_class().fit(batch, seconds).params_(),
            "eligible": eligible,
            "leave_one_out": error_summary(errors),
        }
    chosen, why = _choose(candidates, points)
    return COMPUTE_MODELS[chosen]().fit(batch, seconds), {"chosen": chosen, "why": why, "candidates": candidates}


def _choose(candidates: dict[str, dict[str, Any]], points: int) -> tuple[str, str]:
    if points < MIN_POINTS_TO_SELECT:
        return "linear", (
            f"only {points} distinct batch sizes: fewer than {MIN_POINTS_TO_SELECT} cannot tell the shapes "
            "apart by leave-one-out error, so the linear model is kept"
        )
    median = {
        name: c["leave_one_out"]["median_rel_err"] for name, c in candidates.items() if c["eligible"]
    }
    best = min(median, key=median.get)  # dict order puts "linear" first: exact ties keep it
    if best == "linear":
        return "linear", f"the linear model has the lowest median leave-one-out relative error ({median['linear']:.2%})"
    if median[best] >= median["linear"] - TIE_TOLERANCE:
        return "linear", (
            f"tie: {best} ({median[best]:.2%}) is within {TIE_TOLERANCE:.1%} of linear ({median['linear']:.2%}) "
            "in median leave-one-out relative error, so the simpler linear model is kept"
        )
    return best, (
        f"{best} has the lowest median leave-one-out relative error: {median[best]:.2%} against "
        f"{median['linear']:.2%} for linear"
    )
