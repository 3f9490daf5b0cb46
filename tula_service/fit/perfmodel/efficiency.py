"""Statistical efficiency: how many epochs a global batch B needs to reach the user's target.

Gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"):
B_simple = tr(Sigma) / |G|^2. Epochs follow

    E(B) = E_min (1 + B / B_noise),

with E_min calibrated so that E(reference_batch) = reference_epochs (the user's reference run), or, with
epochs measured at two or more batches, E_min and B_noise fitted to them (`fit_epochs_to_runs`).
Where B_noise comes from is decided in tula_service.fit.efficiency_evidence; the noise scale along a
training run is read by perfmodel.noise_trajectory. When the noise scale varies along the run, this form
still holds with B_noise its mean weighted by the progress dS_min (McCandlish et al. 2018, App. D):
S(B) = int (1 + B_noise / B) dS_min, so B_noise = int B_noise dS_min / S_min. At initialization, each profiling point estimates
|G|^2 and tr(Sigma) with the unbiased two-batch estimator (profiler.gradstats), and NoiseScaleModel pools
the points: numerator and denominator are averaged separately, every point with the same weight (a
weight by samples let the two largest batches carry 75% of it), and only then divided.

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

A measured stability headroom h (the LR can grow h-fold before the top Hessian direction is unstable,
profiler.sharpness) caps the LR the rule advises at h times the reference (for Adam too: h bounds the LR), and
the epochs follow from the quadratic model of the loss along the step (McCandlish et al. 2018, Sec. 2.2): a
step of size eps at batch B makes progress dL(eps) = eps |G|^2 - (eps^2 / 2) |G|^2 L (1 + B_noise / B), best
at eps_opt(B) = eps_max / (1 + B_noise / B). In units of eps_max, x = eps / eps_max, the progress is
2 x - x^2 (1 + B_noise / B) of the most a step can make, 1 / (1 + B_noise / B) at x_opt. The reference LR is
taken to be the best at B_ref (x_ref = 1 / (1 + B_noise / B_ref): assumed, the user tuned it there), so the
cap is x_c = c x_ref with c the step gain h allows (h for SGD, h^2 for Adam, as for max_step_gain). Where
x_opt(B) > x_c the step runs at x_c, and the quadratic model's cost of the cap is the factor

    q(B) = [1 / (1 + B_noise / B)] / [2 x_c - x_c^2 (1 + B_noise / B)]  (>= 1).

The cost rests on x_ref, which nothing measures. Trained at the capped LR (benchmarks/stability_headroom.py,
three plain-SGD tasks), the epochs lay between no cost and q at 12 of 14 capped batches, and q over-predicted
them by 7%, 15% and 45% (median per task): the reference LR sat further below the best step than assumed on
some tasks. (On a GPT under SGD with momentum, whose cap of 1.15x hardly moved the LR, the interval was a few
percent wide and held none of its 4 capped batches: it is the cap's cost, not the runs' scatter.) So the epochs are given as the geometric middle of the two ends, with the ends as their interval
(cap_interval):

    E(B) = E_min (1 + B / B_noise) * sqrt(q(B)),  in [E_min (1 + B / B_noise), E_min (1 + B / B_noise) q(B)].

The middle was chosen on those same three tasks (its median errors 14%, 11% and 3% against the capped runs):
weak evidence, said in the interval and its why.

How far off the noise scale read may be is measured across tasks (tula_service.fit.epochs_calibration): with a
calibrated range [B_lo, B_hi] of the noise scale, the epochs at B lie between E(B) at the two ends, each with E_min
re-anchored at the reference run (so the interval closes at B_ref and opens with the distance from it), joined
with the cap's interval (EpochModel.interval).

The same B_noise sets how much one step at a larger batch is worth, and so how far the LR may grow: the
AdaScale gain (Johnson et al. 2020) of a batch k = B / B_ref times the reference,

    r(k) = (sigma^2 + |G|^2) / (sigma^2 / k + |G|^2) = (1 + B_noise / B_ref) / (1 + B_noise / (k B_ref)),

sigma^2 = tr(Sigma) / B_ref, in [1, k]. SGD's LR grows by r, Adam's by sqrt(r) (Pollux/AdaptDL), and so does
RMSprop's: the square-root scaling rule that Malladi et al. (2022, "On the SDEs and Scaling Rules for Adaptive
Gradient Algorithms") derive for RMSprop and Adam alike. NAdam and RAdam are Adam's update with a Nesterov
coefficient and a rectified LR, and Adamax divides by an infinity norm of the gradients where Adam divides by their
root mean square (both scale as the noise's standard deviation where the noise dominates): they are assumed to scale
as Adam does (not derived there). So is Adagrad, which divides by the root of the sum of every past squared gradient
(Duchi et al. 2011), not of a moving average, so that its effective step also falls as the run goes on: assumed,
and measured on one task (efficiency_evidence's caveat). So is Adafactor (Shazeer & Stern 2018), which divides by
the root of a rank-one factoring of the mean square (a moving average, as RMSprop's) and scales its step by each
tensor's RMS and 1 / sqrt(t) once that is below its LR: the rule multiplies that cap; assumed. So the
efficiency family has one interface (EfficiencyModel): predict epochs, the step gain and the LR multiplier
of a batch, all from the one B_noise that tula_service.fit.efficiency_evidence chose by evidence; the planner
and the advice read nothing else of it.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

from tula_service.fit.perfmodel.noise_trajectory import pooled_ratio

INTERVAL_Z = 1.2816  # the standard normal's 90% quantile: an 80% interval, as the calibrated one's (epochs_calibration.QUANTILES)
OPTIMIZERS_WITH_SQRT_LR = ("adam", "adamw", "rmsprop", "nadam", "radam", "adamax", "adagrad", "adafactor")  # adaptive: the LR grows with sqrt(step gain) (module docstring)
TINY_NOISE_SCALE = 1e-9  # x the reference batch: a B_noise this small gives E(B) = E_ref B / B_ref to 1e-9


def adascale_gain(k: float, noise_scale: float, reference_batch: int) -> float:
    """r(k) = (1 + B_noise / B_ref) / (1 + B_noise / (k B_ref)) (module docstring)."""
    return (1.0 + noise_scale / reference_batch) / (1.0 + noise_scale / (k * reference_batch))


def lr_multiplier_of_gain(gain: float, optimizer: str) -> float:
    """The LR multiplier that buys a step gain r: r for SGD, sqrt(r) for the adaptive ones (OPTIMIZERS_WITH_SQRT_LR)."""
    return float(np.sqrt(gain)) if optimizer in OPTIMIZERS_WITH_SQRT_LR else gain


def capped_step_fraction(cap_gain: float, noise_scale: float, reference_batch: int) -> float:
    """x_c: the capped step over epsilon_max, the best step at infinite batch, where the noise scale is B_noise:
    cap_gain / (1 + B_noise / B_ref), the reference LR being the best step at the reference batch, x_ref =
    1 / (1 + B_noise / B_ref) (McCandlish et al. 2018, sec. 2), and the cap cap_gain reference steps."""
    return cap_gain / (1.0 + noise_scale / reference_batch)


def max_step_gain(optimizer: str, reference_lr: float | None, max_lr: float | None) -> float | None:
    """The most reference-run steps one step at a larger batch can be worth when the LR can grow by at most
    max_lr / reference_lr: that ratio for SGD, its square for the adaptive optimizers (the inverse of
    lr_multiplier_of_gain); None without both LRs."""
    if max_lr is None or reference_lr is None:
        return None
    ratio = max_lr / reference_lr
    return ratio**2 if optimizer in OPTIMIZERS_WITH_SQRT_LR else ratio


class EfficiencyModel(Protocol):
    """What the planner and the advice read of a statistical-efficiency model (EpochModel implements it)."""

    noise_scale: float | None
    reference_batch: int
    lr_headroom: float | None  # the measured stability headroom that caps the LR (None: not measured)
    lr_cap_why: str | None  # what the cap is when it is not a measured headroom (a plateau's reference LR)

    def predict(self, global_batch: np.ndarray | float) -> np.ndarray:
        """Epochs to the target at each global batch."""

    def step_gain(self, global_batch: float) -> float | None:
        """How many reference-batch steps one step at global_batch is worth (None: not measured)."""

    def cap_gain(self) -> float:
        """The step gain the LR cap allows (read only with lr_headroom set)."""

    def cap_description(self) -> str:
        """What caps the LR, in the answer's words (read only with lr_headroom set)."""

    def lr_multiplier(self, global_batch: float) -> float | None:
        """The LR at global_batch over the reference LR that realizes step_gain (None: not measured)."""

    def lr_capped(self, global_batch: float) -> bool:
        """Whether the measured stability headroom, not the step gain's rule, sets the LR at global_batch."""


class NoiseScaleModel:
    """Pools per-point (|G|^2, tr Sigma) estimates into one B_noise with a delta-method std. error; each
    point weighs the same."""

    def fit(self, true_grad_sq_norm: np.ndarray, trace_sigma: np.ndarray) -> "NoiseScaleModel":
        g = np.asarray(true_grad_sq_norm, dtype=float)
        s = np.asarray(trace_sigma, dtype=float)
        w = np.full(g.size, 1.0 / g.size)
        self.true_grad_sq_norm_ = float(w @ g)
        self.trace_sigma_ = float(w @ s)
        self.points_ = int(g.size)
        self.noise_scale_ = pooled_ratio(w, g, s)  # None when not resolved, as for a trajectory's bins
        self.informative_ = self.noise_scale_ is not None
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
    with a max_step_gain g, never below E_ref B / (B_ref g); with a measured LR headroom h, the LR capped at h
    times the reference and the epochs of that capped step (see the module docstring)."""

    def __init__(
        self, reference_batch: int, reference_epochs: float, noise_scale: float | None, max_step_gain: float | None = None,
        min_epochs: float | None = None, optimizer: str = "sgd", lr_headroom: float | None = None,
        noise_scale_range: tuple[float, float] | None = None, log_covariance: list[list[float]] | None = None,
        run_scatter_log: float | None = None, lr_cap_why: str | None = None,
    ):  # fmt: skip
        """min_epochs: E_min fitted to measured runs (`fit_epochs_to_runs`); default: from the reference run.
        optimizer: how the LR buys a step gain (lr_multiplier_of_gain). lr_headroom: the measured stability
        headroom h (>= 1 caps the LR there; below 1 the reference LR is already past it, and the cap is 1).
        noise_scale_range: the calibrated interval of B_noise (tula_service.fit.epochs_calibration), for interval().
        log_covariance, run_scatter_log: the covariance of (ln E_min, ln B_noise) of a fit to measured runs with a
        prior (`fit_epochs_to_runs`) and a run's scatter in ln epochs that it assumed, for interval() of such a fit.
        lr_cap_why: what the LR cap is, when it is not a measured headroom (the LR rule's words; None: the headroom)."""
        self.lr_cap_why = lr_cap_why
        self.log_covariance = None if log_covariance is None else np.asarray(log_covariance, dtype=float)
        self.run_scatter_log = run_scatter_log
        if noise_scale_range is not None and not (0 <= noise_scale_range[0] <= noise_scale_range[1]):
            raise ValueError(f"noise_scale_range must be 0 <= low <= high, got {noise_scale_range}")
        self.noise_scale_range = None if noise_scale_range is None else (float(noise_scale_range[0]), float(noise_scale_range[1]))
        self.min_epochs_fitted = min_epochs is not None and bool(noise_scale)
        if max_step_gain is not None and max_step_gain < 1:
            raise ValueError(f"max_step_gain must be >= 1 (a step at the reference LR is worth one reference step), got {max_step_gain}")
        if lr_headroom is not None and not lr_headroom > 0:
            raise ValueError(f"lr_headroom must be > 0, got {lr_headroom}")
        self.lr_headroom = None if lr_headroom is None else max(1.0, float(lr_headroom))
        self.reference_batch = reference_batch
        self.reference_epochs = reference_epochs
        self.noise_scale = noise_scale
        self.max_step_gain = max_step_gain
        self.optimizer = optimizer
        if min_epochs is not None and noise_scale:
            self.min_epochs = min_epochs
        else:
            self.min_epochs = reference_epochs / (1.0 + reference_batch / noise_scale) if noise_scale else reference_epochs

    def predict(self, global_batch: np.ndarray | float, with_cap_cost: bool = True) -> np.ndarray:
        """with_cap_cost=False: the epochs as if the LR cap cost nothing (the lower end of cap_interval)."""
        batch = np.asarray(global_batch, dtype=float)
        if not self.noise_scale:
            return self.reference_epochs * np.maximum(1.0, batch / self.reference_batch)
        epochs = self.min_epochs * (1.0 + batch / self.noise_scale)
        if with_cap_cost:
            epochs = epochs * np.sqrt(self.capped_step_factor(batch))
        return self._floored(epochs, batch)

    def _floored(self, epochs: np.ndarray, batch: np.ndarray) -> np.ndarray:
        """The epochs, never below the step floor E_ref B / (B_ref g) when there is a max_step_gain g."""
        return np.maximum(epochs, self.step_floor_epochs(batch)) if self.max_step_gain else epochs

    def cap_interval(self, global_batch: float) -> tuple[float, float] | None:
        """Where the LR headroom caps the LR at this batch: [epochs with no cost from the cap, the quadratic model's
        epochs of the capped step, q(B) times the first] (predict gives their geometric middle; module docstring),
        else None. With a step floor (max_step_gain), each end is floored as predict is."""
        if not self.lr_capped(global_batch):
            return None
        batch = np.asarray(global_batch, dtype=float)
        free = self.min_epochs * (1.0 + batch / self.noise_scale)
        return float(self._floored(free, batch)), float(self._floored(free * self.capped_step_factor(batch), batch))

    @property
    def banded(self) -> bool:
        """Whether interval() gives every batch a band: a calibrated noise-scale range, or a fit to runs with a covariance."""
        return self.noise_scale_range is not None or (self.min_epochs_fitted and self.log_covariance is not None)

    def interval(self, global_batch: float) -> tuple[float, float] | None:
        """The epochs at this batch over the calibrated noise-scale range: E(B) with B_noise at each end of
        noise_scale_range, E_min re-anchored at the reference run as predict's is, each end with its own LR cap and
        cap_interval; joined with this model's prediction and cap_interval. Without a range (or with E_min fitted to
        measured runs, which the range was not measured for) the cap's interval alone, else None."""
        if self.min_epochs_fitted and self.log_covariance is not None:
            return self._fitted_interval(global_batch)
        models = [self]
        if self.noise_scale_range is not None and self.noise_scale and not self.min_epochs_fitted:
            # a range that reaches 0 ends at the steps bound E_ref B / B_ref, the limit B_noise -> 0 (a tiny B_noise gives it)
            models += [self._with_noise_scale(max(noise, TINY_NOISE_SCALE * self.reference_batch)) for noise in self.noise_scale_range]
        elif self.cap_interval(global_batch) is None:
            return None
        ends = [float(m.predict(global_batch)) for m in models]
        ends += [end for m in models for end in (m.cap_interval(global_batch) or ())]
        return min(ends), max(ends)

    def _fitted_interval(self, global_batch: float) -> tuple[float, float]:
        """The 80% prediction interval of the epochs a run at B would measure, from a fit to measured runs: ln E(B) =
        ln E_min + ln(1 + B / B_noise) has the gradient J = [1, -(B / B_noise) / (1 + B / B_noise)] in (ln E_min,
        ln B_noise), so the curve's variance is J C J^T with C the fit's log_covariance (the delta method), and a run's
        own scatter about it, s^2 (run_scatter_log), adds to it: the ends are E(B) exp(-+ z sqrt(J C J^T + s^2));
        floored as predict is."""
        batch = float(global_batch)
        share = (batch / self.noise_scale) / (1.0 + batch / self.noise_scale)
        gradient = np.array([1.0, -share])
        variance = float(gradient @ self.log_covariance @ gradient) + (self.run_scatter_log or 0.0) ** 2
        spread = INTERVAL_Z * math.sqrt(max(variance, 0.0))
        value = self.min_epochs * (1.0 + batch / self.noise_scale)
        return float(self._floored(value * math.exp(-spread), batch)), float(self._floored(value * math.exp(spread), batch))

    def _with_noise_scale(self, noise_scale: float) -> "EpochModel":
        return EpochModel(self.reference_batch, self.reference_epochs, noise_scale, self.max_step_gain,
                          optimizer=self.optimizer, lr_headroom=self.lr_headroom, lr_cap_why=self.lr_cap_why)  # fmt: skip

    def capped_step_factor(self, global_batch: np.ndarray | float) -> np.ndarray:
        """q(B): how many more steps the LR cap costs at B by the quadratic model, [1 / (1 + B_noise / B)] /
        [2 x_c - x_c^2 (1 + B_noise / B)] where the best step x_opt(B) is above the cap x_c, else 1 (module
        docstring; the prediction takes its square root)."""
        batch = np.asarray(global_batch, dtype=float)
        if not self.noise_scale or self.lr_headroom is None:
            return np.ones_like(batch)
        noise_over_batch = 1.0 + self.noise_scale / batch
        capped = np.minimum(capped_step_fraction(self.cap_gain(), self.noise_scale, self.reference_batch), 1.0 / noise_over_batch)
        return (1.0 / noise_over_batch) / (2.0 * capped - capped**2 * noise_over_batch)

    def cap_description(self) -> str:
        """What caps the LR, in the answer's words: lr_cap_why, else the measured stability headroom."""
        return self.lr_cap_why or f"the measured stability headroom ({self.lr_headroom:.3g}x the reference LR)"

    def cap_gain(self) -> float:
        """The step gain the LR headroom allows: h for SGD, h^2 for Adam/AdamW (as max_step_gain)."""
        return float(max_step_gain(self.optimizer, 1.0, self.lr_headroom))

    def capped_gain(self, gain: float) -> float:
        """A step gain as the LR headroom allows it: min(gain, h) (h^2 for Adam); the gain itself without one."""
        return min(gain, self.cap_gain()) if self.lr_headroom is not None else gain

    def step_gain(self, global_batch: float) -> float | None:
        """The AdaScale gain r(B / B_ref) of this model's B_noise (module docstring), or with an LR headroom the
        gain of the capped step, min(r, h) (h^2 for Adam); None without a noise scale."""
        if not self.noise_scale:
            return None
        return self.capped_gain(adascale_gain(global_batch / self.reference_batch, self.noise_scale, self.reference_batch))

    def lr_multiplier(self, global_batch: float) -> float | None:
        gain = self.step_gain(global_batch)
        return None if gain is None else lr_multiplier_of_gain(gain, self.optimizer)

    def lr_capped(self, global_batch: float) -> bool:
        """Whether the measured headroom, not the AdaScale gain, sets the LR at this batch."""
        if not self.noise_scale or self.lr_headroom is None:
            return False
        return adascale_gain(global_batch / self.reference_batch, self.noise_scale, self.reference_batch) > self.cap_gain()

    def step_floor_epochs(self, global_batch: np.ndarray | float) -> np.ndarray:
        """E_ref B / (B_ref g): the epochs of S_ref / g steps at batch B."""
        return self.reference_epochs * np.asarray(global_batch, dtype=float) / (self.reference_batch * self.max_step_gain)


PERFECT_SCALING_NOISE_SCALE_FACTOR = 1e3  # B_noise reported for runs that show no efficiency loss: 1000 x their largest batch


def fit_epochs_to_runs(batches: list[int], epochs: list[float], prior: dict[str, float] | None = None) -> dict[str, Any]:
    """E_min and B_noise of E(B) = E_min (1 + B / B_noise) fitted to epochs measured at two or more global
    batches (least squares on log epochs, which weighs relative errors alike). Linear in the unknowns:
    E(B) = E_min + (E_min / B_noise) B, so a non-negative least-squares line through (B, E) starts it.
    When the epochs do not grow with the batch (slope <= 0), the runs show no loss of efficiency within
    their range: B_noise is then only bounded from below, and reported as
    PERFECT_SCALING_NOISE_SCALE_FACTOR x the largest batch with `lower_bound` set. Epochs that grow faster than
    linearly (a blow-up at the largest batch, which puts the line's intercept below 0) are fitted, not read as
    perfect scaling.

    With a prior (what the gradient statistics read, as epochs_calibration.noise_scale_prior gives it: ln B_noise
    ~ N(ln center, sigma_log^2), and run_scatter_log, the scatter of one run's log epochs about the form), the fit is
    the maximum a posteriori one instead,

        min over (E_min, B_noise) of  sum_i ((ln E(B_i) - ln E_i) / s)^2 + ((ln B_noise - ln center) / sigma_log)^2,

    so runs close together in batch (which pin B_noise down poorly: their epochs differ by little more than their
    scatter) lean on the statistics, and runs far apart outweigh them; `interval` is then the 80% interval of
    B_noise from the curvature at the optimum (Laplace: the covariance (J^T J)^-1 of the standardized residuals, given
    as `log_covariance` of (ln E_min, ln B_noise) for EpochModel.interval), and `runs_alone` the fit without the
    prior, for comparison."""
    from scipy.optimize import least_squares

    batch = np.asarray(batches, dtype=float)
    measured = np.asarray(epochs, dtype=float)
    if batch.size < 2 or np.unique(batch).size < 2:
        raise ValueError("fitting E_min and B_noise needs epochs at two or more distinct batches")
    slope, intercept = np.polyfit(batch, measured, 1)
    if slope <= 0:
        noise_scale = PERFECT_SCALING_NOISE_SCALE_FACTOR * float(batch.max())
        min_epochs = float(np.exp(np.mean(np.log(measured / (1 + batch / noise_scale)))))
        alone = {"min_epochs": min_epochs, "noise_scale": noise_scale, "lower_bound": True, "rms_log_error": _rms_log(batch, measured, min_epochs, noise_scale)}
    else:

        def residuals(log_params: np.ndarray) -> np.ndarray:
            min_epochs, noise_scale = np.exp(log_params)
            return np.log(min_epochs * (1 + batch / noise_scale)) - np.log(measured)

        # the line's intercept and slope start it; where the epochs grow faster than linearly (a large batch's blow-up
        # puts the line's intercept at or below 0), the fewest epochs and the batch where the line doubles them do
        start = [intercept, intercept / slope] if intercept > 0 else [float(measured.min()), float(measured.min()) / slope]
        fit = least_squares(residuals, np.log(start))
        min_epochs, noise_scale = (float(v) for v in np.exp(fit.x))
        alone = {"min_epochs": min_epochs, "noise_scale": noise_scale, "lower_bound": False, "rms_log_error": _rms_log(batch, measured, min_epochs, noise_scale)}
    if prior is None:
        return alone
    return _fit_with_prior(batch, measured, prior) | {"runs_alone": alone}


def _fit_with_prior(batch: np.ndarray, measured: np.ndarray, prior: dict[str, float]) -> dict[str, Any]:
    """The maximum a posteriori fit of fit_epochs_to_runs (its docstring)."""
    from scipy.optimize import least_squares

    center, sigma_log, scatter = prior["center"], prior["sigma_log"], prior["run_scatter_log"]
    if not (center > 0 and sigma_log > 0 and scatter > 0):
        raise ValueError(f"a noise-scale prior needs center, sigma_log and run_scatter_log > 0, got {prior}")

    def residuals(log_params: np.ndarray) -> np.ndarray:
        min_epochs, noise_scale = np.exp(log_params)
        runs = (np.log(min_epochs * (1 + batch / noise_scale)) - np.log(measured)) / scatter
        return np.append(runs, (log_params[1] - math.log(center)) / sigma_log)

    start = np.log([float(np.exp(np.mean(np.log(measured / (1 + batch / center))))), center])
    fit = least_squares(residuals, start)
    min_epochs, noise_scale = (float(v) for v in np.exp(fit.x))
    covariance = np.linalg.pinv(fit.jac.T @ fit.jac)
    spread = INTERVAL_Z * math.sqrt(max(float(covariance[1, 1]), 0.0))
    return {"min_epochs": min_epochs, "noise_scale": noise_scale, "lower_bound": False,
            "rms_log_error": _rms_log(batch, measured, min_epochs, noise_scale),
            "interval": [noise_scale * math.exp(-spread), noise_scale * math.exp(spread)], "prior": dict(prior),
            "log_covariance": covariance.tolist()}  # fmt: skip


def _rms_log(batch: np.ndarray, measured: np.ndarray, min_epochs: float, noise_scale: float) -> float:
    return float(np.sqrt(np.mean((np.log(min_epochs * (1 + batch / noise_scale)) - np.log(measured)) ** 2)))
