"""Batch-size schedules over a run to the target, and which one to use (issue 17; derivation in docs/schedule.md).

The local model (McCandlish et al. 2018, sec. 2 and App. D; the quadratic, i.e. convex, picture of the loss
near the current weights). Progress u in [0, 1] is the share of the noise-free steps S_min the run to the
target needs. A step at batch B with LR epsilon = x epsilon_max (epsilon_max the best LR at infinite batch)
makes the progress of

    g(x, B) = 2x - x^2 (1 + B_noise(u) / B)                                     noise-free steps,

which the best LR for B, x = 1 / (1 + B_noise / B), makes 1 / (1 + B_noise / B): the epochs model's
E(B) = E_min (1 + B / B_noise) at a fixed B. So a schedule B(u) with step time T(B) takes

    time = S_min int_0^1 T(B(u)) / g(x(u), B(u)) du,   samples = S_min int_0^1 B(u) / g du.

- B_noise(u): the shape of the noise scale along the reference run or pilot (gradient-statistics records,
  pooled in contiguous bins; past the records, their power-law trend with the slope held to [0, 1], as in
  tula_service.fit.perfmodel.noise_trajectory), taken non-decreasing (a running maximum: the noise scale grows
  as the loss falls, McCandlish et al.; an early dip is the initialization's transient or noise, and a
  schedule that follows it would flap), rescaled so that its progress-weighted mean equals the
  efficiency model's B_noise. That keeps a constant batch's prediction exactly the plan's (E(B) needs only
  the mean) and S_min = E_ref D / (B_ref + B_noise). Without a trajectory the shape is flat and no schedule
  beats a constant batch.
- T(B): the step-time model's prediction for each configuration on the chosen placement (per-device batch x
  accumulation, memory already bounded); the fastest configuration of each global batch is used.

The schedules, each evaluated by that integral:
- "constant": the plan's chosen configuration throughout.
- "optimal_for_lr" (the batch-schedule seed's question: the best batch for a prescribed LR schedule).
  With x(u) prescribed and T(B) = alpha + beta B, minimizing T / g over B gives, in closed form,

      B*(u) = (x B_noise + sqrt(x^2 B_noise^2 + x (2 - x) B_noise alpha / beta)) / (2 - x).

  As alpha -> 0 (time proportional to samples), B* = 2x B_noise / (2 - x): the batch proportional to the LR,
  as the convex bound gives (docs/schedule.md). The prescribed LR is the plan's: the recommended LR of the
  chosen batch, constant after warm-up (the spec carries no decay schedule). The efficiency model is
  calibrated on runs at a constant LR as if that LR were the best for their batch throughout, so the plan's
  LR is x(u) = 1 / (1 + B_noise(u) / B_chosen) (which makes "constant" exactly the plan's prediction).
  alpha, beta: least squares of the predicted step times over the placement's configurations.
  Each bin's B* is snapped to the configuration with the smallest T / g (exact for the fitted model).
- "time_optimal": the LR free to follow the batch (AdaScale), minimizing T(B) (1 + B_noise / B) at each u,
  which for T(B) = alpha + beta B is B*(u) = sqrt(alpha B_noise(u) / beta) (McCandlish et al.'s B_opt for
  time); snapped to the configurations the same way.
- "noise_tracking": B(u) ~ B_noise(u) (McCandlish et al.'s critical batch), the configuration whose global
  batch is nearest in log; the LR follows the AdaScale rule at each batch.
A stage whose LR follows the batch gets the AdaScale gain at the stage's own noise scale, r = (1 + B_noise(u) /
B_ref) / (1 + B_noise(u) / B): the ratio of the best LRs for B and for B_ref at that point of the run
(epsilon_opt(B) = epsilon_max / (1 + B_noise / B)), not at the run's mean noise scale; square-rooted for
Adam and capped at training.max_lr, as the plan's LR rule does. Where the plan's LR is capped (a measured stability
headroom, or a plateau's reference LR: EpochModel.lr_headroom), every bin's LR is held at the cap's fraction x_c of
epsilon_max and its progress predicted as the plan's capped epochs are (bin_progress): a schedule that climbs to
batches far above the noise scale at the capped LR is predicted as slow as it is.
- "staged_doubling": start at the largest configuration not above B_noise(0) and double the batch whenever
  the noise scale passes twice the current batch (the dynamic-batch rule of the seeds), AdaScale LR.
The recommendation is the fastest predicted, when at least MIN_GAIN faster than "constant", and when the
shape is not mostly an extrapolation: records that cover less than WEAK_COVERAGE of the run and are extended by
their trend keep the batch constant (benchmarks/online.py: a pilot over 10% of a run read a noise scale 8x the
whole run's and its recommended time_optimal schedule, predicted 10% faster, took 21% longer). Every figure
is "predicted", and the evidence (the trajectory's source, coverage, extrapolation) goes with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from tula_service.fit.efficiency_evidence import WEAK_COVERAGE
from tula_service.fit.perfmodel.efficiency import capped_step_fraction
from tula_service.fit.perfmodel.noise_trajectory import bins_of, read_trend, record_arrays

MIN_GAIN = 0.05  # a schedule is recommended over the constant batch only when predicted this much faster
PROFILE_BINS = 16  # at most, over the records (noise_trajectory.MAX_BINS)
EXTRAPOLATED_BINS = 4  # bins past the records, to the target, read from the trend
SCHEDULES = ("constant", "optimal_for_lr", "time_optimal", "noise_tracking", "staged_doubling")
PLAN_LR = ("constant", "optimal_for_lr")  # trained at the plan's LR; the others move the LR with the batch


@dataclass(frozen=True)
class NoiseProfile:
    """B_noise over progress: bin k covers progress [edges[k], edges[k+1]) with noise scale values[k]."""

    edges: np.ndarray  # K + 1 progress fractions, 0 .. 1
    values: np.ndarray  # K noise scales, rescaled to the model's B_noise (progress-weighted mean)
    source: str
    coverage: float  # share of the reference run's samples to the target the records reach
    extrapolated_from: float | None  # progress where the trend takes over from the records; None: no extrapolation
    rescale: float  # the factor applied to the measured shape

    @property
    def flat(self) -> bool:
        return self.values.size < 2 or float(np.ptp(self.values)) <= 1e-9 * float(np.max(self.values))

    def describe(self) -> dict[str, Any]:
        return {
            "source": self.source, "bins": int(self.values.size), "coverage": self.coverage,
            "extrapolated_from_progress": self.extrapolated_from, "rescale": self.rescale,
            "noise_scale_start": float(self.values[0]), "noise_scale_end": float(self.values[-1]),
        }  # fmt: skip


def flat_profile(noise_scale: float, source: str) -> NoiseProfile:
    return NoiseProfile(np.array([0.0, 1.0]), np.array([float(noise_scale)]), source, 0.0, None, 1.0)


def noise_profile(records: Sequence[Any], statistic: str, target_samples: float, batch: int, noise_scale: float, source: str) -> NoiseProfile:
    """The trajectory's shape over progress (module docstring), its progress-weighted mean set to noise_scale.

    Bins: contiguous records pooled (noise_trajectory.bins_of); a bin stands for the samples from the middle
    between it and its left neighbour to the middle with its right one (the first from 0, the last to the
    records' end), and makes (n / b) / (1 + B_bin / b) noise-free steps. Past the records, EXTRAPOLATED_BINS
    log-spaced bins to the target take the trend."""
    arrays = record_arrays(records, statistic)
    inside = arrays["samples"] <= target_samples
    arrays = {key: value[inside] for key, value in arrays.items()}
    bins, _ = bins_of(arrays) if arrays["samples"].size else ([], 0)
    if len(bins) < 2:
        return flat_profile(noise_scale, f"{source} (too few resolved bins for a shape: flat)")
    positions = np.array([b.samples for b in bins])
    values = [b.noise_scale for b in bins]
    covered = float(arrays["samples"].max())
    bounds = [0.0, *((positions[1:] + positions[:-1]) / 2), covered]
    extrapolated_at = None
    if covered < target_samples * 0.99:
        extrapolated_at = len(values)
        edges = np.geomspace(covered, target_samples, EXTRAPOLATED_BINS + 1)
        for low, high in zip(edges[:-1], edges[1:]):
            values.append(read_trend(bins, math.sqrt(low * high))[0])
            bounds.append(float(high))
    values_arr, spans = np.maximum.accumulate(np.array(values, dtype=float)), np.diff(bounds)
    progress = spans / batch / (1.0 + values_arr / batch)
    mean = float(np.sum(values_arr * progress) / np.sum(progress))
    rescale = noise_scale / mean
    edges = np.concatenate([[0.0], np.cumsum(progress) / np.sum(progress)])
    extrapolated_from = float(edges[extrapolated_at]) if extrapolated_at is not None else None
    return NoiseProfile(edges, values_arr * rescale, source, min(1.0, covered / target_samples), extrapolated_from, rescale)


@dataclass(frozen=True)
class Config:
    row: dict[str, Any]  # the plan's candidate row

    @property
    def batch(self) -> int:
        return int(self.row["global_batch"])

    @property
    def step_s(self) -> float:
        return float(self.row["step_time_s"]["value"])


def configs_on_placement(rows: list[dict[str, Any]], chosen: dict[str, Any]) -> list[Config]:
    """The fastest configuration of each global batch on the chosen placement, by global batch."""
    best: dict[int, dict[str, Any]] = {}
    for row in rows:
        if row["placement"] != chosen["placement"]:
            continue
        held = best.get(row["global_batch"])
        if held is None or row["step_time_s"]["value"] < held["step_time_s"]["value"]:
            best[row["global_batch"]] = row
    return [Config(best[b]) for b in sorted(best)]


def step_time_line(configs: list[Config]) -> tuple[float, float]:
    """(alpha s, beta s per sample) of T(B) = alpha + beta B, least squares over the configurations; alpha >= 0."""
    batches = np.array([c.batch for c in configs], dtype=float)
    times = np.array([c.step_s for c in configs])
    if batches.size < 2 or np.ptp(batches) == 0:
        return 0.0, float(times[0] / batches[0])
    beta, alpha = np.polyfit(batches, times, 1)
    if alpha < 0 or beta <= 0:  # not a line with an overhead: proportional through the origin
        return 0.0, float(batches @ times / (batches @ batches))
    return float(alpha), float(beta)


def closed_form_batch(lr_fraction: float, noise_scale: float, alpha_s: float, beta_s_per_sample: float) -> float:
    """B* = (x B_n + sqrt(x^2 B_n^2 + x (2 - x) B_n alpha / beta)) / (2 - x): the batch that minimizes the time per
    unit of progress, T(B) / g(x, B), for T(B) = alpha + beta B at LR fraction x (module docstring)."""
    x, bn = lr_fraction, noise_scale
    return (x * bn + math.sqrt(x * x * bn * bn + x * (2.0 - x) * bn * alpha_s / beta_s_per_sample)) / (2.0 - x)


def progress_per_step(lr_fraction: float | None, batch: float, noise_scale: float) -> float:
    """g(x, B) = 2x - x^2 (1 + B_noise / B); with x None (the best LR for B): 1 / (1 + B_noise / B)."""
    if lr_fraction is None:
        return 1.0 / (1.0 + noise_scale / batch)
    return 2.0 * lr_fraction - lr_fraction**2 * (1.0 + noise_scale / batch)


@dataclass(frozen=True)
class LRCap:
    """The plan's LR cap (a measured stability headroom, or a plateau's reference LR): a step gain of at most
    `step_gain` reference steps (EpochModel.cap_gain: h for SGD, h^2 for Adam), at reference batch `reference_batch`."""

    step_gain: float
    reference_batch: int

    def fraction(self, noise_scale: float) -> float:
        """x_c where the noise scale is B_noise (capped_step_fraction, as EpochModel.capped_step_factor reads it)."""
        return capped_step_fraction(self.step_gain, noise_scale, self.reference_batch)


def bin_progress(lr_fraction: float | None, batch: float, noise_scale: float, cap: LRCap | None = None) -> float:
    """Progress per step of a bin, g(x, B) (progress_per_step), where the LR cap holds x at x_c when it asks for more:
    then the geometric middle of no cost and the capped step's, sqrt(g(x, B) g(x_c, B)), as the plan's epochs take
    the middle of the capped step's interval (EpochModel.predict), so that a capped constant batch is predicted as
    the plan predicts it."""
    gain = progress_per_step(lr_fraction, batch, noise_scale)
    if cap is None:
        return gain
    x = lr_fraction if lr_fraction is not None else 1.0 / (1.0 + noise_scale / batch)
    x_cap = cap.fraction(noise_scale)
    if x <= x_cap:
        return gain
    capped = progress_per_step(x_cap, batch, noise_scale)
    return math.sqrt(gain * capped) if gain > 0 and capped > 0 else min(gain, capped)


def evaluate(profile: NoiseProfile, plan: list[Config], lr_fractions: list[float | None], min_steps: float,
             cap: LRCap | None = None) -> dict[str, float]:  # fmt: skip
    """Predicted seconds, samples and steps of a schedule (one configuration and LR fraction per bin); min_steps:
    S_min; cap: the plan's LR cap, if any (bin_progress). Infinite when a bin makes no progress (the LR too high for
    the batch's noise)."""
    seconds = samples = steps = 0.0
    for k, (config, x) in enumerate(zip(plan, lr_fractions)):
        gain = bin_progress(x, config.batch, float(profile.values[k]), cap)
        if gain <= 0:
            return {"seconds": math.inf, "samples": math.inf, "steps": math.inf}
        bin_steps = min_steps * float(profile.edges[k + 1] - profile.edges[k]) / gain
        steps, samples, seconds = steps + bin_steps, samples + bin_steps * config.batch, seconds + bin_steps * config.step_s
    return {"seconds": seconds, "samples": samples, "steps": steps}


def _nearest(configs: list[Config], batch: float) -> Config:
    return min(configs, key=lambda c: abs(math.log(c.batch / batch)))


def plans(profile: NoiseProfile, configs: list[Config], chosen: Config, cap: LRCap | None = None) -> dict[str, tuple[list[Config], list[float | None], str]]:
    """Each schedule's configuration and LR fraction per bin (None: the AdaScale LR of the bin's batch), and how; the
    fastest configurations are chosen with the LR cap's progress (bin_progress)."""
    bins = profile.values.size
    prescribed = [1.0 / (1.0 + float(bn) / chosen.batch) for bn in profile.values]  # the plan's LR (module docstring)
    alpha, beta = step_time_line(configs)
    optimal = [min(configs, key=lambda c: c.step_s / max(bin_progress(x, c.batch, float(bn), cap), 1e-12))
               for x, bn in zip(prescribed, profile.values)]  # fmt: skip
    closed = [closed_form_batch(x, float(bn), alpha, beta) for x, bn in zip(prescribed, profile.values)]
    fastest = [min(configs, key=lambda c: c.step_s / max(bin_progress(None, c.batch, float(bn), cap), 1e-12)) for bn in profile.values]
    doubling, current = [], max([c for c in configs if c.batch <= profile.values[0]] or [configs[0]], key=lambda c: c.batch)
    for bn in profile.values:
        while bn >= 2 * current.batch and any(c.batch >= 2 * current.batch for c in configs):
            current = min((c for c in configs if c.batch >= 2 * current.batch), key=lambda c: c.batch)
        doubling.append(current)
    return {
        "constant": ([chosen] * bins, [None] * bins, "the plan's chosen configuration throughout, at its LR"),
        "optimal_for_lr": (optimal, prescribed,
                           f"the closed form B* at the plan's LR (T(B) = {alpha:.3g} s + {beta:.3g} s x B) gives "
                           f"{_span(closed)} over the run, snapped to the configurations"),
        "time_optimal": (fastest, [None] * bins,
                         f"B* = sqrt(alpha B_noise / beta) with the LR following the batch gives "
                         f"{_span([math.sqrt(alpha * float(bn) / beta) for bn in profile.values])} over the run, snapped to the "
                         "configurations; AdaScale LR"),
        "noise_tracking": ([_nearest(configs, float(bn)) for bn in profile.values], [None] * bins,
                           "the configuration nearest the noise scale, AdaScale LR"),
        "staged_doubling": (doubling, [None] * bins,
                            "from the largest batch not above the starting noise scale, doubled whenever the noise scale "
                            "passes twice the batch; AdaScale LR"),
    }  # fmt: skip


def _span(values: list[float]) -> str:
    return f"{min(values):.3g}" if max(values) - min(values) < 0.5 else f"{min(values):.3g} to {max(values):.3g}"


def batch_schedule(profile: NoiseProfile | None, rows: list[dict[str, Any]], chosen_row: dict[str, Any], noise_scale: float | None,
                   reference_epochs: float, reference_batch: int, num_samples: int, lr_of_batch: Any,
                   cap_step_gain: float | None = None) -> dict[str, Any]:  # fmt: skip
    """The schedules, their predicted time to the target, and the recommended one. lr_of_batch(B, B_noise): the
    multiplier of the reference LR at global batch B where the noise scale is B_noise (None: the plan's).
    cap_step_gain: the plan's LR cap as a step gain (EpochModel.cap_gain), None without one: every schedule's
    progress is predicted at the LR the cap allows (bin_progress), as its stages' LRs are capped."""
    chosen_batch = chosen_row["global_batch"]
    if not noise_scale or profile is None:
        return _constant_only(chosen_row, "no noise scale was measured: nothing to schedule the batch by")
    configs = configs_on_placement(rows, chosen_row)
    chosen = Config(chosen_row)
    min_steps = reference_epochs * num_samples / (reference_batch + noise_scale)
    cap = LRCap(cap_step_gain, reference_batch) if cap_step_gain is not None else None
    results = {}
    for name, (plan, fractions, how) in plans(profile, configs, chosen, cap).items():
        predicted = evaluate(profile, plan, fractions, min_steps, cap)
        results[name] = {
            "stages": _stages(profile, plan, fractions, min_steps, num_samples, lr_of_batch, chosen_batch, plan_lr=name in PLAN_LR, cap=cap),
            "total_time_s": _predicted(predicted["seconds"]),
            "epochs": _predicted(predicted["samples"] / num_samples),
            "steps": _predicted(predicted["steps"]),
            "how": how,
        }
    constant_s = results["constant"]["total_time_s"]["value"]
    fastest = min(SCHEDULES, key=lambda name: results[name]["total_time_s"]["value"] or math.inf)
    gain = 1.0 - (results[fastest]["total_time_s"]["value"] or math.inf) / constant_s if constant_s else 0.0
    if profile.flat:
        recommended, why = "constant", f"the noise scale's shape is flat ({profile.source}): a constant batch"
    elif profile.extrapolated_from is not None and profile.coverage < WEAK_COVERAGE:
        recommended = "constant"
        why = (f"the records cover {profile.coverage:.0%} of the run, and the noise scale's shape past that is their "
               f"trend extended (weak evidence; {fastest} is predicted {max(gain, 0.0):.1%} faster): a constant batch")  # fmt: skip
    elif fastest == "constant" or gain < MIN_GAIN:
        recommended = "constant"
        why = (f"the fastest schedule ({fastest}) is predicted {max(gain, 0.0):.1%} faster than the constant batch, "
               f"below the {MIN_GAIN:.0%} worth a schedule")  # fmt: skip
    else:
        recommended = fastest
        why = f"predicted {gain:.1%} faster to the target than the constant batch {chosen_batch}"
    caveats = []
    if profile.extrapolated_from is not None:
        caveats.append(f"the noise scale past {profile.extrapolated_from:.0%} of the progress is extrapolated from the "
                       f"records' trend (they cover {profile.coverage:.0%} of the reference run's samples)")  # fmt: skip
    caveats.append("the local model (McCandlish et al. 2018) takes the noise scale to depend on progress only, and the "
                   "LR to move with the batch at once; a schedule's stages are placed by predicted progress")  # fmt: skip
    return {"recommended": recommended, "why": why, "predicted_gain": gain if recommended != "constant" else 0.0,
            "noise_profile": profile.describe(), "schedules": results, "caveats": caveats}  # fmt: skip


def _predicted(value: float) -> dict[str, Any]:
    return {"value": value if math.isfinite(value) else None, "source": "predicted"}


def _stages(profile: NoiseProfile, plan: list[Config], fractions: list[float | None], min_steps: float, num_samples: int,
            lr_of_batch: Any, chosen_batch: int, plan_lr: bool, cap: LRCap | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Consecutive bins with the same configuration merged; from_epoch: the predicted epochs done when a stage starts."""
    stages, samples = [], 0.0
    for k, (config, x) in enumerate(zip(plan, fractions)):
        if not stages or stages[-1]["global_batch"] != config.batch:
            # the plan's LR (constant, the prescribed-LR schedule); else the AdaScale rule at this stage's own noise scale
            multiplier = lr_of_batch(chosen_batch, None) if plan_lr else lr_of_batch(config.batch, float(profile.values[k]))
            stages.append({
                "from_progress": float(profile.edges[k]), "from_epoch": samples / num_samples,
                "global_batch": config.batch, "device_batch": config.row["device_batch"], "devices": config.row["devices"],
                "accumulation": config.row["accumulation"], "lr_multiplier": multiplier,
                "noise_scale": float(profile.values[k]),
            })  # fmt: skip
        gain = bin_progress(x, config.batch, float(profile.values[k]), cap)
        if gain > 0:
            samples += min_steps * float(profile.edges[k + 1] - profile.edges[k]) / gain * config.batch
    return stages


def _constant_only(chosen_row: dict[str, Any], why: str) -> dict[str, Any]:
    stage = {"from_progress": 0.0, "from_epoch": 0.0, "global_batch": chosen_row["global_batch"], "device_batch": chosen_row["device_batch"],
             "devices": chosen_row["devices"], "accumulation": chosen_row["accumulation"], "lr_multiplier": None, "noise_scale": None}  # fmt: skip
    constant = {"stages": [stage], "total_time_s": chosen_row["total_time_s"], "epochs": chosen_row["epochs"], "steps": None,
                "how": "the plan's chosen configuration throughout"}  # fmt: skip
    return {"recommended": "constant", "why": why, "predicted_gain": 0.0, "noise_profile": None, "schedules": {"constant": constant}, "caveats": []}
