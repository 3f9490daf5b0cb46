"""How far the noise scale read can be from the one the epochs need: an interval calibrated on measured tasks.

The statistical interval of a noise-scale reading (the bootstrap over its bins) says how well the records pin the
read down, not how well the read predicts epochs: on the 54 tasks of benchmarks/statistical_efficiency.py the B_noise
that fits a task's measured epochs best lay inside it on 9. What does predict the epochs' error is the model's own
error measured across tasks. For each task t and each batch b it measured (the reference batch excepted), the noise
scale that makes E(b) = E_ref (1 + b / B_noise) / (1 + B_ref / B_noise) exact is

    B_exact = (b - rho B_ref) / (rho - 1),  rho = E_b / E_ref

(0 where rho is past b / B_ref, no noise scale being that small; infinite where the epochs did not move the way
any B_noise moves them), and k_tb = B_exact / B_read, with B_read what the evidence read for that task. Every run
of a task serves as the reference run in turn (its own records read, its own epochs E_ref): a user's reference run
can be at any batch, and the read's error depends on where (on Pollux it reads higher the larger the reference
batch). The calibrated interval of a new reading is

    [B_read x q_lo(k), B_read x q_hi(k)]

with q_lo and q_hi the QUANTILES of k over all (task, batch) pairs, each task weighing the same, joined with the
statistical interval. Since E(b) is monotone in B_noise, a measured batch's epochs lie inside the epochs' interval
(E(b) at the two ends, each re-anchored at the reference run: EpochModel.interval) exactly when its k lies inside the
factors: the interval is calibrated on the epochs themselves, the quantity the user plans with. The factors are
measured per kind of evidence (the reference run's records; prefixes of them covering 5%, 25%, 50% and 75% of the
run, extrapolated as a pilot's or a cut-short reference run's are, since how far the records reach sets how far off
they are; their first record, for the initial weights) and written to configs/epochs_calibration.json by `benchmarks/statistical_efficiency.py` (not
--quick), with the tasks and ratios they come from and the coverage with each task left out in turn. Nothing is
fitted per task: the same factors apply to every job, and their coverage on held-out tasks is the test of them.

The same ratios weigh a read against measured runs: noise_scale_prior turns them into a log-normal for B_noise
(centred on the read times the median ratio, its sigma from the quantiles' spread), and run_scatter says how far one
run's log epochs lie off E(B) (the median over tasks of the truth's rms scatter about the fitted curve, written to the
file as "run_scatter"); perfmodel.efficiency.fit_epochs_to_runs fits measured runs with that prior.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

CALIBRATION_PATH = Path(__file__).resolve().parents[2] / "configs" / "epochs_calibration.json"
QUANTILES = (0.1, 0.9)  # an 80% interval: the 10% and 90% quantiles of the measured ratios
MIN_TASKS = 5  # fewer tasks than this give no quantile worth the name: no calibrated interval


def exact_noise_scale(reference_batch: float, reference_epochs: float, batch: float, epochs: float) -> float:
    """B_exact: the B_noise for which E_ref (1 + b / B_noise) / (1 + B_ref / B_noise) equals the epochs measured at
    batch b (module docstring); 0 where they moved as far as the steps-bound E_ref b / B_ref or past it, inf where
    they did not move (or moved the other way)."""
    if batch == reference_batch:
        raise ValueError("the reference batch's own epochs say nothing about B_noise")
    rho = epochs / reference_epochs
    above = batch > reference_batch
    if (rho <= 1.0) if above else (rho >= 1.0):
        return math.inf
    if (rho >= batch / reference_batch) if above else (rho <= batch / reference_batch):
        return 0.0
    return (batch - rho * reference_batch) / (rho - 1.0)


def _task_weighted_quantiles(logs_by_task: dict[str, list[float]], quantiles: tuple[float, float]) -> tuple[float, float]:
    """The (low, high) quantiles of the pooled values, each task weighing the same (its values 1 / n_t each), read
    outwards so the interval is never narrower than the values say: low is the last value whose mid-point cumulative
    weight is at most q_low, high the first whose is at least q_high."""
    values = np.array([v for logs in logs_by_task.values() for v in logs])
    weights = np.array([1.0 / len(logs) for logs in logs_by_task.values() for _ in logs])
    order = np.argsort(values)
    values, weights = values[order], weights[order]
    cumulative = (np.cumsum(weights) - weights / 2) / weights.sum()
    low = max(int(np.searchsorted(cumulative, quantiles[0], side="right")) - 1, 0)
    high = min(int(np.searchsorted(cumulative, quantiles[1], side="left")), values.size - 1)
    return float(values[low]), float(values[high])


def calibration_factors(ratios: dict[str, list[float]], quantiles: tuple[float, float] = QUANTILES) -> dict[str, Any] | None:
    """{factors: [q_lo, q_hi], quantiles, tasks, pairs, median_ratio, ratios, leave_one_task_out_inside} from the ratios
    k_tb = B_exact / B_read of each task's measured batches (module docstring; 0 and inf allowed), quantiles of ln k
    with each task weighing the same; None with fewer than MIN_TASKS tasks. leave_one_task_out_inside: per task, how
    many of its k lie inside the factors computed from the other tasks (what a held-out task would see)."""
    usable = {name: [float(k) for k in ks if k is not None and not math.isnan(k) and k >= 0] for name, ks in ratios.items()}
    usable = {name: ks for name, ks in usable.items() if ks}
    if len(usable) < MIN_TASKS:
        return None
    logs = {name: [math.log(k) if k > 0 else -math.inf for k in ks] for name, ks in usable.items()}
    low, high = (math.exp(v) for v in _task_weighted_quantiles(logs, quantiles))
    median = math.exp(sum(_task_weighted_quantiles(logs, (0.5, 0.5))) / 2)
    inside = {}
    for name, ks in usable.items():
        other_low, other_high = (math.exp(v) for v in _task_weighted_quantiles({o: v for o, v in logs.items() if o != name}, quantiles))
        inside[name] = [sum(other_low <= k <= other_high for k in ks), len(ks)]
    return {
        "factors": [low, high], "quantiles": list(quantiles), "tasks": len(usable), "pairs": sum(map(len, usable.values())),
        "median_ratio": median, "ratios": usable, "leave_one_task_out_inside": inside,
    }  # fmt: skip


@lru_cache(maxsize=4)
def _load(path: str) -> dict[str, Any] | None:
    file = Path(path)
    if not file.exists():
        return None
    return json.loads(file.read_text())


def load_calibration(path: Path | str = CALIBRATION_PATH) -> dict[str, Any] | None:
    """The calibration file (read once per path), or None when there is none."""
    return _load(str(path))


def _references(entry: dict[str, Any]) -> str:
    """Which runs were the reference runs of the calibration, where it says (every run of each task, in turn)."""
    return f" ({entry['references']} as the reference run)" if entry.get("references") else ""


FULL_COVERAGE = 0.99  # records this close to the target read as a whole run (the trajectory extrapolates below it too)


def calibration_entry(evidence: dict[str, Any], source: str, coverage: float | None = None) -> tuple[str, dict[str, Any]] | None:
    """(key, entry) of the factors for a reading from `source`. Records that stop short of the target (a pilot's, or
    a reference run's cut short; `coverage` the fraction of the run to the target they reach) take the factors
    measured on prefixes of reference runs (keys "prefix@<fraction>"): those of the longest prefix they reach (one
    they do not reach: the shortest, the widest typically). Records that reach the target read as a reference run's
    whatever their source; a reference run of unknown coverage does too."""
    short = coverage is not None and coverage < FULL_COVERAGE
    if source not in ("pilot", "reference_run") or (source == "reference_run" and not short):
        return (source, evidence[source]) if source in evidence else None
    if not short and coverage is not None and "reference_run" in evidence:
        return "reference_run", evidence["reference_run"]
    prefixes = sorted(((entry["coverage"], key) for key, entry in evidence.items() if key.startswith("prefix@")))
    if not prefixes:
        return None
    reached = [key for covered, key in prefixes if coverage is not None and covered <= coverage]
    key = reached[-1] if reached else prefixes[0][1]
    return key, evidence[key]


def calibrated_interval(
    source: str, noise_scale: float | None, statistical: tuple[float, float] | list[float] | None,
    calibration: dict[str, Any] | None = None, coverage: float | None = None,
) -> dict[str, Any] | None:  # fmt: skip
    """The calibrated interval of a noise-scale reading from `source` (reference_run, pilot, initialization; coverage:
    the fraction of the run to the target its records reach): read x the factors measured for that evidence
    (calibration_entry), joined with the statistical interval; with where the factors come from. None where the
    evidence has no calibration (other_runs are fitted to measured epochs), or no noise scale."""
    calibration = load_calibration() if calibration is None else calibration
    found = calibration_entry((calibration or {}).get("evidence") or {}, source, coverage)
    if not noise_scale or not found:
        return None
    key, entry = found
    low_factor, high_factor = entry["factors"]
    low, high = noise_scale * low_factor, noise_scale * high_factor
    if statistical:  # its ends where they are wider; a lower end of 0 (within two standard errors of it) too: the steps bound
        low, high = min(low, statistical[0]), max(high, statistical[1])
    inside = sum(counts[0] for counts in entry["leave_one_task_out_inside"].values())
    return {
        "value": [float(low), float(high)], "factors": [low_factor, high_factor], "quantiles": entry["quantiles"],
        "source": "fitted", "calibration": key,
        "why": f"B_read x [{low_factor:.2g}, {high_factor:.2g}]: the {entry['quantiles'][0]:.0%} and {entry['quantiles'][1]:.0%} "
        f"quantiles, over {entry['pairs']} measured batches of {entry['tasks']} tasks{_references(entry)} (benchmarks/statistical_efficiency.py, "
        f"{calibration.get('measured', '?')}), of the B_noise that makes each batch's epochs exact over the one read from "
        f"{entry['reads']}; joined with the statistical interval. With each task left out of the quantiles in turn, "
        f"{inside} of the {entry['pairs']} batches' epochs fell inside. A candidate's epochs lie between E(B) at the two ends",
    }  # fmt: skip


def noise_scale_prior(source: str, noise_scale: float | None, calibration: dict[str, Any] | None = None,
                      coverage: float | None = None) -> dict[str, Any] | None:  # fmt: skip
    """What a noise-scale reading from `source` says about the B_noise the epochs need, as a log-normal: the measured
    ratios k = B_exact / B_read (module docstring) put ln B_noise at ln(B_read x median k) with the spread of their
    quantiles, sigma_log = ln(q_hi / q_lo) / (2 z) (z the normal quantile of QUANTILES[1]); with run_scatter_log, how
    far one run's log epochs lie off E(B) (calibration "run_scatter"). The prior of the joint fit to measured runs
    (perfmodel.efficiency.fit_epochs_to_runs); None where the reading or either calibration is missing."""
    calibration = load_calibration() if calibration is None else calibration
    found = calibration_entry((calibration or {}).get("evidence") or {}, source, coverage)
    scatter = (calibration or {}).get("run_scatter")
    if not noise_scale or not found or not scatter:
        return None
    key, entry = found
    low_factor, high_factor = entry["factors"]
    if not (0 < low_factor < high_factor < math.inf and entry["median_ratio"] > 0 and scatter["rms_log"] > 0):
        return None  # a degenerate calibration (factors that meet, 0 or infinite) weighs nothing: the runs alone decide
    z = float(NormalDist().inv_cdf(entry["quantiles"][1]))
    return {"center": noise_scale * entry["median_ratio"], "sigma_log": math.log(high_factor / low_factor) / (2 * z),
            "run_scatter_log": scatter["rms_log"], "source": source, "read": noise_scale, "calibration": key}  # fmt: skip


def run_scatter(fitted_rms_logs: dict[str, float]) -> dict[str, Any] | None:
    """How far one measured run's epochs lie off E(B) = E_min (1 + B / B_noise), in ln: the median over tasks of the rms
    ln error of the curve fitted to all of a task's batches (its truth's scatter about the form; each task's batches
    are medians over seeds, so one run scatters somewhat more). None with fewer than MIN_TASKS tasks."""
    values = [v for v in fitted_rms_logs.values() if v is not None and math.isfinite(v) and v > 0]
    if len(values) < MIN_TASKS:
        return None
    return {"rms_log": float(np.median(values)), "tasks": len(values), "per_task": dict(fitted_rms_logs)}
