"""The Pollux (OSDI'21) traces in ../shared/data/pollux-traces/ as plain data: training runs and step times.

See that folder's README. Per application:
- `validation-<B>.csv`: one training run at global batch B, a row per evaluation: iteration (steps at B),
  metric (validation accuracy), grad_sqr (|G|^2) and grad_var (tr(Sigma) normalized to the application's
  smallest batch B_init, so tr(Sigma) = grad_var x B_init and B_noise = grad_var x B_init / grad_sqr).
- `placements.csv`: seconds per optimizer step per placement (GPUs per node, e.g. "4444") and per-GPU batch.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "pollux-traces"


@dataclass(frozen=True)
class Application:
    name: str
    dataset_size: int
    initial_batch: int  # B_init: grad_var is normalized to it
    optimizer: str


APPLICATIONS = {
    "cifar10": Application("cifar10", 50_000, 128, "sgd"),
    "imagenet": Application("imagenet", 1_281_167, 200, "sgd"),
}


def traces_folder(root: Path | None = None) -> Path:
    return Path(root) if root else TRACES


def load_runs(app: Application, root: Path | None = None) -> dict[int, dict[str, np.ndarray]]:
    """{global batch: columns of its validation-<B>.csv as float arrays}, by batch."""
    runs = {}
    for path in sorted((traces_folder(root) / app.name).glob("validation-*.csv")):
        batch = int(re.fullmatch(r"validation-(\d+)\.csv", path.name).group(1))
        with path.open() as handle:
            rows = list(csv.DictReader(handle))
        runs[batch] = {key: np.array([float(row[key]) for row in rows]) for key in rows[0]}
    return dict(sorted(runs.items()))


def gradient_stats(app: Application, batch: int, run: dict[str, np.ndarray]) -> list[dict]:
    """A run's rows as the service's gradient-statistics records (the format of profiler.reference_logger):
    samples = iteration x B, grad_sqr = |G|^2, trace_sigma = grad_var x B_init."""
    return [
        {"samples": int(iteration * batch), "batch": batch, "grad_sqr": float(grad_sqr),
         "trace_sigma": float(grad_var * app.initial_batch), "metric": float(metric), "step": int(iteration)}
        for iteration, grad_sqr, grad_var, metric in zip(run["iteration"], run["grad_sqr"], run["grad_var"], run["metric"])
    ]  # fmt: skip


def epochs_to_target(app: Application, batch: int, run: dict[str, np.ndarray], target: float) -> float | None:
    """Epochs at the first evaluation whose metric reaches the target (None when none does)."""
    reached = np.nonzero(run["metric"] >= target)[0]
    return float(run["iteration"][reached[0]] * batch / app.dataset_size) if reached.size else None


def load_step_times(app: Application, root: Path | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{placement: (per-GPU batches, seconds per step)}, sorted by batch."""
    table: dict[str, list[tuple[float, float]]] = {}
    with (traces_folder(root) / app.name / "placements.csv").open() as handle:
        for row in csv.DictReader(handle):
            table.setdefault(row["placement"], []).append((float(row["local_bsz"]), float(row["step_time"])))
    result = {}
    for placement, rows in table.items():
        rows.sort()
        result[placement] = (np.array([r[0] for r in rows]), np.array([r[1] for r in rows]))
    return result


def packed_placements(nodes: int, gpus_per_node: int) -> list[str]:
    """Placements that fill nodes first: "1", "2", ..., "4", "44", ... up to nodes x gpus_per_node."""
    placements = [str(g) for g in range(1, gpus_per_node + 1)]
    placements += [str(gpus_per_node) * n for n in range(2, nodes + 1)]
    return placements


def seconds_per_sample(step_times: dict[str, tuple[np.ndarray, np.ndarray]], global_batch: int, placements: list[str]) -> dict:
    """The fastest measured way to run `global_batch` on the placements: per-GPU batch B / (n a) inside the
    measured range (log-log interpolation of the step time between measured batches), with a accumulation
    steps costing a x that step (conservative: it ignores the all-reduce saved on the first a - 1)."""
    best = None
    for placement in placements:
        if placement not in step_times:
            continue
        gpus = sum(int(digit) for digit in placement)
        batches, seconds = step_times[placement]
        for accumulation in (1, 2, 4, 8, 16, 32):
            local = global_batch / (gpus * accumulation)
            if not batches.min() <= local <= batches.max():
                continue
            step_s = accumulation * float(np.exp(np.interp(np.log(local), np.log(batches), np.log(seconds))))
            candidate = {"placement": placement, "accumulation": accumulation, "step_s": step_s, "s_per_sample": step_s / global_batch}
            if best is None or candidate["s_per_sample"] < best["s_per_sample"]:
                best = candidate
    return best


def load_placement_rows(app: Application, root: Path | None = None) -> list[dict]:
    """placements.csv as rows {placement: "22", local_bsz, step_time_s, sync_time_s}, in file order
    (sync_time_s: the seconds of gradient synchronization not hidden behind the backward pass)."""
    with (traces_folder(root) / app.name / "placements.csv").open() as handle:
        return [
            {"placement": row["placement"], "local_bsz": float(row["local_bsz"]),
             "step_time_s": float(row["step_time"]), "sync_time_s": float(row["sync_time"])}
            for row in csv.DictReader(handle)
        ]  # fmt: skip
