"""Is the statistical-efficiency model right on tasks it was not tuned on? Epochs to a target at every batch,
predicted from ONE reference run's gradient statistics, against training runs that measured them.

Tasks:
- The two Pollux applications in ../shared/data/pollux-traces/ (real GPU runs, benchmarks/pollux_traces.py):
  cifar10 (ResNet-18) and imagenet (ResNet-50), SGD, runs at 6-7 global batches each. The target is the
  highest metric every run reaches, times TARGET_FRACTION_OF_WORST_BEST (so every run reaches it, late in
  training). Epochs to the target come from each run's `iteration` column; the reference run's grad_sqr /
  grad_var rows are its trajectory.
- The CPU tasks of benchmarks/efficiency_tasks.py: ground truth trained on this machine (LR tuned per batch,
  several seeds), cached in docs/validation/statistical_efficiency/ground_truth.json (regenerate with
  --regenerate-ground-truth; about 30 minutes).

The prediction goes through the service's own code path: the reference run's records are validated as
`training.reference_run.gradient_stats` of a JobSpec (reference_batch, reference_epochs = its measured
epochs, dataset.num_samples = the data set's size), and `tula_service.fit.efficiency_evidence.epoch_model` gives
the epochs model the planner uses. The model and data-set names of that spec are placeholders: the
efficiency model reads only training and num_samples.

Reported per task: predicted vs measured epochs per batch and the median |error| with the reference excluded;
the critical batch size predicted (B_noise with its interval) against the one fitted to the ground truth
(E(B) = E_min (1 + B / B_noise), least squares on log epochs over all measured batches) as the ratio
max(pred/fit, fit/pred); the regret of the min-time pick = measured time at the pick / best measured time,
where time = epochs x seconds per epoch measured for that batch (CPU: timed in common rounds; Pollux: the
fastest packed placement of the 4 x 4 T4 cluster in placements.csv), so that the regret isolates the
efficiency model. Besides the service's estimator, the same records are read by the alternatives it was
chosen from (the noise scale at the first record, i.e. at initialization; the pooled ratio over the whole
run; over its second half; the geometric mean or median of pooled bins; the progress-weighted mean over
other parts of the run, the whole run included; the finite-data factor D / (D - 1 - B) applied on top; the
power-law trend read at other fractions of the run; pilot-like prefixes of the run) and, for Adam/AdamW/RMSprop,
from the raw and the preconditioned statistics; and every batch is tried as the reference (the service's
estimator against the geometric mean of bins). What the ground truth allows (truth_floor): the best single
B_noise for this code path and its error, the reference run's epochs against the curve fitted to every batch,
and that curve's own error.

The calibrated interval (tula_service.fit.epochs_calibration): per measured batch of every task, the B_noise that makes
its epochs exact, over the B_noise read (by the reference run's records, prefixes of them covering 5%, 25%, 50% and
75% of the run, extrapolated as a pilot's or a cut-short reference run's are, and their first record); the 10% and 90% quantiles per kind of evidence, each task weighing the same, are the factors the
service applies. The full run writes them to configs/epochs_calibration.json (--quick: into its temporary folder);
each task left out of them in turn says how a held-out task fares (interval_coverage, the second-to-last line). The
Pollux applications are also read at other targets (pollux_target_sweep: 0.9-1.0 of the lowest best metric).

--momentum-ablation [TASK ...]: the CPU SGD tasks trained again with --momentum (default 0, plain SGD; the LR grid
moved to the same effective LR lr / (1 - beta)), against their ground truth (momentum 0.9): does momentum, which
the gradient statistics do not see, set the critical batch? (momentum_ablation; minutes per task, nothing else runs.)

Run:  .venv/bin/python benchmarks/statistical_efficiency.py [--quick] [--out docs/validation/statistical_efficiency]
          [--regenerate-ground-truth [--workers 2]]
      .venv/bin/python benchmarks/statistical_efficiency.py --momentum-ablation [TASK ...] [--momentum 0]
(--quick: the same evaluation on the cached ground truth into a temporary folder; seconds.)
Second-to-last line:  calibrated_interval: factors=LO/HI epochs_inside_leave_one_out=I/N best_noise_scale_inside_statistical=S/T
                      best_noise_scale_inside_calibrated=C/T
Last line:  statistical_efficiency: tasks=N median_epochs_err_pct=X worst_task_epochs_err_pct=Y max_regret=Z cbs_ratio_max=W
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import one_more_run  # noqa: E402
import pollux_traces  # noqa: E402

from tula_service.fit.efficiency_evidence import STATISTIC_FOR_OPTIMIZER, epoch_model  # noqa: E402
from tula_service.fit.epochs_calibration import CALIBRATION_PATH, calibration_factors, exact_noise_scale, run_scatter  # noqa: E402
from tula_service.fit.perfmodel.efficiency import EpochModel, fit_epochs_to_runs  # noqa: E402
from tula_service.fit.perfmodel.noise_trajectory import TrajectoryNoiseScale, pooled_ratio, record_arrays  # noqa: E402
from tula_service.spec.job_spec import JobSpec  # noqa: E402

TARGET_FRACTION_OF_WORST_BEST = 0.99
PILOT_PREFIXES = (0.05, 0.25, 0.5, 0.75)  # the pilot-like prefixes of the alternatives (fractions of the run to the target)
POLLUX_CLUSTER = (4, 4)  # nodes x GPUs per node of the traces' testbed
EPOCHS_TARGET_PCT = 15.0
POLLUX_EPOCHS_TARGET_PCT = 10.0
REGRET_TARGET = 1.10
CBS_RATIO_TARGET = 1.5
DEFAULT_OUT = REPO / "docs" / "validation" / "statistical_efficiency"
TIME_TO_ACCURACY_RESULTS = REPO / "docs" / "validation" / "results.json"
GENERATED_START = "<!-- generated by benchmarks/statistical_efficiency.py: start -->"
GENERATED_END = "<!-- generated by benchmarks/statistical_efficiency.py: end -->"


@dataclass
class Task:
    """One task's ground truth, whatever its source."""

    name: str
    source: str  # "pollux" | "cpu"
    dataset_size: int
    optimizer: str
    reference_batch: int
    target: str
    epochs: dict[int, float]  # measured epochs to the target per global batch (median over seeds)
    epochs_range: dict[int, tuple[float, float]]  # min-max over seeds (Pollux: one run, so a point)
    seconds_per_epoch: dict[int, float]
    trajectories: dict[int, list[dict]]  # gradient-statistics records per batch (the run at that batch)
    notes: list[str] = field(default_factory=list)
    lr: dict[int, float] = field(default_factory=dict)  # the LR each batch trained with (tuned)
    max_lr: float | None = None  # the largest LR that reached the target anywhere in the LR sweeps
    loss_curves: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # (epochs, window training loss), each batch's own run
    optimizer_settings: dict[str, Any] = field(default_factory=dict)  # training.momentum, nesterov, betas, weight_decay, ... as trained


# -- tasks --------------------------------------------------------------------------------------------------


def pollux_task(app: pollux_traces.Application, root: Path | None = None, target_fraction: float = TARGET_FRACTION_OF_WORST_BEST) -> Task:
    runs = pollux_traces.load_runs(app, root)
    target = target_fraction * min(float(run["metric"].max()) for run in runs.values())
    epochs = {b: pollux_traces.epochs_to_target(app, b, run, target) for b, run in runs.items()}
    step_times = pollux_traces.load_step_times(app, root)
    placements = pollux_traces.packed_placements(*POLLUX_CLUSTER)
    seconds, notes = {}, []
    for batch in runs:
        best = pollux_traces.seconds_per_sample(step_times, batch, placements)
        if best is None:
            notes.append(f"batch {batch}: no measured placement runs it; left out of the regret")
            continue
        seconds[batch] = best["s_per_sample"] * app.dataset_size
    return Task(
        name=f"pollux-{app.name}", source="pollux", dataset_size=app.dataset_size, optimizer=app.optimizer,
        reference_batch=min(runs), target=f"validation top-1 >= {target:.4f}",
        epochs={b: e for b, e in epochs.items() if e is not None},
        epochs_range={b: (e, e) for b, e in epochs.items() if e is not None}, seconds_per_epoch=seconds,
        trajectories={b: pollux_traces.gradient_stats(app, b, run) for b, run in runs.items()}, notes=notes,
    )  # fmt: skip


def cpu_tasks(path: Path) -> list[Task]:
    from efficiency_tasks import as_one_run, load_ground_truth, task_from_json, task_optimizer_settings

    truth = load_ground_truth(path)
    tasks = []
    for name, task in truth["tasks"].items():
        batches = {int(b): row for b, row in task["batches"].items()}
        reached = {b: row for b, row in batches.items() if row.get("epochs") is not None and math.isfinite(row["epochs"])}
        target = task["target"]
        tasks.append(Task(
            name=name, source="cpu", dataset_size=int(task["dataset_size"]), optimizer=task["optimizer"],
            reference_batch=int(task["reference_batch"]),
            target=f"{target['metric']} {'>=' if target['higher_is_better'] else '<='} {target['value']:g}",
            epochs={b: float(row["epochs"]) for b, row in reached.items()},
            epochs_range={b: (_or_inf(row["epochs_min"]), _or_inf(row["epochs_max"])) for b, row in reached.items()},
            seconds_per_epoch={b: float(row["epoch_s"]) for b, row in reached.items()},
            trajectories={b: with_measured_headroom(name, b, int(task["reference_batch"]), as_one_run(row.get("trajectory") or [], row))
                          for b, row in batches.items()},  # fmt: skip
            notes=[f"batch {b}: did not reach the target in every seed" for b in batches if b not in reached],
            lr={b: float(row["lr"]) for b, row in batches.items()}, max_lr=_sweep_max_lr(batches.values()),
            loss_curves={b: [(r["samples"] / int(task["dataset_size"]), float(r["loss"])) for r in row.get("trajectory") or []
                             if r.get("loss") is not None] for b, row in batches.items()},
            optimizer_settings=task_optimizer_settings(task_from_json(task["task"])),
        ))  # fmt: skip
    return tasks


HEADROOM_KEY = "stability_headroom"
HEADROOM_CACHE = DEFAULT_OUT / "stability_headroom.json"  # benchmarks/stability_headroom.py: 8 points along each reference run


def attach_headroom(records: list[dict[str, Any]], points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the records, each measured headroom (with the LR it was measured at, as stability_lr) on the
    record whose samples are nearest to the point's (ties: the later record), as a user's logger puts a
    measure_stability() into its next record; two points on one record keep the more restrictive (the smaller
    headroom x LR). Points without a headroom (none measurable there) are skipped."""
    out = [dict(r) for r in records]
    if not out:
        return out
    for point in points:
        value = point.get(HEADROOM_KEY)
        if value is None:
            continue
        nearest = min(range(len(out)), key=lambda i: (abs(out[i]["samples"] - point["samples"]), -out[i]["samples"]))
        record, lr = out[nearest], float(point.get("lr") or 1.0)
        if record.get(HEADROOM_KEY) is None or float(value) * lr < record[HEADROOM_KEY] * record.get("stability_lr", 1.0):
            record[HEADROOM_KEY] = float(value)
            if point.get("lr"):
                record["stability_lr"] = lr
    return out


def with_measured_headroom(name: str, batch: int, reference_batch: int, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reference run's records with the stability headroom measured along it (HEADROOM_CACHE), the records a user's
    logger with measure_stability() writes; other batches' runs, and tasks not measured, as they are."""
    if batch != reference_batch or not HEADROOM_CACHE.exists():
        return records
    measured = json.loads(HEADROOM_CACHE.read_text())["tasks"].get(name)
    return attach_headroom(records, measured["points"]) if measured else records


def _sweep_max_lr(batches) -> float | None:
    """What a user's LR sweep finds: the largest LR that reached the target at any batch."""
    reached = [float(run["lr"]) for row in batches for run in row.get("tuning", []) if run.get("outcome") == "reached"]
    return max(reached) if reached else None


def time_to_accuracy_tasks(path: Path) -> list[Task]:
    """The two tasks of benchmarks/time_to_accuracy.py (docs/validation/results.json): MNIST-1D with cnn1d and
    digits (standardized over all images) with small_cnn, SGD, trained to a test accuracy at every batch.
    Their trajectory is that benchmark's noise probe along each batch's seed-0 run (|G|^2 and tr(Sigma) on
    fresh training samples at log-spaced epochs and at the target), taken as records on the median run's clock
    (efficiency_tasks.as_one_run)."""
    from efficiency_tasks import as_one_run

    results = json.loads(path.read_text())
    tasks = []
    for name, entry in results["tasks"].items():
        spec, truth = entry["task"], {int(b): row for b, row in entry["truth"].items()}
        reached = {b: row for b, row in truth.items() if row["reached_seeds"] == row["seeds"]}
        trajectories = {
            b: as_one_run([{"samples": int(probe["epoch"] * spec["train_samples"]), "batch": b, "grad_sqr": probe["true_grad_sq_norm"],
                             "trace_sigma": probe["trace_sigma"]} for probe in row["runs"][0].get("noise", [])], row)
            for b, row in truth.items()
        }  # fmt: skip
        tasks.append(Task(
            name=f"tta_{name}_{spec['model']}_sgd", source="cpu", dataset_size=int(spec["train_samples"]), optimizer="sgd",
            reference_batch=int(spec["reference_batch"]), target=f"test_acc >= {spec['target_acc']:g}",
            epochs={b: float(row["epochs"]) for b, row in reached.items()},
            epochs_range={b: (float(row["epochs_min"]), float(row["epochs_max"])) for b, row in reached.items()},
            seconds_per_epoch={b: float(row["epoch_s"]) for b, row in reached.items()}, trajectories=trajectories,
            notes=[f"batch {b}: did not reach the target in every seed" for b in truth if b not in reached],
            lr={b: float(row["lr"]) for b, row in truth.items()}, max_lr=_sweep_max_lr(truth.values()),
        ))  # fmt: skip
    return tasks


def _or_inf(value: float | None) -> float:
    """A seed that did not reach the target counts as infinitely many epochs."""
    return math.inf if value is None else float(value)


# -- the service's prediction ---------------------------------------------------------------------------------


def reference_spec(task: Task, reference_batch: int, records: list[dict], with_max_lr: bool = False,
                   other_runs: dict[int, float] | None = None) -> JobSpec:  # fmt: skip
    """The job a user would submit with this reference run (see the module docstring), with the optimizer settings it
    trained with (the CPU tasks'; the Pollux traces name none, so the spec's defaults); with_max_lr adds the
    reference run's LR and the LR sweep's largest as training.reference_lr and training.max_lr; other_runs (batch ->
    epochs) go as training.other_runs."""
    training = {"reference_batch": reference_batch, "reference_epochs": task.epochs[reference_batch],
                "optimizer": task.optimizer, **task.optimizer_settings, "reference_run": {"gradient_stats": records},
                "other_runs": [{"batch": b, "epochs": e} for b, e in sorted((other_runs or {}).items())]}  # fmt: skip
    if with_max_lr:
        reference_lr = task.lr[reference_batch]
        training.update(reference_lr=reference_lr, max_lr=max(task.max_lr, reference_lr))
    return JobSpec.model_validate({
        "model": "small_cnn", "dataset": {"name": "synthetic_images", "num_samples": task.dataset_size},
        "batch_sizes": [1, 2], "cluster": {"device_memory_gib": 16}, "pricing": {"kind": "gpu_hour", "price": 1.0},
        "training": training,
    })  # fmt: skip


def service_model(task: Task, reference_batch: int, with_max_lr: bool = False,
                  other_runs: dict[int, float] | None = None) -> tuple[EpochModel, dict[str, Any]]:  # fmt: skip
    records = [_contract_record(r) for r in task.trajectories[reference_batch]]
    return epoch_model(reference_spec(task, reference_batch, records, with_max_lr, other_runs), [], None)


def _contract_record(record: dict) -> dict:
    keys = ("samples", "batch", "grad_sqr", "trace_sigma", "loss", "metric", "step", "window_steps", "variability",
            "precond_grad_sqr", "precond_trace_sigma", "stability_headroom")  # fmt: skip
    return {key: record[key] for key in keys if record.get(key) is not None}


# -- alternatives the estimator was chosen from -------------------------------------------------------------


def _records_to_target(task: Task, reference_batch: int) -> tuple[list[dict], float]:
    target_samples = task.epochs[reference_batch] * task.dataset_size
    return [r for r in task.trajectories[reference_batch] if r["samples"] <= target_samples], target_samples


def _pooled(records: list[dict], statistic: str = "raw") -> float | None:
    arrays = record_arrays(records, statistic)
    return pooled_ratio(arrays["weights"], arrays["grad_sqr"], arrays["trace_sigma"]) if arrays["samples"].size else None


def read_records(task: Task, records: list[dict], target_samples: float, **options: Any) -> float | None:
    """TrajectoryNoiseScale(**options) on the statistic the service reads for the task's optimizer, the raw one
    where that is not resolved (as tula_service.fit.efficiency_evidence falls back)."""
    value = TrajectoryNoiseScale(statistic=STATISTIC_FOR_OPTIMIZER[task.optimizer], **options).fit(records, target_samples).noise_scale_
    return value if value is not None else TrajectoryNoiseScale(**options).fit(records, target_samples).noise_scale_


def prefix_name(prefix: float) -> str:
    return f"first {prefix:.0%} of the run only (pilot-like), extrapolated"


def prefix_read(task: Task, records: list[dict], target_samples: float, prefix: float) -> float | None:
    """The records up to `prefix` of the run to the target (at least two), read and extrapolated as a pilot's are."""
    early = [r for r in records if r["samples"] <= prefix * target_samples] or records[:2]
    return read_records(task, early, target_samples)


def first_record_read(task: Task, records: list[dict]) -> float | None:
    """The first record alone (the initial weights), with the optimizer's statistic where it is resolved."""
    return _pooled(records[:1], STATISTIC_FOR_OPTIMIZER[task.optimizer]) or _pooled(records[:1])


def progress_fraction_start(records: list[dict], target_samples: float, reference_batch: int, statistic: str, fraction: float) -> float | None:
    """Where, as a fraction of the samples to the target, the run had made `fraction` of its progress S_min: the
    window of the noise-scale read measured in progress rather than in samples. A record's progress per sample is
    r / b, r = |G|^2 / (|G|^2 + tr(Sigma) / b) clipped to [0, 1] (the signal share, noise_trajectory's docstring;
    0 where |G|^2 + tr(Sigma) / b is not positive), integrated by the trapezoidal rule from 0 (the first record's
    rate held back to it) to the target (the last record's held on). None when no progress is resolved."""
    arrays = record_arrays(records, statistic)
    if not arrays["samples"].size:
        arrays = record_arrays(records, "raw")
    samples, grad_sqr, trace_sigma = arrays["samples"], arrays["grad_sqr"], arrays["trace_sigma"]
    if samples.size < 2:
        return None
    squared_norm = grad_sqr + trace_sigma / reference_batch  # E|g_b|^2; a record where it is not positive made none
    signal = np.divide(grad_sqr, squared_norm, out=np.zeros_like(grad_sqr), where=squared_norm > 0)
    rate = np.clip(signal, 0.0, 1.0) / reference_batch
    xs, ys = np.concatenate([[0.0], samples, [target_samples]]), np.concatenate([[rate[0]], rate, [rate[-1]]])
    progress = np.concatenate([[0.0], np.cumsum(np.diff(xs) * (ys[1:] + ys[:-1]) / 2)])
    if progress[-1] <= 0:
        return None
    return float(np.interp(fraction * progress[-1], progress, xs) / target_samples)


def alternatives(task: Task, reference_batch: int) -> dict[str, float | None]:
    """The same records read by each alternative, with the statistic the service reads for the task's optimizer
    (preconditioned for Adam/AdamW/RMSprop; the raw one where that is not resolved, as the service falls back) unless
    the name says raw."""
    records, target_samples = _records_to_target(task, reference_batch)
    wanted = STATISTIC_FOR_OPTIMIZER[task.optimizer]
    read = lambda early=records, **options: read_records(task, early, target_samples, **options)  # noqa: E731
    half = [r for r in records if r["samples"] >= target_samples / 2]
    estimates: dict[str, float | None] = {
        "first record (initialization)": first_record_read(task, records),
        "pooled, whole run": _pooled(records, wanted) or _pooled(records),
        "pooled, second half (raw gradient)": _pooled(half),
        "pooled, 25-75% of the run": read(window=(0.25, 0.75), window_average="pooled"),
    }
    for average in ("geometric", "median", "progress"):
        for window in ((0.5, 1.0), (0.25, 1.0), (0.4, 1.0), (0.6, 1.0), (0.75, 1.0)) + (((0.0, 1.0),) if average == "progress" else ()):
            name = "progress-weighted mean" if average == "progress" else f"{average} of bins"
            estimates[f"{name}, {window[0]:.0%}-{window[1]:.0%} of the run"] = read(window=window, window_average=average)
    start = progress_fraction_start(records, target_samples, reference_batch, wanted, 0.5)
    estimates["progress-weighted mean, the second half of the progress S_min (not of the samples)"] = (
        read(window=(start, 1.0)) if start is not None else None)
    for average in ("geometric", "progress"):
        value = read(window_average=average)
        estimates[f"{average}, 50-100%, x D / (D - 1 - B) (finite-data correction applied again)"] = (
            value * task.dataset_size / (task.dataset_size - 1 - value) if value and value < task.dataset_size - 1 else None)
    for fraction in (0.25, 0.5, 0.75):
        estimates[f"power-law trend read at {fraction:.0%} of the run"] = read(run_fraction=fraction, window=None)
    for prefix in PILOT_PREFIXES:
        estimates[prefix_name(prefix)] = prefix_read(task, records, target_samples, prefix)
    if any(r.get("precond_grad_sqr") is not None for r in records):
        for statistic in ("raw", "preconditioned"):
            estimates[f"adaptive optimizers: {statistic} gradient, second half"] = TrajectoryNoiseScale(statistic=statistic).fit(records, target_samples).noise_scale_
    return estimates


# -- scores ---------------------------------------------------------------------------------------------------


def epochs_errors_pct(task: Task, predict: Callable[[float], float], reference_batch: int) -> dict[int, float]:
    return {b: 100.0 * (predict(b) / e - 1.0) for b, e in task.epochs.items() if b != reference_batch}


def median_abs(errors: dict[int, float]) -> float:
    return float(np.median(np.abs(list(errors.values())))) if errors else float("nan")


def flat_step_regret(task: Task, predict: Callable[[float], float]) -> dict[str, Any]:
    """The regret of the min-time pick on a device whose step costs the same at every batch (launch-bound steps: an
    H200 took 1.1-1.7 ms a step from batch 32 to 4096 on these models, docs/validation.md), where time to the target
    is proportional to steps = epochs x D / B: the pick rests on the epochs model at the largest batches, its
    farthest extrapolation. Every measured batch is a candidate, as no device clock limits them."""
    measured = {b: e / b for b, e in task.epochs.items()}
    predicted = {b: predict(b) / b for b in task.epochs}
    pick, best = min(predicted, key=predicted.get), min(measured, key=measured.get)
    return {"pick": pick, "best": best, "regret": measured[pick] / measured[best]}


def regret(task: Task, predict: Callable[[float], float]) -> dict[str, Any]:
    timed = [b for b in task.epochs if b in task.seconds_per_epoch]
    measured = {b: task.epochs[b] * task.seconds_per_epoch[b] for b in timed}
    predicted = {b: predict(b) * task.seconds_per_epoch[b] for b in timed}
    pick, best = min(predicted, key=predicted.get), min(measured, key=measured.get)
    return {"pick": pick, "best": best, "regret": measured[pick] / measured[best]}


def cbs_ratio(predicted: float, fitted: float) -> float:
    return max(predicted / fitted, fitted / predicted)


def truth_floor(task: Task, truth_fit: dict[str, Any]) -> dict[str, float]:
    """What the ground truth lets any B_noise reach on this code path (E_min from the reference run's epochs):
    the best single B_noise (least median |epochs error|, searched on a log grid from 1 to 10^3 x the largest
    batch) and its error; how far the reference run's own epochs sit off the curve fitted to every batch; and
    that fitted curve's own median |error| (the truth's scatter about E_min (1 + B / B_noise))."""
    ref = task.reference_batch
    grid = np.geomspace(1.0, 1e3 * max(task.epochs), 2000)
    errors = [median_abs(epochs_errors_pct(task, lambda b: float(EpochModel(ref, task.epochs[ref], g).predict(b)), ref)) for g in grid]
    best = int(np.argmin(errors))
    fitted = lambda b: truth_fit["min_epochs"] * (1 + b / truth_fit["noise_scale"])  # noqa: E731
    return {
        "best_noise_scale": float(grid[best]), "best_median_abs_epochs_err_pct": float(errors[best]),
        "reference_off_fitted_curve_pct": 100.0 * (task.epochs[ref] / fitted(ref) - 1.0),
        "fitted_curve_median_abs_epochs_err_pct": median_abs(epochs_errors_pct(task, fitted, ref)),
    }  # fmt: skip


TRAINING_LOSS_RECORDS = 3  # the reference run's training loss at its target: the mean of its last this many records
TRAINING_LOSS_MIN_BATCHES = 4


def training_loss_critical_batch(task: Task, read: float, test_critical_batch: float) -> dict[str, Any] | None:
    """A diagnostic of what a miss is made of: the critical batch of the TRAINING loss, from each batch's own run.

    L* = the mean window training loss of the reference run's last TRAINING_LOSS_RECORDS records (the loss it had at the
    test target); per batch, the epochs at which its run (seed 0 on the CPU tasks, its own clock) first had a window
    loss <= L*; E_min (1 + B / B_c) fitted to those (fit_epochs_to_runs) where TRAINING_LOSS_MIN_BATCHES or more batches
    got there. read / B_c says how far the noise scale read is from the training loss's own critical batch, and test
    B_c / training B_c how much a generalization gap (the larger batches reaching the test target only at a lower
    training loss) adds. Rough: one run per batch, window means, and a run stops at the test target, so a batch that
    reached it at a higher training loss is left out. None without loss curves (Pollux records carry no loss)."""
    reference = task.loss_curves.get(task.reference_batch) or []
    if len(reference) < TRAINING_LOSS_RECORDS:
        return None
    loss = float(np.mean([value for _, value in reference[-TRAINING_LOSS_RECORDS:]]))
    reached = {b: next(epochs for epochs, value in curve if value <= loss)
               for b, curve in sorted(task.loss_curves.items()) if any(value <= loss for _, value in curve)}  # fmt: skip
    if len(reached) < TRAINING_LOSS_MIN_BATCHES:
        return {"loss": loss, "epochs": {str(b): e for b, e in reached.items()}, "batches": len(task.loss_curves), "critical_batch": None}
    fit = fit_epochs_to_runs(list(reached), list(reached.values()))
    return {"loss": loss, "epochs": {str(b): e for b, e in reached.items()}, "batches": len(task.loss_curves),
            "critical_batch": fit["noise_scale"], "lower_bound": fit["lower_bound"], "rms_log_error": fit["rms_log_error"],
            "read_over": read / fit["noise_scale"], "test_over": test_critical_batch / fit["noise_scale"]}  # fmt: skip


def evaluate(task: Task) -> dict[str, Any]:
    ref = task.reference_batch
    model, report = service_model(task, ref)
    errors = epochs_errors_pct(task, lambda b: float(model.predict(b)), ref)
    truth_fit = fit_epochs_to_runs(list(task.epochs), list(task.epochs.values()))
    noise = report["noise_scale"]["value"]
    inside = sum(lo * 0.999 <= float(model.predict(b)) <= hi * 1.001 for b, (lo, hi) in task.epochs_range.items() if b != ref)
    result = {
        "task": task.name, "source": task.source, "optimizer": task.optimizer, "target": task.target,
        "dataset_size": task.dataset_size, "reference_batch": ref, "notes": task.notes,
        "measured_epochs": {str(b): e for b, e in sorted(task.epochs.items())},
        "measured_epochs_range": {str(b): list(r) for b, r in sorted(task.epochs_range.items())},
        "predicted_epochs": {str(b): float(model.predict(b)) for b in sorted(task.epochs)},
        "epochs_err_pct": {str(b): e for b, e in sorted(errors.items())},
        "median_abs_epochs_err_pct": median_abs(errors),
        "predictions_inside_seed_range": inside,
        "noise_scale": noise, "noise_scale_interval": report["noise_scale"]["interval"],
        "evidence": report["noise_scale"]["evidence"], "warnings": report["warnings"],
        "estimator": {k: v for k, v in report["evidence"]["candidates"][0]["detail"].items() if k != "batches"},
        "cbs_fitted_to_truth": truth_fit["noise_scale"], "cbs_fit_rms_log_error": truth_fit["rms_log_error"],
        "cbs_fit_lower_bound": truth_fit["lower_bound"],
        "cbs_ratio": cbs_ratio(noise, truth_fit["noise_scale"]),
        "truth_floor": truth_floor(task, truth_fit),
        "training_loss": training_loss_critical_batch(task, noise, truth_fit["noise_scale"]),
        "regret": regret(task, lambda b: float(model.predict(b))),
        "flat_step_regret": flat_step_regret(task, lambda b: float(model.predict(b))),
        "perfect_scaling": perfect_scaling(task, ref),
        "alternatives": {},
        "every_reference": {},
        "with_max_lr": None,
    }
    with one_more_run.held_out_calibration(task.name):  # the prior's calibration without this task
        result["one_more_run"] = one_more_run.one_more_run(
            task.epochs, ref, lambda runs: service_model(task, ref, other_runs=runs),
            lambda min_epochs, noise_scale: lambda b: min_epochs * (1 + b / noise_scale),
            lambda predict, left_out: (median_abs({b: 100.0 * (predict(b) / e - 1.0) for b, e in task.epochs.items() if b not in left_out}),
                                       regret(task, predict)["regret"]),
        )  # fmt: skip
    if task.max_lr and ref in task.lr:
        capped, capped_report = service_model(task, ref, with_max_lr=True)
        result["with_max_lr"] = {
            "reference_lr": task.lr[ref], "max_lr": task.max_lr, "max_step_gain": capped_report["max_step_gain"]["value"],
            "median_abs_epochs_err_pct": median_abs(epochs_errors_pct(task, lambda b: float(capped.predict(b)), ref)),
            "regret": regret(task, lambda b: float(capped.predict(b)))["regret"],
        }  # fmt: skip
    for name, estimate in alternatives(task, ref).items():
        if not estimate:
            result["alternatives"][name] = None
            continue
        alt = EpochModel(ref, task.epochs[ref], estimate)
        result["alternatives"][name] = {
            "noise_scale": estimate, "median_abs_epochs_err_pct": median_abs(epochs_errors_pct(task, lambda b: float(alt.predict(b)), ref)),
            "regret": regret(task, lambda b: float(alt.predict(b)))["regret"], "cbs_ratio": cbs_ratio(estimate, truth_fit["noise_scale"]),
        }  # fmt: skip
    for other in sorted(task.epochs):
        if not task.trajectories.get(other):
            continue
        other_model, other_report = service_model(task, other)
        records, target_samples = _records_to_target(task, other)
        geometric = read_records(task, records, target_samples, window_average="geometric")
        geometric_model = EpochModel(other, task.epochs[other], geometric) if geometric else None
        read = other_report["noise_scale"]["value"] if other_report["noise_scale"] else None  # None: not resolved, assumed
        result["every_reference"][str(other)] = {
            "noise_scale": read,
            "calibration_reads": calibration_reads(task, other, read),
            "median_abs_epochs_err_pct": median_abs(epochs_errors_pct(task, lambda b: float(other_model.predict(b)), other)),
            "regret": regret(task, lambda b: float(other_model.predict(b)))["regret"],
            "below_fitted_cbs": other <= truth_fit["noise_scale"],
            "geometric_of_bins_err_pct": median_abs(epochs_errors_pct(task, lambda b: float(geometric_model.predict(b)), other))
            if geometric_model else None,
        }  # fmt: skip
    return result


def _flat_cell(result: dict[str, Any]) -> str:
    flat = result.get("flat_step_regret")
    return f"{flat['pick']} ({flat['best']}), {flat['regret']:.2f}" if flat else "-"


def perfect_scaling(task: Task, ref: int) -> dict[str, Any]:
    """Perfect scaling: E(B) = E_ref at every batch (what a linear-scaling habit assumes)."""
    errors = epochs_errors_pct(task, lambda b: task.epochs[ref], ref)
    return {"median_abs_epochs_err_pct": median_abs(errors), "regret": regret(task, lambda b: task.epochs[ref])["regret"]}


def flat_step_line(results: list[dict[str, Any]]) -> str:
    """The min-time pick on a flat step clock (flat_step_regret), printed before the summary line."""
    regrets = [r["flat_step_regret"]["regret"] for r in results]
    over = sum(x > 1.10 for x in regrets)
    return f"flat_step_time: tasks={len(results)} max_regret={max(regrets):.2f} median_regret={np.median(regrets):.2f} tasks_over_1.10={over}"


def summary_line(results: list[dict[str, Any]]) -> str:
    errors = [r["median_abs_epochs_err_pct"] for r in results]
    return (
        f"statistical_efficiency: tasks={len(results)} median_epochs_err_pct={np.median(errors):.1f} "
        f"worst_task_epochs_err_pct={max(errors):.1f} max_regret={max(r['regret']['regret'] for r in results):.2f} "
        f"cbs_ratio_max={max(r['cbs_ratio'] for r in results):.2f}"
    )


# -- the Pollux applications at other targets ---------------------------------------------------------------------

POLLUX_SWEEP_FRACTIONS = (0.9, 0.95, 0.97, 0.98, 0.99, 1.0)


def pollux_target_sweep(root: Path | None = None, fractions: tuple[float, ...] = POLLUX_SWEEP_FRACTIONS) -> list[dict[str, Any]]:
    """The same runs, read with targets at other fractions of the lowest best metric (the benchmark's is 0.99): the
    service's median abs epochs error, the best any single B_noise reaches on its code path, and how far the reference
    run's epochs sit off the curve fitted to every run (truth_floor). A target reached mid-run, while the metric still
    jumps between evaluations, is a noisier truth than one reached late."""
    rows = []
    for app in pollux_traces.APPLICATIONS.values():
        for fraction in fractions:
            task = pollux_task(app, root, fraction)
            ref = task.reference_batch
            model, report = service_model(task, ref)
            floor = truth_floor(task, fit_epochs_to_runs(list(task.epochs), list(task.epochs.values())))
            rows.append({
                "task": task.name, "fraction": fraction, "reference_epochs": task.epochs[ref],
                "noise_scale": report["noise_scale"]["value"],
                "median_abs_epochs_err_pct": median_abs(epochs_errors_pct(task, lambda b: float(model.predict(b)), ref)),
                "best_median_abs_epochs_err_pct": floor["best_median_abs_epochs_err_pct"],
                "reference_off_fitted_curve_pct": floor["reference_off_fitted_curve_pct"],
            })  # fmt: skip
    return rows


SPARSE_STRIDES = (1, 2, 4, 8, 16, 32)
SPARSE_OFFSETS = 4  # thinned from each of the first 4 records (fewer where the stride is shorter)


def sparse_records(tasks: list[Task], root: Path | None = None) -> list[dict[str, Any]]:
    """Each reference run's records thinned to every k-th (k in SPARSE_STRIDES, starting at each of the first
    min(k, SPARSE_OFFSETS) records), read by the service as before: a trace with one row per evaluation, or a user's log
    written every few hundred steps, reaches an early target in a handful of records. Per task and stride the records
    left before the target and the median abs epochs error of each thinning; the Pollux applications also at every
    target of pollux_target_sweep, where a target reached early leaves few rows."""
    cases = [(task, 0.99 if task.source == "pollux" else None) for task in tasks]
    cases += [(pollux_task(app, root, fraction), fraction) for app in pollux_traces.APPLICATIONS.values()
              for fraction in POLLUX_SWEEP_FRACTIONS if fraction != TARGET_FRACTION_OF_WORST_BEST]  # fmt: skip
    rows = []
    for task, fraction in cases:
        ref = task.reference_batch
        full, target_samples = list(task.trajectories[ref]), task.epochs[ref] * task.dataset_size
        for stride in SPARSE_STRIDES:
            errors, records = [], []
            for offset in range(min(stride, SPARSE_OFFSETS)):
                task.trajectories[ref] = full[offset::stride]
                try:
                    model, _ = service_model(task, ref)
                finally:
                    task.trajectories[ref] = full
                records.append(sum(r["samples"] <= target_samples for r in full[offset::stride]))
                errors.append(median_abs(epochs_errors_pct(task, lambda b: float(model.predict(b)), ref)))
            rows.append({"task": task.name, "source": task.source, "fraction": fraction, "stride": stride,
                         "records_to_target": records, "median_abs_epochs_err_pct": errors})  # fmt: skip
    return rows


def sparse_line(rows: list[dict[str, Any]]) -> str:
    """Per stride: the median and the worst over every (task, offset) of the Pollux cases and of the CPU tasks."""
    parts = []
    for source in ("pollux", "cpu"):
        for stride in SPARSE_STRIDES:
            errors = [e for r in rows if r["stride"] == stride and (r["source"] == "pollux") == (source == "pollux")
                      for e in r["median_abs_epochs_err_pct"]]  # fmt: skip
            if errors:
                parts.append(f"{source}_k{stride}={statistics.median(errors):.1f}/{max(errors):.1f}")
    return "sparse_records: " + " ".join(parts)


def sparse_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| task | target | " + " | ".join(f"every {k}: records, err %" for k in SPARSE_STRIDES) + " |",
             "|---|---|" + "---|" * len(SPARSE_STRIDES)]  # fmt: skip
    keys = list(dict.fromkeys((r["task"], r["fraction"]) for r in rows))
    for task, fraction in keys:
        cells = []
        for stride in SPARSE_STRIDES:
            row = next(r for r in rows if (r["task"], r["fraction"], r["stride"]) == (task, fraction, stride))
            cells.append(f"{min(row['records_to_target'])}-{max(row['records_to_target'])}: "
                         + "/".join(f"{e:.0f}" for e in row["median_abs_epochs_err_pct"]))
        lines.append(f"| {task} | {'' if fraction is None else f'x{fraction:g}'} | " + " | ".join(cells) + " |")
    return lines


def target_sweep_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| task | target (x lowest best) | E_ref | B_noise read | median abs epochs err % | best single B_noise: err % | "
             "E_ref off the fitted curve % |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for row in rows:
        lines.append(f"| {row['task']} | {row['fraction']:g} | {row['reference_epochs']:.1f} | {row['noise_scale']:.4g} | "
                     f"{row['median_abs_epochs_err_pct']:.1f} | {row['best_median_abs_epochs_err_pct']:.1f} | "
                     f"{row['reference_off_fitted_curve_pct']:+.1f} |")  # fmt: skip
    return lines


# -- the calibrated interval (tula_service.fit.epochs_calibration) -------------------------------------------------

CALIBRATION_READS = {  # evidence -> (the alternative that reads as it does, None: the service's own read; in words)
    "reference_run": (None, "the reference run's records"),
    **{f"prefix@{prefix:g}": (prefix_name(prefix),
                             f"the first {prefix:.0%} of the reference run's records, extrapolated (as a pilot's or a cut-short run's are)")
       for prefix in PILOT_PREFIXES},
    "initialization": ("first record (initialization)", "the reference run's first record (the initial weights)"),
}  # fmt: skip


def calibration_reads(task: Task, reference_batch: int, service_read: float | None) -> dict[str, float | None]:
    """What each kind of evidence of CALIBRATION_READS reads from the run at `reference_batch` taken as the reference
    run: the service's own read, the prefixes, the first record."""
    records, target_samples = _records_to_target(task, reference_batch)
    reads = {"reference_run": service_read, "initialization": first_record_read(task, records)}
    reads.update({f"prefix@{prefix:g}": prefix_read(task, records, target_samples, prefix) for prefix in PILOT_PREFIXES})
    return reads


def ratios_at(measured: dict[int, float], reference_batch: int, read: float) -> dict[int, float]:
    """k_b = B_exact(b) / B_read for each measured batch but the reference (epochs_calibration.exact_noise_scale)."""
    return {b: exact_noise_scale(reference_batch, measured[reference_batch], b, e) / read for b, e in measured.items() if b != reference_batch}


def _measured(result: dict[str, Any]) -> dict[int, float]:
    return {int(b): e for b, e in result["measured_epochs"].items()}


def every_reference_ratios(result: dict[str, Any], source: str) -> list[float]:
    """The ratios k of the task's measured batches with every run of the task taken as the reference run in turn
    (its own records read as `source` reads them, its own epochs as E_ref): a user's reference run can be at any
    batch, and the read's error depends on where (on Pollux it reads 3x higher at 32x the smallest batch)."""
    measured = _measured(result)
    return [k for batch, entry in result["every_reference"].items() if (read := entry["calibration_reads"].get(source))
            for k in ratios_at(measured, int(batch), read).values()]  # fmt: skip


def calibration(results: list[dict[str, Any]], date: str) -> dict[str, Any]:
    """The factors of the calibrated interval per kind of evidence (epochs_calibration.calibration_factors over the
    ratios k of every task's measured batches to the noise scale that evidence reads, every run of the task taken as
    the reference run in turn: every_reference_ratios)."""
    evidence = {}
    for source, (_, reads) in CALIBRATION_READS.items():
        ratios = {r["task"]: ks for r in results if (ks := every_reference_ratios(r, source))}
        factors = calibration_factors(ratios)
        if factors is not None:
            factors["ratios"] = {name: [k if math.isfinite(k) else "inf" for k in ks] for name, ks in factors["ratios"].items()}
            evidence[source] = {**factors, "reads": reads, "references": "every run of each task in turn",
                                **({"coverage": float(source.split("@")[1])} if "@" in source else {})}  # fmt: skip
    scatter = run_scatter({r["task"]: r["cbs_fit_rms_log_error"] for r in results})
    return {"measured": date, "command": ".venv/bin/python benchmarks/statistical_efficiency.py", "evidence": evidence,
            **({"run_scatter": scatter} if scatter else {})}  # fmt: skip


def _inside(measured: dict[int, float], reference_batch: int, read: float, factors: list[float]) -> dict[int, bool]:
    """Per measured batch but the reference: inside the service's epochs interval (EpochModel.interval with the
    range read x factors)?"""
    model = EpochModel(reference_batch, measured[reference_batch], read, noise_scale_range=(read * factors[0], read * factors[1]))
    return {b: lo <= e <= hi for b, e in measured.items() if b != reference_batch for lo, hi in [model.interval(b)]}


def interval_coverage(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per task, left out of the calibration in turn (its factors from the other tasks, as for a held-out task): its
    measured epochs (the reference batch excluded) inside the service's epochs interval at their batch
    (EpochModel.interval with the reference run's calibrated range), with the benchmark's reference run and with
    every run as the reference in turn; and whether the best single B_noise lies inside the calibrated and inside
    the statistical interval."""
    ratios = {r["task"]: every_reference_ratios(r, "reference_run") for r in results}
    rows = []
    for r in results:
        factors = calibration_factors({name: ks for name, ks in ratios.items() if name != r["task"] and ks})
        if factors is None:
            continue
        ref, read, best = r["reference_batch"], r["noise_scale"], r["truth_floor"]["best_noise_scale"]
        measured = _measured(r)
        inside = _inside(measured, ref, read, factors["factors"])
        every = [ok for batch, entry in r["every_reference"].items() if entry["noise_scale"]
                 for ok in _inside(measured, int(batch), entry["noise_scale"], factors["factors"]).values()]  # fmt: skip
        low, high = (read * f for f in factors["factors"])
        statistical = r["noise_scale_interval"]
        rows.append({
            "task": r["task"], "factors": factors["factors"], "epochs_inside": sum(inside.values()), "epochs": len(inside),
            "outside": sorted(b for b, ok in inside.items() if not ok), "best_over_read": best / read,
            "every_reference_inside": sum(every), "every_reference_epochs": len(every),
            "noise_scale_inside": low <= best <= high,
            "statistical_inside": bool(statistical) and statistical[0] <= best <= statistical[1],
        })  # fmt: skip
    return rows


def coverage_line(rows: list[dict[str, Any]], factors: list[float] | None) -> str:
    """The calibrated interval in one line: its factors, and with each task left out in turn, the measured epochs
    inside the epochs interval (from the benchmark's reference run, and from every run as the reference in turn), and
    the best B_noise inside the statistical and the calibrated interval."""
    return (f"calibrated_interval: factors={'/'.join(f'{f:.2f}' for f in factors) if factors else 'none'} "
            f"epochs_inside_leave_one_out={sum(row['epochs_inside'] for row in rows)}/{sum(row['epochs'] for row in rows)} "
            f"every_reference={sum(row['every_reference_inside'] for row in rows)}/{sum(row['every_reference_epochs'] for row in rows)} "
            f"best_noise_scale_inside_statistical={sum(row['statistical_inside'] for row in rows)}/{len(rows)} "
            f"best_noise_scale_inside_calibrated={sum(row['noise_scale_inside'] for row in rows)}/{len(rows)}")  # fmt: skip


def calibration_table(rows: list[dict[str, Any]], calibrated: dict[str, Any]) -> list[str]:
    lines = ["| evidence | reads | tasks (batches) | factors: 10%, 90% quantiles of B_exact / read | median | batches inside, each task left out |",
             "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for source, entry in calibrated["evidence"].items():
        inside = sum(counts[0] for counts in entry["leave_one_task_out_inside"].values())
        lines.append(f"| {source} | {entry['reads']} | {entry['tasks']} ({entry['pairs']}) | {entry['factors'][0]:.2f}, "
                     f"{entry['factors'][1]:.2f} | {entry['median_ratio']:.2f} | {inside}/{entry['pairs']} |")  # fmt: skip
    lines += ["", "| task | factors without the task | measured epochs inside the epochs interval (outside at) | "
              "the same, every run as the reference in turn | best B_noise / read | best B_noise inside: statistical interval, "
              "calibrated |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for row in rows:
        outside = f" ({', '.join(map(str, row['outside']))})" if row["outside"] else ""
        lines.append(f"| {row['task']} | {row['factors'][0]:.2f}, {row['factors'][1]:.2f} | {row['epochs_inside']}/{row['epochs']}{outside} | "
                     f"{row['every_reference_inside']}/{row['every_reference_epochs']} | "
                     f"{row['best_over_read']:.2f} | {'yes' if row['statistical_inside'] else 'no'}, "
                     f"{'yes' if row['noise_scale_inside'] else 'no'} |")  # fmt: skip
    return lines


# -- momentum ablation ------------------------------------------------------------------------------------------


def ablation_lr_scale(truth_momentum: float, momentum: float) -> float:
    """The factor on the LR grid that keeps the effective LR lr / (1 - beta) of heavy-ball SGD where the ground
    truth's grid had it: (1 - momentum) / (1 - truth_momentum) (10 for plain SGD against momentum 0.9)."""
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    return (1.0 - momentum) / (1.0 - truth_momentum)


def momentum_ablation(names: list[str], momentum: float = 0.0, truth_path: Path | None = None, workers: int = 1) -> list[dict[str, Any]]:
    """Does momentum set the critical batch? Each named SGD task of benchmarks/efficiency_tasks.py trained again at
    every batch of its grid as its ground truth was (efficiency_tasks.measure_batch: LR tuned on the median of the
    tuning seeds, the grid extended past a winning edge, the same seeds, target and warm-up), with momentum `momentum` instead of
    the task's own and the LR grid moved by ablation_lr_scale. Reported per task: steps to the target
    per batch against the ground truth's, the critical batch fitted to each, and the service's B_noise read from the
    new reference run with its median |epochs error| on the new epochs. Runs in this process, or with workers > 1 in
    that many spawned processes (the largest batches first), one torch thread each (Task.momentum of a copy of each
    task); minutes per task, the GPT's tens of minutes."""
    import dataclasses

    import efficiency_tasks

    specs = [efficiency_tasks.TASKS[name] for name in names]
    not_sgd = [spec.optimizer for spec in specs if spec.optimizer != "sgd"]
    if not_sgd:
        raise ValueError(f"the momentum ablation takes SGD tasks; got optimizer(s) {not_sgd}")
    truth = {t.name: t for t in cpu_tasks(truth_path or DEFAULT_OUT / "ground_truth.json")}
    if any(spec.dataset == "stdlib_bytes" for spec in specs):
        efficiency_tasks.write_stdlib_token_file()
    jobs = []
    for name, spec in zip(names, specs):
        scaled = dataclasses.replace(spec, reference_lr=spec.reference_lr * ablation_lr_scale(spec.momentum, momentum), momentum=momentum,
                                     nesterov=spec.nesterov and momentum > 0)  # torch's Nesterov needs a momentum
        jobs += [(name, b, {"task": dataclasses.asdict(scaled), "batch": b}) for b in spec.batches]
    rows: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in names}
    if workers > 1:
        from concurrent.futures import ProcessPoolExecutor
        from multiprocessing import get_context

        with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
            futures = [(name, b, pool.submit(efficiency_tasks.measure_batch, job)) for name, b, job in sorted(jobs, key=lambda j: -j[1])]
            for name, b, future in futures:
                rows[name][b] = future.result()
    else:
        for name, b, job in jobs:
            rows[name][b] = efficiency_tasks.measure_batch(job)
    return [_ablation_result(truth[name], dict(sorted(rows[name].items())), momentum, spec.momentum) for name, spec in zip(names, specs)]


def _ablation_result(base: Task, rows: dict[int, dict[str, Any]], momentum: float, truth_momentum: float) -> dict[str, Any]:
    from efficiency_tasks import as_one_run

    reached = {b: row for b, row in rows.items() if row["epochs"] is not None and math.isfinite(row["epochs"])}
    ablated = Task(
        name=f"{base.name} (momentum {momentum:g})", source="cpu", dataset_size=base.dataset_size, optimizer="sgd",
        reference_batch=base.reference_batch, target=base.target, epochs={b: float(row["epochs"]) for b, row in reached.items()},
        epochs_range={b: (float(row["epochs_min"]), _or_inf(row["epochs_max"])) for b, row in reached.items()},
        seconds_per_epoch={}, trajectories={b: as_one_run(row["trajectory"], row) for b, row in rows.items()},
        optimizer_settings={**base.optimizer_settings, "momentum": momentum, "nesterov": bool(base.optimizer_settings.get("nesterov")) and momentum > 0},
    )  # fmt: skip
    ref = base.reference_batch
    model, report = service_model(ablated, ref)
    truth_model, truth_report = service_model(base, ref)
    steps = lambda task, b: task.epochs[b] * task.dataset_size / b  # noqa: E731
    return {
        "task": base.name, "momentum": momentum, "truth_momentum": truth_momentum,
        "steps": {str(b): steps(ablated, b) for b in sorted(ablated.epochs)},
        "truth_steps": {str(b): steps(base, b) for b in sorted(base.epochs)},
        "steps_ratio": {str(b): steps(ablated, b) / steps(base, b) for b in sorted(ablated.epochs) if b in base.epochs},
        "did_not_reach": sorted(set(rows) - set(reached)),
        "lr": {str(b): row["lr"] for b, row in sorted(rows.items())},
        "fitted_cbs": fit_epochs_to_runs(list(ablated.epochs), list(ablated.epochs.values()))["noise_scale"],
        "truth_fitted_cbs": fit_epochs_to_runs(list(base.epochs), list(base.epochs.values()))["noise_scale"],
        "noise_scale": report["noise_scale"]["value"], "truth_noise_scale": truth_report["noise_scale"]["value"],
        "median_abs_epochs_err_pct": median_abs(epochs_errors_pct(ablated, lambda b: float(model.predict(b)), ref)),
        "truth_median_abs_epochs_err_pct": median_abs(epochs_errors_pct(base, lambda b: float(truth_model.predict(b)), ref)),
    }  # fmt: skip


def ablation_summary(results: list[dict[str, Any]]) -> str:
    cells = " ".join(
        f"{r['task']}:cbs={r['fitted_cbs']:.3g}/{r['truth_fitted_cbs']:.3g},B_noise={r['noise_scale']:.3g}/{r['truth_noise_scale']:.3g},"
        f"err={r['median_abs_epochs_err_pct']:.1f}/{r['truth_median_abs_epochs_err_pct']:.1f}"
        for r in results
    )  # fmt: skip
    return f"momentum_ablation: momentum={results[0]['momentum']:g}/{results[0]['truth_momentum']:g} {cells}" if results else "momentum_ablation: no tasks"


# -- report ---------------------------------------------------------------------------------------------------


def alternatives_table(results: list[dict[str, Any]]) -> list[str]:
    names = list(dict.fromkeys(name for r in results for name in r["alternatives"]))
    lines = ["| estimator (same records) | median over tasks of median abs epochs err % | worst task % | max regret | max CBS ratio |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
    for name in names:
        scores = [r["alternatives"].get(name) for r in results]
        scores = [s for s in scores if s]
        if not scores:
            continue
        errs = [s["median_abs_epochs_err_pct"] for s in scores]
        lines.append(f"| {name} ({len(scores)} tasks) | {np.median(errs):.1f} | {max(errs):.1f} | "
                     f"{max(s['regret'] for s in scores):.2f} | {max(s['cbs_ratio'] for s in scores):.2f} |")  # fmt: skip
    return lines


def every_reference_table(results: list[dict[str, Any]]) -> str:
    runs = [v for r in results for v in r["every_reference"].values() if v["geometric_of_bins_err_pct"] is not None]
    lines = ["| reference runs | runs | service: median, mean, within 15% | geometric of bins: median, mean, within 15% |",
             "|---|---:|---:|---:|"]  # fmt: skip
    for label, chosen in (("all", runs), ("batch <= fitted CBS", [v for v in runs if v["below_fitted_cbs"]]),
                          ("batch > fitted CBS", [v for v in runs if not v["below_fitted_cbs"]])):  # fmt: skip
        if not chosen:
            continue
        cells = []
        for key in ("median_abs_epochs_err_pct", "geometric_of_bins_err_pct"):
            errors = np.array([v[key] for v in chosen])
            cells.append(f"{np.median(errors):.1f}, {errors.mean():.1f}, {np.mean(errors <= EPOCHS_TARGET_PCT):.0%}")
        lines.append(f"| {label} | {len(chosen)} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def markdown(results: list[dict[str, Any]], meta: dict[str, Any], calibrated: dict[str, Any] | None = None,
             coverage: list[dict[str, Any]] | None = None, sweep: list[dict[str, Any]] | None = None,
             sparse: list[dict[str, Any]] | None = None) -> str:  # fmt: skip
    lines = [f"Measured {meta['date']} on {meta['machine']}; ground truth: {meta['ground_truth']}.", "",
             "```sh", ".venv/bin/python benchmarks/statistical_efficiency.py", "```", "", "```", meta["summary"], "```", "",
             "| task | optimizer | target | B_ref | evidence | B_noise predicted [interval] | CBS fitted to truth | ratio | "
             "median abs epochs err % | inside seed range | min-time pick (best) | regret | flat step time: pick (best), regret | "
             "perfect scaling: err %, regret |",
             "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in results:
        low, high = r["noise_scale_interval"] or (float("nan"), float("nan"))
        lines.append(
            f"| {r['task']} | {r['optimizer']} | {r['target']} | {r['reference_batch']} | {r['evidence']} | "
            f"{r['noise_scale']:.4g} [{low:.3g}, {high:.3g}] | {r['cbs_fitted_to_truth']:.4g}"
            f"{' (lower bound)' if r['cbs_fit_lower_bound'] else ''} | {r['cbs_ratio']:.2f} | {r['median_abs_epochs_err_pct']:.1f} | "
            f"{r['predictions_inside_seed_range']}/{len(r['epochs_err_pct'])} | {r['regret']['pick']} ({r['regret']['best']}) | "
            f"{r['regret']['regret']:.2f} | {_flat_cell(r)} | "
            f"{r['perfect_scaling']['median_abs_epochs_err_pct']:.1f}, {r['perfect_scaling']['regret']:.2f} |"
        )  # fmt: skip
    if all("flat_step_regret" in r for r in results):
        lines += ["", "Flat step time: the min-time pick where a step costs the same at every batch, time ~ epochs / B "
                  "(launch-bound steps, as on the H200 in docs/validation.md): `" + flat_step_line(results) + "`."]
    lines += ["", "### Predicted vs measured epochs per batch", ""]
    for r in results:
        batches = list(r["measured_epochs"])
        lines += [f"**{r['task']}** (B_ref = {r['reference_batch']}; {r['target']})" + (f"; {'; '.join(r['notes'])}" if r["notes"] else ""), "",
                  "| batch | " + " | ".join(batches) + " |", "|---|" + "---:|" * len(batches),
                  "| measured | " + " | ".join(f"{r['measured_epochs'][b]:.2f}" for b in batches) + " |",
                  "| predicted | " + " | ".join(f"{r['predicted_epochs'][b]:.2f}" for b in batches) + " |",
                  "| error % | " + " | ".join(f"{r['epochs_err_pct'][b]:+.1f}" if b in r["epochs_err_pct"] else "ref" for b in batches) + " |",
                  ""]  # fmt: skip
    lines += ["### The estimator, chosen by measured error", "",
              "The same reference-run records, read by each alternative (raw gradient for SGD, preconditioned for "
              "Adam/AdamW/RMSprop, unless the name says raw); the service takes the progress-weighted mean over the second half of "
              "the run, and extrapolates a trend when the records stop early.", ""]  # fmt: skip
    lines += alternatives_table(results)
    lines += ["", "### The training loss's critical batch", "",
              "A diagnostic (`training_loss_critical_batch`): the critical batch of the training loss the reference run had at "
              "its target (the mean of its last records), fitted to the epochs at which each batch's own run (seed 0) first got "
              "there, against the noise scale read and against the critical batch of the test target. Rough: one run per "
              "batch, and a run stops at the test target, so a batch that reached it at a higher training loss is left out.", "",
              "| task | training loss at the target | batches that got there | CBS of the training loss (rms log) | read / it | "
              "CBS of the test target / it |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in results:
        train = r.get("training_loss")
        if not train:
            continue
        cells = (f"{train['critical_batch']:.4g}{' (lower bound)' if train['lower_bound'] else ''} ({train['rms_log_error']:.2f}) | "
                 f"{train['read_over']:.2f} | {train['test_over']:.2f}") if train["critical_batch"] else "- | - | -"  # fmt: skip
        lines.append(f"| {r['task']} | {train['loss']:.3g} | {len(train['epochs'])}/{train['batches']} | {cells} |")
    lines += ["", "### What the ground truth allows", "",
              "The best single B_noise for this code path (E_min from the reference run's epochs; searched, so an upper "
              "bound on what any estimator can reach), the reference run's epochs against the curve E_min (1 + B / B_noise) "
              "fitted to every batch, and that fitted curve's own median abs error (the truth's scatter about the form).", "",
              "| task | B_noise read | best B_noise (x read) | its median abs epochs err % | E_ref off the fitted curve % | "
              "fitted curve: median abs err %, rms log |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in results:
        floor = r["truth_floor"]
        lines.append(f"| {r['task']} | {r['noise_scale']:.4g} | {floor['best_noise_scale']:.4g} ({floor['best_noise_scale'] / r['noise_scale']:.2f}) | "
                     f"{floor['best_median_abs_epochs_err_pct']:.1f} | {floor['reference_off_fitted_curve_pct']:+.1f} | "
                     f"{floor['fitted_curve_median_abs_epochs_err_pct']:.1f}, {r['cbs_fit_rms_log_error']:.3f} |")  # fmt: skip
    if all("one_more_run" in r for r in results):
        lines += ["", "### One more run", "",
                  "The reference run's records plus the epochs measured at ONE more batch (training.other_runs, as a user "
                  "would give them), through the service's code path: E_min and B_noise fitted to the two runs jointly with "
                  "the records' read as a prior (`efficiency_evidence.from_runs`), against the same fit without the prior "
                  "(runs alone). Median abs epochs err % over the batches other than the two, and the min-time pick's regret. "
                  "The prior's spread and the run scatter come from `configs/epochs_calibration.json`, measured on these tasks, "
                  "each task scored with them computed without it (`benchmarks/one_more_run.py`, held_out_calibration).", "",
                  f"`{one_more_run.summary_line(results)}`", "", *one_more_run.table(results)]  # fmt: skip
    if calibrated and coverage:
        lines += ["", "### The calibrated interval", "",
                  "How far the B_noise read is from the one the epochs need, measured across these tasks "
                  "(`tula_service/fit/epochs_calibration.py`; the full run writes `configs/epochs_calibration.json`, which "
                  "the service reads): per measured batch, B_exact = the B_noise that makes its epochs exact on the "
                  "service's code path; the factors are the 10% and 90% quantiles of B_exact / read over all batches, with "
                  "every run of a task taken as the reference run in turn (a user's reference run can be at any batch), each "
                  "task weighing the same, per kind of evidence. With each task left out of the quantiles in turn (as a "
                  "held-out task would be): its measured epochs inside the service's epochs interval (from the reference run "
                  "of the table above, and from every run as the reference), and its best single B_noise inside the "
                  "statistical interval the reading reports and inside the calibrated one.", "",
                  f"`{coverage_line(coverage, calibrated['evidence'].get('reference_run', {}).get('factors'))}`", "",
                  *calibration_table(coverage, calibrated)]  # fmt: skip
    if sweep:
        lines += ["", "### The Pollux applications at other targets", "",
                  "The same runs with the target at other fractions of the lowest best metric (the table above uses "
                  f"{TARGET_FRACTION_OF_WORST_BEST:g}): the service's error, the best any single B_noise reaches, and the "
                  "reference run's epochs against the curve fitted to every run.", "", *target_sweep_table(sweep)]  # fmt: skip
    if sparse:
        lines += ["", "### Records far apart", "",
                  "Each reference run's records thinned to every k-th, starting at each of the first min(k, 4) records (as a trace "
                  "with a row per epoch, or a log written every few hundred steps, gives them): the records left before the "
                  "target (fewest-most) and the median abs epochs error of each thinning, through the service's code path. "
                  "The Pollux applications also at the targets of the table above. Fewer than 6 records before the target are "
                  "each a bin of their own, and two bins make the trend read at the window's middle "
                  "(tula_service/fit/perfmodel/noise_trajectory.py, item 2); where those before the target stop short of the "
                  "window's middle, the first record past it joins them (item 4: the Pollux traces go on past it).", "", f"`{sparse_line(sparse)}`", "",
                  *sparse_table(sparse)]  # fmt: skip
    lines += ["", "### training.max_lr: the step floor E_ref B / (B_ref g), g = max_lr / reference_lr (squared for Adam, AdamW and RMSprop)", "",
              "max_lr = the largest LR that reached the target anywhere in the ground truth's LR sweeps (what a user's sweep finds).", "",
              "| task | reference LR | max_lr | g | median abs epochs err %: without, with | regret: without, with |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in results:
        capped = r["with_max_lr"]
        if capped:
            lines.append(f"| {r['task']} | {capped['reference_lr']:.4g} | {capped['max_lr']:.4g} | {capped['max_step_gain']:.3g} | "
                         f"{r['median_abs_epochs_err_pct']:.1f}, {capped['median_abs_epochs_err_pct']:.1f} | "
                         f"{r['regret']['regret']:.2f}, {capped['regret']:.2f} |")  # fmt: skip
    lines += ["", "### Every batch as the reference run", "",
              "Each run of each task taken as the reference run in turn (its own records, its own epochs); median abs "
              "epochs err % over those runs, the service's estimator against the geometric mean of 8 pooled bins (the "
              "estimator before the progress-weighted mean), split by the reference batch against the critical batch "
              "fitted to the truth.", "", every_reference_table(results), "",
              "| task | " + "reference batch: median abs epochs err %, regret |", "|---|---|"]  # fmt: skip
    for r in results:
        cells = ", ".join(f"{b}: {v['median_abs_epochs_err_pct']:.1f}%, {v['regret']:.2f}" for b, v in r["every_reference"].items())
        lines.append(f"| {r['task']} | {cells} |")
    return "\n".join(lines)


def write_report(markdown_text: str, path: Path) -> None:
    text = path.read_text() if path.exists() else f"# Validation\n\n{GENERATED_START}\n{GENERATED_END}\n"
    if GENERATED_START not in text:
        text += f"\n## Statistical efficiency on tasks it was not tuned on\n\n{GENERATED_START}\n{GENERATED_END}\n"
    head, rest = text.split(GENERATED_START, 1)
    _, tail = rest.split(GENERATED_END, 1)
    path.write_text(f"{head}{GENERATED_START}\n{markdown_text}\n{GENERATED_END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="evaluate the cached ground truth into a temporary folder")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--ground-truth", type=Path, default=None, help="cached CPU ground truth (default: OUT/ground_truth.json)")
    parser.add_argument("--regenerate-ground-truth", action="store_true", help="train the CPU tasks again (about 2.5 hours with 2 workers: 15 tasks)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--traces", type=Path, default=None, help="the pollux-traces folder (default: ../shared/data/pollux-traces)")
    parser.add_argument("--momentum-ablation", nargs="*", metavar="TASK", default=None,
                        help="train the named SGD tasks again with --momentum (default: every SGD task; minutes each) and "
                             "compare with the ground truth, into OUT/momentum_ablation.json; nothing else runs")  # fmt: skip
    parser.add_argument("--momentum", type=float, default=0.0, help="the momentum of the ablation (default 0: plain SGD)")
    args = parser.parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="statistical-efficiency-")) if args.quick or args.momentum_ablation is not None else args.out
    out.mkdir(parents=True, exist_ok=True)
    truth_path = args.ground_truth or (DEFAULT_OUT / "ground_truth.json")
    if args.momentum_ablation is not None:
        from efficiency_tasks import TASKS

        names = args.momentum_ablation or [name for name, task in TASKS.items() if task.optimizer == "sgd" and task.momentum > 0]
        ablation = momentum_ablation(names, args.momentum, truth_path, args.workers)
        (out / "momentum_ablation.json").write_text(json.dumps(ablation, indent=1, default=float))
        for r in ablation:
            print(f"  {r['task']:18s} steps ratio (momentum {r['momentum']:g} / {r['truth_momentum']:g}) per batch: "
                  + " ".join(f"{b}:{v:.2f}" for b, v in r["steps_ratio"].items())
                  + (f"; did not reach at {r['did_not_reach']}" if r["did_not_reach"] else ""), file=sys.stderr)  # fmt: skip
        print(f"report: {out / 'momentum_ablation.json'}", file=sys.stderr)
        print(ablation_summary(ablation))
        return 0
    if args.regenerate_ground_truth:
        from efficiency_tasks import TASKS, generate_ground_truth

        truth_path = out / "ground_truth.json"
        generate_ground_truth(list(TASKS), args.workers, truth_path)
    tasks = [pollux_task(app, args.traces) for app in pollux_traces.APPLICATIONS.values()]
    if truth_path.exists():
        tasks += cpu_tasks(truth_path)
    if TIME_TO_ACCURACY_RESULTS.exists():
        tasks += time_to_accuracy_tasks(TIME_TO_ACCURACY_RESULTS)
    else:
        print(f"no CPU ground truth at {truth_path}: run with --regenerate-ground-truth; Pollux tasks only", file=sys.stderr)
    results = [evaluate(task) for task in tasks]
    line = summary_line(results)
    meta = {
        "date": dt.date.today().isoformat(), "machine": f"{platform.machine()} {platform.system()}",
        "ground_truth": f"Pollux traces (real GPU runs) and {truth_path.relative_to(REPO) if truth_path.is_relative_to(REPO) else truth_path}",
        "summary": line,
    }  # fmt: skip
    calibrated = calibration(results, meta["date"])
    coverage = interval_coverage(results)
    sweep = pollux_target_sweep(args.traces)
    sparse = sparse_records(tasks, args.traces)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results, "calibration": calibrated,
                                                  "interval_coverage": coverage, "pollux_target_sweep": sweep,
                                                  "sparse_records": sparse}, indent=1, default=float))  # fmt: skip
    (out / "epochs_calibration.json" if args.quick else CALIBRATION_PATH).write_text(json.dumps(calibrated, indent=1) + "\n")
    text = markdown(results, meta, calibrated, coverage, sweep, sparse)
    (out / "report.md").write_text(text)
    if not args.quick:
        write_report(text, REPO / "docs" / "validation.md")
    for r in results:
        print(f"  {r['task']:22s} evidence={r['evidence']:13s} B_noise={r['noise_scale']:9.4g} cbs_truth={r['cbs_fitted_to_truth']:9.4g} "
              f"err={r['median_abs_epochs_err_pct']:5.1f}% regret={r['regret']['regret']:.2f} "
              f"flat-step regret={r['flat_step_regret']['regret']:.2f} ({r['flat_step_regret']['pick']} vs {r['flat_step_regret']['best']})",
              file=sys.stderr)  # fmt: skip
    print(f"report: {out / 'report.md'}", file=sys.stderr)
    print(one_more_run.summary_line(results))
    print(flat_step_line(results))
    print(coverage_line(coverage, calibrated["evidence"].get("reference_run", {}).get("factors")))
    print(sparse_line(sparse))
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
