"""Which B_noise the epochs model uses, from which evidence, and how sure it is.

Evidence for the noise scale, best first (the first one available is used; the others are reported next
to it with their ratio to it, so a disagreement is visible):

1. "other_runs": epochs to the target measured at two or more batches (training.reference_* plus
   training.other_runs). They are the quantity predicted itself, so E_min and B_noise are fitted to them
   (perfmodel.efficiency.fit_epochs_to_runs) and win over any gradient statistic. Where a statistic was read too
   (the best of 2-4), it enters that fit as a prior, weighed by its error measured across tasks against a run's own
   scatter (epochs_calibration.noise_scale_prior): two runs close together in batch pin B_noise down poorly and lean
   on it, runs far apart outweigh it; the fit reports B_noise with its 80% interval, the runs-alone fit beside it,
   and says when the two disagree. Until runs are given, the report names the run that settles the epochs best
   (next_run: NEXT_RUN_MULTIPLE x the reference batch; measured in benchmarks/one_more_run.py).
2. "reference_run": gradient statistics along the user's reference run (training.reference_run.
   gradient_stats, written by profiler.reference_logger): the user's model, data, optimizer and cluster, up
   to the target. Read by perfmodel.noise_trajectory: the noise scale averaged over the progress the run
   made in the second half of its samples to the target (the B_noise a fixed-batch run sees when it varies).
   Records at a batch b other than training.reference_batch (a live run the service moved, a log at another
   batch) are read over the second half of their own run to the target, E(b) D samples (run_target_samples).
3. "pilot": the pilot point's trajectory (profiling.pilot): the same estimator, but a pilot covers the
   start of the run only, so the value is extrapolated and labelled so.
4. "initialization": the compute points' statistics at the initial weights, pooled with equal weights.
   The noise scale grows 10-1000x during training, so this under-predicts the useful batch: weak evidence.

For Adam, AdamW, RMSprop, NAdam, RAdam and Adamax the records may also hold the statistics of the preconditioned gradient P g, P =
diag(1 / (sqrt(v) + eps)), v the optimizer's second moment (profiler.preconditioner): the update is P g (Adam's of
its momentum), so its noise-to-signal ratio is the one that sets how
far a larger batch helps. STATISTIC_FOR_OPTIMIZER says which one the model reads, chosen by measured error
in benchmarks/statistical_efficiency.py (docs/validation.md: on the Adam tasks the preconditioned one
predicted the epochs better); both are reported, and the raw one is used when the other is missing.

The epochs are a prediction for an LR protocol, reported as "assumes_lr": the advised rule (the AdaScale gain of
B_noise) for a noise scale from gradient statistics, the measured runs' own LRs for other_runs. Both ways of
training were measured on the CPU tasks (benchmarks/advised_lr.py against benchmarks/statistical_efficiency.py):
at the advised LR the epochs followed the prediction closely on most tasks, while an LR tuned at every batch went
past the rule at large batches and needed fewer epochs there.

How sure. The chosen evidence's statistical interval (its bootstrap) says how well its records pin B_noise down; how
far the read is from the B_noise the epochs need was measured across the benchmark's tasks, per kind of evidence, and
comes with it as noise_scale.calibrated_interval (tula_service.fit.epochs_calibration): the read times those factors,
joined with the statistical interval, which the EpochModel turns into every candidate's epochs interval. Records that
stop short of the target (a pilot's, a reference run's cut short) take the factors measured on prefixes as long as
theirs. other_runs get none (fitted to the epochs themselves; no factors measured for them).

LR stability. Records may carry a measured stability headroom (profiler.sharpness): how far the LR could grow at
that point of the run before the top Hessian direction is unstable. The smallest over the reference run's
records (else the pilot's) caps the LR the rule advises and sets the epochs of the capped step
(perfmodel.efficiency: EpochModel lr_headroom); with training.max_lr as well, the lower of the two caps the LR.
Measured (benchmarks/stability_headroom.py, docs/validation.md): the three plain-SGD tasks had a headroom of
1.11-1.27, and without the cap the advised LR failed to reach the target at the largest batches on two of them;
the momentum and Adam tasks 2.35-32, above every LR the rule advised.

SGD: no gradient statistic carries momentum's gain past the noise scale (where the step is curvature-limited,
heavy ball keeps gaining along flat directions; Zhang et al. 2019). Measured (benchmarks/statistical_efficiency.py,
docs/validation.md): momentum 0.9 put the critical batch fitted to the epochs 2-4x above the noise scale read on
three CPU tasks, and on the digits MLP trained with and without momentum the critical batch moved from 31 to 90
while the reference runs read 78 and 29. The other way too: on a ResNet with batch norm the critical batch was 0.10x
the read with momentum 0.9, and 102 against 69 without it (predicted within 9% without momentum, 48% with). So for SGD a noise scale from gradient statistics carries
MOMENTUM_CAVEAT in its warnings (PLAIN_SGD_CAVEAT when training.momentum is 0); epochs measured at other
batches (other_runs) hold the optimizer's behaviour and carry none. RMSprop is read as Adam is (the preconditioned
gradient), on the evidence of four tasks so far, which it fits unevenly: RMSPROP_CAVEAT says so; NAdam and RAdam
too, and Adamax and Adagrad, on one task each, and Adafactor on two: ADAM_VARIANT_CAVEAT. Adam, RMSprop, and NAdam and RAdam without
decoupled_weight_decay, with weight decay (an L2 term the preconditioner scales), and Adamax and Adagrad with it, carry
COUPLED_WEIGHT_DECAY_CAVEAT: one task measured it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tula_service.fit.epochs_calibration import calibrated_interval, load_calibration, noise_scale_prior
from tula_service.fit.perfmodel import EpochModel, NoiseScaleModel
from tula_service.fit.perfmodel.efficiency import INTERVAL_Z, fit_epochs_to_runs, max_step_gain
from tula_service.fit.perfmodel.noise_trajectory import FEW_RECORDS, MAX_RESOLVED_NOISE_SCALE, TrajectoryNoiseScale, record_arrays
from tula_service.measurement import NONFINITE_FIELDS, ComputeMeasurement, PilotMeasurement
from tula_service.spec.job_spec import GradientStatsRecord, JobSpec, TrainingSpec
from tula_service.spec.spec_limits import MAX_GRADIENT_STATISTIC

EVIDENCE_ORDER = ("other_runs", "reference_run", "pilot", "initialization")
STATISTIC_FOR_OPTIMIZER = {"sgd": "raw", "adam": "preconditioned", "adamw": "preconditioned", "rmsprop": "preconditioned",
                           "nadam": "preconditioned", "radam": "preconditioned", "adamax": "preconditioned", "adagrad": "preconditioned",
                           "adafactor": "preconditioned"}
WEAK_COVERAGE = 0.25  # a trajectory that stops before this fraction of the run to the target is extrapolated far
# runs whose fit misses them by more than this many times a typical task's scatter about E_min (1 + B / B_noise)
# (the calibration's run_scatter: 0.079 in ln over the benchmark's 54 tasks, the largest 0.26 but for a blow-up, 0.42, and
# a fine-tuning task whose target sits at its model's ceiling, 0.61)
# do not follow the form, and from_runs says so
MISFIT_FACTOR = 3.0
RUN_TARGET_BISECTIONS = 16  # run_target_samples: the bracket log(b / B_ref) over 2^16, below 0.02% of the samples up to b / B_ref = 1000
MOMENTUM_CAVEAT = (
    "sgd: above B_noise the epochs are uncertain by up to 10x. On CPU tasks with momentum 0.9 the critical batch of "
    "epochs trained at the advised LR was 0.12-3.5x the noise scale read, and with the LR tuned at every batch "
    "0.09-9.3x (9.3x on a GRU, 1.3x on the same GRU under Adam): momentum moves the critical batch either way (it raised it 1.6-2.9x on MLPs, a small CNN, a GPT and a linear model and 3.4x on "
    "the GRU, and lowered it on a ResNet with batch norm, read 10x too high with momentum, 8.4x with Nesterov momentum and "
    "weight decay 5e-4, and within 9% without); without "
    "momentum the noise scale read was 0.34-5.3x the critical batch (seven tasks; 0.34x on the GRU, whose critical batch "
    "was still 2.9x the read) (docs/validation.md, benchmarks/advised_lr.py). Epochs measured at 8x the reference batch (next_run; training.other_runs) settle it; "
    "training.max_lr or a measured headroom caps the advised LR"
)
PLAIN_SGD_CAVEAT = (
    "sgd without momentum (training.momentum 0): on the three CPU tasks trained so the noise scale read was 1.0-2.5x "
    "the critical batch fitted to their epochs, and on a GRU trained so once (a momentum ablation) 0.34x: its critical "
    "batch was 2.9x the read, 78% epochs error. On two of the three the advised LR overshot: at 8x the reference batch "
    "and above, few or no seeds reached the target, every seed with the LR capped at the stability headroom measured "
    "along the reference run (docs/validation.md, benchmarks/advised_lr.py). Measure the headroom (measure_stability) "
    "so the LR is capped; epochs measured at 8x the reference batch (next_run; training.other_runs) settle the rest"
)
RMSPROP_CAVEAT = (
    "rmsprop: read as Adam's is, from the preconditioned gradient P g, P = 1 / (sqrt(square_avg) + eps) "
    "(profiler.preconditioner), and the LR advised by the square root of the AdaScale gain. Measured on four CPU tasks "
    "only (docs/validation.md). Without momentum (PyTorch's default), a small CNN and an MLP on the digits: the noise "
    "scale read 1.12x below and 3.0x above the critical batch fitted to their epochs, 10.8% and 23.0% epochs error (the "
    "MLP's with the LR capped at the measured stability headroom, 1.43; 26% without it, and the raw gradient's read, 1.7x, "
    "gave 16%). With momentum 0.9 (training.momentum), the same CNN to a test accuracy of 0.98: read 6.4x above its "
    "critical batch, 47% epochs error, the predicted epochs too low at large batches (the raw gradient's read, 4.0x, "
    "43%). Centered (training.centered), on the MLP: its preconditioned statistics did not resolve (it divides by the "
    "gradient's variance estimate, small where the gradient is consistent), so the raw gradient's read was used, 1.59x "
    "above the critical batch, 14.9%. Epochs measured at 8x "
    "the reference batch (next_run; training.other_runs) settle it: 10.4%, 13.1%, 11.4% and 10.0% there"
)
COUPLED_WEIGHT_DECAY_CAVEAT = (
    "{optimizer} with weight_decay {weight_decay:g} (an L2 term added to the gradient before the preconditioner, unlike "
    "AdamW's decoupled decay): measured on one CPU task only (docs/validation.md): the digits CNN under Adam with weight "
    "decay 1e-4 read its noise scale 3.0x above the critical batch fitted to its epochs (1.24x without the decay), "
    "18.6% epochs error, the predicted epochs too low at large batches. Epochs measured at 8x the reference batch "
    "(next_run; training.other_runs) settle it: 9.5% there"
)
ADAM_VARIANT_CAVEAT = (
    "{optimizer}: read as Adam's is, from the preconditioned gradient P g ({preconditioner}; profiler.preconditioner), and "
    "the LR advised by the square root of the AdaScale gain, a rule derived for Adam and RMSprop (Malladi et al. 2022), "
    "not for {difference}: assumed. Measured on {tasks} (docs/validation.md): {measured}. Epochs measured at 8x the "
    "reference batch (next_run; training.other_runs) settle it: {settled} there"
)
# Adam's variants, Adagrad and Adafactor, as the caveat names them, and the tasks that measured each (benchmarks/statistical_efficiency.py;
# one CPU task where "tasks" is not given)
ADAM_VARIANTS_MEASURED = {
    "nadam": {"preconditioner": "P = 1 / (sqrt(v) + eps), v its bias-corrected exp_avg_sq", "difference": "its Nesterov term",
              "measured": "a small CNN on the digits read 2.2x above the critical batch fitted to its epochs, 19.8% epochs "
              "error, the predicted epochs too low at large batches (to a lower target, 2.8x and 14.3%)", "settled": "7.0%"},
    "radam": {"preconditioner": "P = sqrt(1 - beta2^t) / (sqrt(exp_avg_sq) + eps)", "difference": "its rectification",
              "measured": "with decoupled weight decay, an MLP on MNIST-1D read 1.35x below the critical batch fitted to its "
              "epochs, 13.4% epochs error", "settled": "9.7%"},
    "adamax": {"preconditioner": "P = 1 / u, u its exp_inf, an infinity norm of the gradients", "difference": "its infinity norm",
               "measured": "the digits MLP read 1.69x below the critical batch fitted to its epochs, 45.2% epochs error, "
               "the predicted epochs too high at large batches", "settled": "15.1%"},
    "adagrad": {"preconditioner": "P = 1 / (sqrt(sum) + eps), sum every past g^2", "difference": "a sum of every past g^2 in place "
                "of a moving average", "measured": "the digits MLP read 1.39x above the critical batch fitted to its epochs, 7.1% "
                "epochs error with the advised LR capped at the stability headroom measured along the reference run (0.21: the "
                "LR does not rise; 21.8% without the cap), its tuned LR 1-1.4x the reference batch's at every batch up to 32x",
                "settled": "8.3%"},
    "adafactor": {"preconditioner": "P = max(eps2, RMS(theta)) min(1, 1 / (lr sqrt(t))) / max(sqrt(V_hat), eps1), V_hat the "
                  "rank-one factoring of its moving mean of g^2", "difference": "its factored second moment and relative step",
                  "tasks": "two CPU tasks", "measured": "a small GPT read 1.33x below the critical batch fitted to its epochs, 13.9% "
                  "epochs error; the digits MLP 1.04x above it, yet 49.3% against the LR tuned at every batch: the stability headroom "
                  "measured along its reference run (0.16; the GPT's 0.47) keeps the advised LR from rising, where the tuned LR rose "
                  "1.4-5.6x (trained at that capped advice, 8.9%; the GPT 4.2%); 24.8% without the cap, the reference batch's own "
                  "epochs (3.67) lying above both neighbours' (2.45 at half the batch, 3.34 at twice it)",
                  "settled": "3.3% and 21.3% (no lower on the MLP, whose reference batch's epochs are an outlier)"},
}


def adam_variant_caveat(optimizer: str) -> str:
    """ADAM_VARIANT_CAVEAT for one of ADAM_VARIANTS_MEASURED."""
    return ADAM_VARIANT_CAVEAT.format(optimizer=optimizer, **{"tasks": "one CPU task", **ADAM_VARIANTS_MEASURED[optimizer]})
NEXT_RUN_MULTIPLE = 8  # the run that settles the epochs best for its cost, measured (benchmarks/one_more_run.py ADVISED_MULTIPLE)
NEXT_RUN_WHY = (
    "epochs to the same target measured at this batch (a run at {multiple}x the reference batch, capped at the data "
    "set), given as training.other_runs, are fitted with the noise scale read as a prior (from_runs). Measured on the 54 "
    "tasks of benchmarks/statistical_efficiency.py (docs/validation.md, 'One more run'): a run at 8x the reference batch "
    "took the median epochs error from 19.7% to 9.9%, 42 of 54 tasks within 15%, the worst 41.3% (from 142% on a GRU "
    "under SGD; the worst, a fine-tuning MLP under AdamW whose target sits at the model's ceiling, where the epochs of "
    "every batch scatter over seeds by up to 30x); one at 2x "
    "helped less (20.4%, worst 238%): runs close together differ by little more than a run's "
    "scatter. A run is only as good as its epochs: on one task, before its ground truth's LR was tuned better, the run at 8x was itself 2x off and "
    "the fit missed by 92.5%, so measure it at a well-tuned LR"
)
ASSUMED_LR = {
    "measured_runs": "the LR at each batch is chosen as it was in the measured runs",
    "advised_rule": "the LR at each batch follows the advised rule (lr_rule: the AdaScale gain of B_noise, its square "
    "root for the adaptive optimizers: Adam, AdamW, RMSprop, NAdam, RAdam, Adamax, Adagrad, Adafactor). Trained that way, the CPU tasks of benchmarks/advised_lr.py matched the predicted epochs "
    "within 2.7-7.8% (median per task) on 7 of 21 tasks and 10-67% on the others; with the LR tuned at every batch instead, "
    "they needed 1.1-2.8x fewer epochs above B_noise, so there a tuned LR can beat this prediction",
}


@dataclass
class NoiseEvidence:
    source: str
    noise_scale: float | None
    interval: tuple[float, float] | None = None
    stderr: float | None = None
    min_epochs: float | None = None  # only "other_runs" fits E_min itself
    detail: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    weak: bool = False  # the initial weights, or a trajectory extrapolated from less than WEAK_COVERAGE of the run

    def summary(self) -> dict[str, Any]:
        return {
            "source": self.source, "noise_scale": self.noise_scale,
            "interval": list(self.interval) if self.interval else None, "stderr": self.stderr,
            "detail": self.detail, "warnings": self.warnings, "weak": self.weak,
        }  # fmt: skip


def target_samples(spec: JobSpec) -> float:
    """T = E_ref D: the samples the reference run needs to reach its target."""
    return spec.training.reference_epochs * spec.dataset.num_samples


def run_target_samples(arrays: dict[str, np.ndarray], batch: int, spec: JobSpec, statistic: str) -> float:
    """T_b: the samples the run that logged the records needs to reach the target, at its own global batch b.
    arrays: the records as record_arrays(records, statistic), converted once by the caller (the conversion is most
    of a read's cost, and the bisection reads them RUN_TARGET_BISECTIONS times); batch: their global batch (_batch).

    The noise scale is read over a share of the run to the target (noise_trajectory), and a run at b needs
    E(b) D samples, not the reference run's E_ref D. A live run at 8 B_ref with B_noise near B_ref needs several
    times more, and the window [T/2, T] of the reference run's samples would be the first part of that run,
    where the noise scale is smaller: re-planning read too small a B_noise and moved runs to smaller batches
    late in training (benchmarks/online.py). E(b) depends on the B_noise read and the read on the window, so
    T_b solves

        T = E(b; B_noise(T)) D,   E(b; B) = E_ref (1 + b / B) / (1 + B_ref / B)   (EpochModel, with its step floor),

    with B_noise(T) the estimator over the window of a run of T samples. E(b; B) lies between E_ref and
    E_ref b / B_ref, so the root is searched by bisection on log T over that bracket (RUN_TARGET_BISECTIONS
    halvings); as the noise scale grows with training, B_noise(T) grows with T and the two sides cross once (a
    read that falls somewhere gives the first crossing found). At b = B_ref it is E_ref D. The LR headroom's
    cap is left out: the run trained at its own LR."""
    training = spec.training
    reference = target_samples(spec)
    if batch == training.reference_batch:
        return reference
    gain = max_step_gain(training.optimizer, training.reference_lr, training.max_lr)

    def excess(log_samples: float) -> float:
        read = TrajectoryNoiseScale(statistic=statistic).fit_arrays(arrays, math.exp(log_samples), interval=False).noise_scale_
        epochs = EpochModel(training.reference_batch, training.reference_epochs, read, gain, optimizer=training.optimizer)
        return math.log(float(epochs.predict(batch)) * spec.dataset.num_samples) - log_samples

    low, high = sorted((math.log(reference), math.log(reference * batch / training.reference_batch)))
    for _ in range(RUN_TARGET_BISECTIONS):
        middle = (low + high) / 2
        low, high = (middle, high) if excess(middle) > 0 else (low, middle)
    return math.exp((low + high) / 2)


def samples_to_target(records: list[Any], spec: JobSpec) -> float:
    """run_target_samples with the statistic from_trajectory reads for the spec's optimizer (the raw gradient's when
    the records lack the other)."""
    statistic = STATISTIC_FOR_OPTIMIZER[spec.training.optimizer]
    arrays = record_arrays(records, statistic)
    if not arrays["samples"].size:
        statistic, arrays = "raw", record_arrays(records, "raw")
    return run_target_samples(arrays, _batch(records), spec, statistic)


def from_trajectory(source: str, records: list[Any], spec: JobSpec) -> NoiseEvidence | None:
    if not records:
        return None
    wanted = STATISTIC_FOR_OPTIMIZER[spec.training.optimizer]
    arrays = {name: record_arrays(records, name) for name in ("raw", "preconditioned")}  # once each: a read's main cost
    available = [name for name, converted in arrays.items() if converted["samples"].size]
    batch = _batch(records)
    targets = {name: run_target_samples(arrays[name], batch, spec, name) for name in available}
    estimates = {name: TrajectoryNoiseScale(statistic=name).fit_arrays(arrays[name], targets[name]) for name in available}
    resolved = wanted in estimates and estimates[wanted].noise_scale_ is not None
    statistic = wanted if resolved else "raw"
    chosen = estimates[statistic]
    detail = {**chosen.describe(), "batch": int(batch),
              "preconditioned_noise_scale": estimates["preconditioned"].noise_scale_ if "preconditioned" in estimates else None,
              "raw_noise_scale": estimates["raw"].noise_scale_ if "raw" in estimates else None}  # fmt: skip
    warnings = []
    if statistic != wanted:
        warnings.append(f"{source}: the {wanted} statistics for {spec.training.optimizer} are "
                        f"{'missing' if wanted not in estimates else 'not resolved'}: the raw gradient's are used")  # fmt: skip
    if chosen.records_ == 0:
        first = float(np.min(arrays[statistic]["samples"]))
        warnings.append(f"{source}: none of its {arrays[statistic]['samples'].size} records lies at or before the target "
                        f"({targets[statistic]:.4g} samples seen: training.reference_epochs x dataset.num_samples, or E(b) D "
                        f"for records at another batch); the first is at {first:.4g}, so they were not used. Check "
                        "reference_epochs, and that each record's samples counts the samples of every device")  # fmt: skip
    elif chosen.noise_scale_ is None:
        warnings.append(f"{source}: the pooled |G|^2 or tr(Sigma) is not positive, or their ratio is past "
                        f"{MAX_RESOLVED_NOISE_SCALE:.0e} samples: the noise scale is not resolved")  # fmt: skip
    elif chosen.records_ < FEW_RECORDS:
        warnings.append(f"{source}: only {chosen.records_} record{'s' if chosen.records_ != 1 else ''} before the target: B_noise is the {chosen.method_} "
                        f"({'extrapolated' if chosen.extrapolated_ else 'read'} at {chosen.run_fraction:.0%} of the run"
                        f"{', with the first record past the target' if chosen.records_past_target_ else ''}), "
                        "so one noisy record moves it; statistics logged more often give a steadier read")  # fmt: skip
    if chosen.noise_scale_ is not None and chosen.extrapolated_:
        warnings.append(
            f"{source}: the records cover {chosen.coverage_:.1%} of their run's samples to the target; "
            f"B_noise is extrapolated to {chosen.run_fraction:.0%} of the run (slope {chosen.slope_:.2f} in log-log)"
            + (": weak evidence, the noise scale usually keeps growing" if chosen.coverage_ < WEAK_COVERAGE else "")
        )
    if detail["batch"] != spec.training.reference_batch:
        warnings.append(f"{source}: its records are at batch {detail['batch']}, not at training.reference_batch "
                        f"({spec.training.reference_batch}): read as a run of {targets[statistic]:.4g} samples to the target, "
                        f"E({detail['batch']}) D at the noise scale read (the reference run's: {target_samples(spec):.4g})")  # fmt: skip
    interval = _extrapolation_interval(chosen) if chosen.noise_scale_ is not None else None
    weak = chosen.extrapolated_ and chosen.coverage_ < WEAK_COVERAGE
    return NoiseEvidence(source, chosen.noise_scale_, interval, detail=detail, warnings=warnings, weak=weak)


def _extrapolation_interval(estimate: TrajectoryNoiseScale) -> tuple[float, float] | None:
    """The bootstrap interval; when extrapolated, its upper end also allows the noise scale to keep growing
    in proportion to the samples seen from the last record on (slope 1, an assumption stated in the report)."""
    if estimate.interval_ is None:
        return None
    low, high = estimate.interval_
    if estimate.extrapolated_ and estimate.covered_samples_ > 0:
        last = estimate.bins_[-1] if estimate.bins_ else None
        if last is not None:
            high = max(high, last.noise_scale * estimate.at_samples_ / last.samples)
    return low, high


def _batch(records: list[Any]) -> int:
    batches = [r.get("batch") if isinstance(r, dict) else r.batch for r in records]
    return int(np.median(batches))


GRADIENT_PAIR = ("true_grad_sq_norm", "trace_sigma")


def _overflowed(point: ComputeMeasurement) -> bool:
    """The point's |G|^2 or tr(Sigma) was not finite (an fp16 overflow, a diverging model): every iteration of the
    profiler's was (it leaves such iterations out and counts them), or the record has the number as None, listed in
    its NONFINITE_FIELDS; or it is past +-MAX_GRADIENT_STATISTIC, near the float limit."""
    gradient = point.gradient
    nonfinite = set((point.model_extra or {}).get(NONFINITE_FIELDS) or [])
    values = [getattr(gradient, name) for name in GRADIENT_PAIR]
    return (
        (gradient.iterations == 0 and gradient.nonfinite_iterations > 0)
        or any(f"gradient.{name}" in nonfinite for name in GRADIENT_PAIR)
        or any(value is not None and abs(value) > MAX_GRADIENT_STATISTIC for value in values)
    )


def from_initialization(points: list[ComputeMeasurement]) -> NoiseEvidence | None:
    measured = [m for m in points if m.gradient]
    left_out = sorted(int(m.batch_size) for m in measured if _overflowed(m))
    with_stats = [m.gradient for m in measured if not _overflowed(m) and None not in (m.gradient.true_grad_sq_norm, m.gradient.trace_sigma)]
    overflow_warning = (f"initialization: the gradient statistics of the points at batch {', '.join(map(str, left_out))} were not "
                        f"finite or past +-{MAX_GRADIENT_STATISTIC:.0e} (an fp16 overflow, a diverging model): left out")  # fmt: skip
    if not with_stats:
        return NoiseEvidence("initialization", None, None, warnings=[overflow_warning], weak=True) if left_out else None
    noise = NoiseScaleModel().fit([g.true_grad_sq_norm for g in with_stats], [g.trace_sigma for g in with_stats])
    detail = {"points": noise.points_, "true_grad_sq_norm": noise.true_grad_sq_norm_, "trace_sigma": noise.trace_sigma_,
              "weights": "equal per point", "batches": [int(g.batch) for g in with_stats]}  # fmt: skip
    warnings = ["initialization: the noise scale was measured at the initial weights; it grows 10-1000x as the "
                "loss falls (McCandlish et al. 2018), so larger batches are likely better than predicted: give "
                "training.reference_run.gradient_stats or other_runs, or enable profiling.pilot"]  # fmt: skip
    if left_out:
        warnings.append(overflow_warning)
    stderr = noise.noise_scale_stderr_
    interval = (max(noise.noise_scale_ - 2 * stderr, 0.0), noise.noise_scale_ + 2 * stderr) if noise.noise_scale_ and stderr else None
    return NoiseEvidence("initialization", noise.noise_scale_, interval, stderr=stderr, detail=detail, warnings=warnings, weak=True)


def from_runs(spec: JobSpec, statistics: NoiseEvidence | None = None) -> NoiseEvidence | None:
    """E_min and B_noise fitted to the epochs of the reference run and training.other_runs. With a noise scale read
    from gradient statistics (`statistics`, the best such evidence) and a calibration to weigh it by, jointly with it as
    a prior (perfmodel.efficiency.fit_epochs_to_runs; epochs_calibration.noise_scale_prior): two runs close together in
    batch pin B_noise down poorly: measured on the benchmark's tasks (benchmarks/statistical_efficiency.py, "One more
    run"), with a second run at 2x the reference batch the prior took the worst task's error from 57% to 43% and the
    worst regret from 3.36 to 1.18, and left runs 8x apart about as they were."""
    training = spec.training
    if not training.other_runs:
        return None
    batches = [training.reference_batch, *(run.batch for run in training.other_runs)]
    epochs = [training.reference_epochs, *(run.epochs for run in training.other_runs)]
    prior = None
    if statistics is not None and statistics.noise_scale:
        prior = noise_scale_prior(statistics.source, statistics.noise_scale, coverage=statistics.detail.get("coverage"))
    fit = fit_epochs_to_runs(batches, epochs, prior)
    detail = {"batches": batches, "epochs": epochs, "rms_log_error": fit["rms_log_error"], "lower_bound": fit["lower_bound"]}
    warnings = []
    alone = fit.get("runs_alone", fit)
    if prior is not None:
        detail.update(prior=prior, runs_alone={key: alone[key] for key in ("noise_scale", "min_epochs", "lower_bound", "rms_log_error")},
                      log_covariance=fit["log_covariance"])  # fmt: skip
        low, high = (prior["center"] * math.exp(side * INTERVAL_Z * prior["sigma_log"]) for side in (-1, 1))
        if not low <= alone["noise_scale"] <= high:
            warnings.append(
                f"other_runs: the runs alone give B_noise {alone['noise_scale']:.3g}"
                + (" (a lower bound: their epochs do not grow with the batch)" if alone["lower_bound"] else "")
                + f", outside the 80% range {low:.3g}-{high:.3g} that the {statistics.source.replace('_', ' ')}'s read of "
                f"{statistics.noise_scale:.3g} gives: the fit weighs the two by their measured scatter "
                f"(a run's epochs: {prior['run_scatter_log']:.2g} in ln; the read: {prior['sigma_log']:.2g}) and gives {fit['noise_scale']:.3g}"
            )  # fmt: skip
    elif fit["lower_bound"]:
        warnings.append("other_runs: the epochs do not grow with the batch over the runs given, so B_noise is only "
                        f"known to be far above {max(batches)}: reported as {fit['noise_scale']:.3g}")  # fmt: skip
    if len(batches) == 2 and prior is None:
        warnings.append("other_runs: two runs determine E_min and B_noise exactly: no check of the fit")
    scatter = prior["run_scatter_log"] if prior else ((load_calibration() or {}).get("run_scatter") or {}).get("rms_log")
    if len(batches) >= 3 and scatter and alone["rms_log_error"] > MISFIT_FACTOR * scatter:
        warnings.append(
            f"other_runs: E_min (1 + B / B_noise) misses the runs by {alone['rms_log_error']:.2f} in ln (rms), more than "
            f"{MISFIT_FACTOR:g}x a typical task's scatter about it ({scatter:.2g}): their epochs do not follow the form (a "
            "blow-up at the largest batch, from an LR past what trains there or a large-batch generalization gap, is not "
            "the form's), so the epochs predicted between and beyond them are less sure than their interval says")  # fmt: skip
    interval = tuple(fit["interval"]) if "interval" in fit else None
    return NoiseEvidence("other_runs", fit["noise_scale"], interval, min_epochs=fit["min_epochs"], detail=detail, warnings=warnings)


def gather(spec: JobSpec, points: list[ComputeMeasurement], pilot: PilotMeasurement | None) -> list[NoiseEvidence]:
    """Every piece of evidence available, best first (EVIDENCE_ORDER); measured runs are fitted with the best
    gradient-statistics evidence as their prior (from_runs)."""
    reference = spec.training.reference_run
    statistics = [
        from_trajectory("reference_run", list(reference.gradient_stats), spec) if reference else None,
        from_trajectory("pilot", list(pilot.trajectory), spec) if pilot else None,
        from_initialization(points),
    ]
    statistics = [evidence for evidence in statistics if evidence is not None]
    start = f"initial_weights {spec.initial_weights}" if spec.initial_weights else f"a random init (profiling.seed {spec.profiling.seed})"
    for evidence in statistics:
        if evidence.source in ("pilot", "initialization"):  # the profiler's own training: from where it started
            evidence.detail["started_from"] = start
    runs = from_runs(spec, choose(statistics))
    return ([runs] if runs else []) + statistics


LR_HEADROOM_WHY = (
    "the smallest stability headroom (2 + 2 beta) / (eta lambda_max) measured along the run (profiler.sharpness; "
    "Cohen et al. 2021, 2022): the LR the rule advises is capped at this many times the reference LR. A lower bound on "
    "what trains (sharpness adapts to the LR), so a capped LR is safe rather than fast"
)


def headroom_over_reference_lr(record: GradientStatsRecord, reference_lr: float | None) -> float:
    """A record's headroom as a multiple of the reference LR: h x stability_lr / reference_lr, since
    (2 + 2 beta) / lambda_max = h x eta is the largest stable LR whatever eta it was measured at (a warm-up, a
    decay, a run whose LR the service changed). Without both LRs, h itself: taken as measured at the reference LR."""
    if reference_lr and record.stability_lr:
        return record.stability_headroom * record.stability_lr / reference_lr
    return record.stability_headroom


def measured_lr_headroom(spec: JobSpec, pilot: PilotMeasurement | None, earlier: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The smallest headroom over the reference LR (headroom_over_reference_lr) over the second half of the
    reference run to the target (the part its noise scale is read from: at the records' own batch, samples_to_target), else `earlier` (re-planning a run from
    its live records: the job's own headroom, the same model's), else over the reference run's first half, else
    over the pilot's records, with its evidence; None without one. With training.max_lr too, the LR is capped at
    the lower of the two.

    The second half because the sharpness swings early in a run: measured at 8 points of the CPU tasks' reference
    runs (benchmarks/stability_headroom.py), the headroom at 1/8-1/4 of the run dipped to 0.2-0.5x its later
    values on plain SGD and on a CNN, and a cap at that dip bound where an LR 4x the reference trained."""
    reference = spec.training.reference_run
    measured = [r for r in (reference.gradient_stats if reference else []) if r.stability_headroom is not None]
    half = samples_to_target(list(reference.gradient_stats), spec) / 2 if measured else 0.0  # of the run at the records' batch
    late = [r for r in measured if r.samples >= half]
    candidates = [("reference_run, second half", late), ("reference_run, first half only", measured),
                  ("pilot (the start of the run)", [r for r in (pilot.trajectory if pilot else []) if r.stability_headroom is not None])]  # fmt: skip
    reference_lr = spec.training.reference_lr
    if earlier is not None and not late:
        return {**earlier, "evidence": f"the job's: {earlier['evidence']}"}
    for source, records in candidates:
        if records:
            smallest = min(records, key=lambda r: headroom_over_reference_lr(r, reference_lr))
            value = headroom_over_reference_lr(smallest, reference_lr)
            if reference_lr and smallest.stability_lr:
                at = f"measured at LR {smallest.stability_lr:.3g}: {smallest.stability_headroom:.3g}x that, {value:.3g}x reference_lr"
            else:
                at = "taken as measured at the reference LR (" + ("no stability_lr" if reference_lr else "no training.reference_lr") + ")"
            return {"value": value, "source": "measured",
                    "evidence": f"{source}: {len(records)} records, smallest at {smallest.samples} samples, {at}", "why": LR_HEADROOM_WHY}  # fmt: skip
    return None


PLATEAU_FALL = 0.01  # a loss that fell by less than 1% over the records has not moved (assumed; see plateau_cap)
PLATEAU_MIN_RECORDS = 4  # records with a loss needed to tell: a quarter of them at each end


def loss_fall(records: list[Any]) -> dict[str, float] | None:
    """How far the training loss fell over the records: (mean of the first quarter - mean of the last quarter) / |the
    first|, with both means; None with fewer than PLATEAU_MIN_RECORDS losses (or a first mean of 0)."""
    losses = [float(r.loss) for r in sorted(records, key=lambda r: r.samples) if getattr(r, "loss", None) is not None]
    if len(losses) < PLATEAU_MIN_RECORDS:
        return None
    quarter = len(losses) // 4
    first, last = float(np.mean(losses[:quarter])), float(np.mean(losses[-quarter:]))
    return {"fall": (first - last) / abs(first), "first": first, "last": last} if first else None


def plateau_cap(spec: JobSpec, chosen: NoiseEvidence | None, pilot: PilotMeasurement | None) -> dict[str, Any] | None:
    """The LR cap when the records the noise scale was read from are a plateau: their training loss fell by less than
    PLATEAU_FALL. Then the model had not begun to learn, and neither the gradient statistics nor a stability headroom
    measured there describe the rest of training, nor show that a higher LR trains: the LR stays at the reference
    (a cap of 1, through the headroom cap's epochs model), and the answer says so. A live run's records are read the
    same way (tula_service.runs.replan puts them in the reference run's place).

    Measured: on the GRU under SGD with momentum (benchmarks/online.py, docs/validation.md) a pilot over the first 10%
    of the run sat at the loss of chance (2.30-2.32). Over the first 10% of the reference runs its loss fell 0.01%,
    every other suite task's with 4 or more records there 2.5-77%. The pilot read B_noise 9 922 against a critical
    batch of 533 fitted to the epochs, and a headroom of 144 where the run's second half measured 10-21; the plan
    took batch 1024 at 29x the reference LR, and no seed trained to the target.

    None otherwise (the loss fell, too few losses, or evidence that is not a trajectory: measured runs, the initial
    weights)."""
    records = {"pilot": list(pilot.trajectory) if pilot else [],
               "reference_run": list(spec.training.reference_run.gradient_stats) if spec.training.reference_run else []}.get(chosen.source if chosen else "", [])  # fmt: skip
    fall = loss_fall(records)
    if fall is None or fall["fall"] >= PLATEAU_FALL:
        return None
    source = chosen.source.replace("_", " ")
    return {"value": 1.0, "source": "assumed", "cap_why": f"the reference LR: the {source}'s records are a plateau",
            "evidence": (f"{source}: a plateau: its training loss fell by {fall['fall']:.2%} over its {len(records)} records "
                         f"({fall['first']:.4g} -> {fall['last']:.4g}, the first and last quarters' means), under {PLATEAU_FALL:.0%}"),
            "why": ("the model had not begun to learn where the records were taken: their noise scale and any headroom "
                    "measured there need not hold for the rest of the run, and nothing shows that a higher LR trains, so "
                    "the LR is not raised above the reference LR (a pilot that stops before the loss moves: give more "
                    "pilot_steps or pilot_seconds, or the reference run's own statistics)")}  # fmt: skip


def choose(evidence: list[NoiseEvidence]) -> NoiseEvidence | None:
    return next((e for e in evidence if e.noise_scale), None)


def epoch_model(spec: JobSpec, points: list[ComputeMeasurement], pilot: PilotMeasurement | None,
                earlier_headroom: dict[str, Any] | None = None) -> tuple[EpochModel, dict[str, Any]]:  # fmt: skip
    """The epochs model and the efficiency section of the fit report (earlier_headroom: measured_lr_headroom's)."""
    evidence = gather(spec, points, pilot)
    chosen = choose(evidence)
    training = spec.training
    headroom = measured_lr_headroom(spec, pilot, earlier_headroom)
    plateau = plateau_cap(spec, chosen, pilot)
    plateau_caps = plateau is not None and (headroom is None or headroom["value"] > plateau["value"])
    if plateau_caps:
        headroom = plateau
    calibrated = calibrated_interval(chosen.source, chosen.noise_scale, chosen.interval, coverage=chosen.detail.get("coverage")) if chosen else None
    epochs = EpochModel(
        training.reference_batch, training.reference_epochs, chosen.noise_scale if chosen else None,
        max_step_gain(training.optimizer, training.reference_lr, training.max_lr),
        min_epochs=chosen.min_epochs if chosen else None, optimizer=training.optimizer,
        lr_headroom=headroom["value"] if headroom and chosen and chosen.source != "other_runs" else None,
        noise_scale_range=tuple(calibrated["value"]) if calibrated else None,
        log_covariance=chosen.detail.get("log_covariance") if chosen and chosen.source == "other_runs" else None,
        run_scatter_log=chosen.detail["prior"]["run_scatter_log"] if chosen and chosen.detail.get("prior") else None,
        lr_cap_why=(headroom or {}).get("cap_why"),
    )  # fmt: skip
    summary = report(chosen, evidence, epochs, headroom, calibrated)
    if plateau_caps:
        summary["warnings"] = [*summary["warnings"], f"{plateau['evidence']}: {plateau['why']}"]
    summary["next_run"] = next_run(spec, chosen, epochs)
    if training.optimizer == "sgd" and chosen is not None and chosen.source != "other_runs":
        summary["warnings"] = [*summary["warnings"], PLAIN_SGD_CAVEAT if training.sgd_momentum()["value"] == 0 else MOMENTUM_CAVEAT]
    if training.optimizer == "rmsprop" and chosen is not None and chosen.source != "other_runs":
        summary["warnings"] = [*summary["warnings"], RMSPROP_CAVEAT]
    if training.optimizer in ADAM_VARIANTS_MEASURED and chosen is not None and chosen.source != "other_runs":
        summary["warnings"] = [*summary["warnings"], adam_variant_caveat(training.optimizer)]
    weight_decay = coupled_weight_decay(training)
    if weight_decay and chosen is not None and chosen.source != "other_runs":
        summary["warnings"] = [*summary["warnings"], COUPLED_WEIGHT_DECAY_CAVEAT.format(optimizer=training.optimizer, weight_decay=weight_decay)]
    return epochs, summary


def coupled_weight_decay(training: TrainingSpec) -> float:
    """The weight decay an adaptive optimizer adds to the gradient before its preconditioner (Adam, RMSprop, and NAdam
    and RAdam without decoupled_weight_decay; COUPLED_WEIGHT_DECAY_CAVEAT), 0 where there is none or it is decoupled
    (AdamW's, Adafactor's) or the optimizer is SGD's (no preconditioner to scale it)."""
    settings = training.optimizer_settings()
    decoupled = settings.get("decoupled_weight_decay", {"value": training.optimizer in ("adamw", "adafactor")})["value"]  # by their class
    if STATISTIC_FOR_OPTIMIZER[training.optimizer] != "preconditioned" or decoupled:
        return 0.0
    return float(settings["weight_decay"]["value"])


def next_run(spec: JobSpec, chosen: NoiseEvidence | None, epochs: EpochModel) -> dict[str, Any] | None:
    """The run whose epochs would settle the prediction best (NEXT_RUN_WHY): NEXT_RUN_MULTIPLE x the reference batch,
    capped at the data set's size, with the epochs predicted there (and their calibrated interval where there is one).
    None where the epochs already come from measured runs, or the data set leaves no larger batch."""
    if chosen is not None and chosen.source == "other_runs":
        return None
    reference = spec.training.reference_batch
    batch = min(NEXT_RUN_MULTIPLE * reference, spec.dataset.num_samples)
    if batch <= reference:
        return None
    interval = epochs.interval(batch)
    return {"batch": int(batch), "predicted_epochs": float(epochs.predict(batch)),
            "predicted_epochs_interval": [float(v) for v in interval] if interval else None,
            "why": NEXT_RUN_WHY.format(multiple=NEXT_RUN_MULTIPLE)}  # fmt: skip


def report(chosen: NoiseEvidence | None, evidence: list[NoiseEvidence], epochs: EpochModel, headroom: dict[str, Any] | None = None,
           calibrated: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    candidates = [e.summary() | {"ratio_to_used": (e.noise_scale / chosen.noise_scale) if chosen and e.noise_scale else None}
                  for e in evidence]  # fmt: skip
    if chosen is None:
        return {
            "formula": "E(B) = reference_epochs * max(1, B / reference_batch)",
            "noise_scale": None,
            "source": "assumed",
            "evidence": {"used": None, "candidates": candidates},
            "warnings": [w for e in evidence for w in e.warnings],
            "note": "no informative noise-scale measurement (none taken, or the pooled |G|^2 or tr(Sigma) "
            "is not positive: the gradient signal is below what the profiled batches resolve); assumed: "
            "epochs constant up to the reference batch, and no fewer optimizer steps than the reference "
            "run beyond it",
        }
    floor = epochs.max_step_gain is not None
    fitted_min = chosen.min_epochs is not None
    return {
        "formula": "E(B) = E_min (1 + B / B_noise), "
        + (("E_min and B_noise fitted to the measured runs" + (f", with the {chosen.detail['prior']['source'].replace('_', ' ')}'s "
                                                                 "noise scale as a prior" if chosen.detail.get("prior") else ""))
           if fitted_min else "E_min from the reference run")
        + ("; never below E_ref B / (B_ref max_step_gain)" if floor else "")
        + ("; the LR capped at lr_headroom times the reference, times the capped step's extra steps" if epochs.lr_headroom else ""),
        "noise_scale": {"value": chosen.noise_scale, "interval": list(chosen.interval) if chosen.interval else None,
                        "stderr": chosen.stderr, "source": "fitted", "evidence": chosen.source,
                        "calibrated_interval": calibrated},  # fmt: skip
        "evidence": {"used": chosen.source, "order": list(EVIDENCE_ORDER), "candidates": candidates},
        "max_step_gain": {
            "value": epochs.max_step_gain, "source": "spec",
            "why": "training.max_lr / reference_lr (squared for Adam): the LR, and with it the progress per step, "
            "cannot grow past max_lr, so a step is worth at most this many reference steps",
        } if floor else None,  # fmt: skip
        "lr_headroom": headroom if epochs.lr_headroom else None,
        "min_epochs": {"value": epochs.min_epochs, "source": "fitted"},
        "assumes_lr": ASSUMED_LR["measured_runs" if chosen.source == "other_runs" else "advised_rule"],
        "source": "fitted",
        # the evidence preferred to the one used (EVIDENCE_ORDER), and why it was not used, first
        "warnings": [w for e in evidence[: evidence.index(chosen)] for w in e.warnings] + chosen.warnings,
        "weak": chosen.weak,
        "note": _NOTES[chosen.source],
    }


_NOTES = {
    "other_runs": "E_min and B_noise fitted to the epochs measured at the given batches: the most direct evidence",
    "reference_run": "noise scale averaged over the progress made in the second half of the user's reference run to the "
    "target",
    "pilot": "noise scale read along the pilot run at the reference batch and extrapolated to the second half of the "
    "reference run to the target",
    "initialization": "noise scale measured in the first iterations from the initial weights; it grows as the loss "
    "falls (McCandlish et al. 2018), so larger batches are likely more efficient than predicted",
}
