"""The pilot of a fine-tuning job: does starting it from the job's `initial_weights` give the epochs model the noise
scale of the user's run? (issue 13; models.initial_weights)

A user who fine-tunes and gives no reference-run statistics gets the pilot's read: training at the reference batch
from the start of the run. Until initial_weights existed the pilot started every model from a seeded random init, the
start of another run. For each fine-tuning task of the ground truth (efficiency_tasks.Task.pretrained), the job such a
user submits: the truth's reference batch, its tuned LR and measured epochs, the optimizer's settings, and
profiling.pilot on at the service's default budget (300 steps, 30 s, a record every 10 steps), in two arms:
- "initial_weights": the spec names the pretrained file, the start of the user's run;
- "random_init": it does not (what the service did before).
Each arm runs the real pilot in-process (profiler.pilot.run_pilot on tula_service.dispatch.jobs.pilot_request, one
torch thread), and the service's epochs model reads it (efficiency_evidence.epoch_model, evidence "pilot"). Reported
per arm: the pilot's B_noise against the critical batch fitted to the truth, the predicted against the measured
epochs at every batch (median |error|, the reference excluded), and the min-time pick's regret on the truth's clock,
with the reference run's own read (benchmarks/statistical_efficiency.py's evidence "reference_run") beside them.
The pilot's timing and the host decide where a 30 s pilot stops, so repeated runs differ a little.

Usage: .venv/bin/python benchmarks/fine_tuning.py [--quick] [--tasks NAME ...] [--out DIR]
(--quick: the first task, a 100-step pilot, into a temporary folder). Last line:
`fine_tuning: tasks=N median_epochs_err_pct_initial_weights=X median_epochs_err_pct_random_init=Y
max_regret_initial_weights=Z max_regret_random_init=W`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import statistical_efficiency as se  # noqa: E402
from efficiency_tasks import DEFAULT_PATH, TASKS, task_optimizer_settings  # noqa: E402
from online import job_dataset  # noqa: E402
from pretrained import PRETRAINED_DIR, pretrained_weights  # noqa: E402

from models.data_roots import DATA_ROOTS_ENV  # noqa: E402
from tula_service.dispatch.jobs import pilot_request  # noqa: E402
from tula_service.fit.efficiency_evidence import epoch_model  # noqa: E402
from tula_service.fit.perfmodel.efficiency import fit_epochs_to_runs  # noqa: E402
from tula_service.measurement import PilotMeasurement  # noqa: E402
from tula_service.spec.job_spec import JobSpec  # noqa: E402

DEFAULT_OUT = REPO / "docs" / "validation" / "fine_tuning"
ARMS = ("initial_weights", "random_init")
QUICK_PILOT_STEPS = 100


def fine_tuning_tasks(names: list[str] | None = None) -> list[str]:
    found = [name for name, task in TASKS.items() if task.pretrained is not None]
    return [name for name in found if not names or name in names]


def job_spec(name: str, truth: se.Task, arm: str, pilot_steps: int | None) -> JobSpec:
    """The job a fine-tuning user without reference-run statistics submits (module docstring)."""
    task, ref = TASKS[name], truth.reference_batch
    profiling: dict[str, Any] = {"pilot": True, "device": "cpu", "threads": 1}
    if pilot_steps is not None:
        profiling["pilot_steps"] = pilot_steps
    spec = {
        "model": task.model, "model_options": dict(task.model_options),
        "dataset": job_dataset(task),
        "batch_sizes": [ref, 2 * ref], "cluster": {"device_memory_gib": 16}, "pricing": {"kind": "gpu_hour", "price": 1.0},
        "training": {"optimizer": task.optimizer, **task_optimizer_settings(task), "reference_batch": ref,
                     "reference_lr": truth.lr[ref], "reference_epochs": truth.epochs[ref]},
        "profiling": profiling,
    }  # fmt: skip
    if arm == "initial_weights":
        spec["initial_weights"] = str(pretrained_weights(task.pretrained))
    return JobSpec.model_validate(spec)


def run_arm(name: str, truth: se.Task, arm: str, pilot_steps: int | None) -> dict[str, Any]:
    from profiler.pilot import run_pilot

    spec = job_spec(name, truth, arm, pilot_steps)
    pilot = PilotMeasurement.model_validate(run_pilot(pilot_request(spec)))
    model, report = epoch_model(spec, [], pilot)
    predict = lambda b: float(model.predict(b))  # noqa: E731
    errors = se.epochs_errors_pct(truth, predict, truth.reference_batch)
    noise = report["noise_scale"]
    return {
        "pilot_status": pilot.status, "pilot_steps": pilot.trajectory[-1].step if pilot.trajectory else 0,  # its last record's
        "pilot_stopped_by": pilot.stopped_by, "first_loss": pilot.trajectory[0].loss if pilot.trajectory else None,
        "evidence": noise["evidence"] if noise else None, "noise_scale": noise["value"] if noise else None,
        "predicted_epochs": {str(b): predict(b) for b in sorted(truth.epochs)},
        "epochs_err_pct": {str(b): e for b, e in sorted(errors.items())},
        "median_abs_epochs_err_pct": se.median_abs(errors), "regret": se.regret(truth, predict),
    }  # fmt: skip


def evaluate(name: str, truth: se.Task, pilot_steps: int | None) -> dict[str, Any]:
    fitted = fit_epochs_to_runs(list(truth.epochs), list(truth.epochs.values()))["noise_scale"]
    reference_model, reference_report = se.service_model(truth, truth.reference_batch)
    reference_predict = lambda b: float(reference_model.predict(b))  # noqa: E731
    result = {
        "task": name, "pretrained": TASKS[name].pretrained, "optimizer": truth.optimizer, "target": truth.target,
        "reference_batch": truth.reference_batch, "measured_epochs": {str(b): e for b, e in sorted(truth.epochs.items())},
        "cbs_fitted_to_truth": fitted,
        "reference_run": {"noise_scale": reference_report["noise_scale"]["value"],
                          "median_abs_epochs_err_pct": se.median_abs(se.epochs_errors_pct(truth, reference_predict, truth.reference_batch)),
                          "regret": se.regret(truth, reference_predict)},
    }  # fmt: skip
    for arm in ARMS:
        result[arm] = run_arm(name, truth, arm, pilot_steps)
        read = result[arm]["noise_scale"]
        result[arm]["cbs_ratio"] = se.cbs_ratio(read, fitted) if read else None
    return result


def summary_line(results: list[dict[str, Any]]) -> str:
    def median(arm: str) -> float:
        return statistics.median(r[arm]["median_abs_epochs_err_pct"] for r in results)

    def worst_regret(arm: str) -> float:
        return max(r[arm]["regret"]["regret"] for r in results)

    return (f"fine_tuning: tasks={len(results)} median_epochs_err_pct_initial_weights={median('initial_weights'):.1f} "
            f"median_epochs_err_pct_random_init={median('random_init'):.1f} "
            f"max_regret_initial_weights={worst_regret('initial_weights'):.2f} max_regret_random_init={worst_regret('random_init'):.2f}")  # fmt: skip


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# The pilot of a fine-tuning job: from its initial weights or from a random init",
        "",
        f"Generated by `benchmarks/fine_tuning.py` on {meta['date']} ({meta['host']}). The pilot is the service's, at its "
        "default budget; the truth is `docs/validation/statistical_efficiency/ground_truth.json`.",
        "",
        "| task | critical batch (truth) | arm | first loss | pilot steps | B_noise read | ratio | median abs epochs error | regret (pick) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        reference = r["reference_run"]
        lines.append(f"| {r['task']} | {r['cbs_fitted_to_truth']:.0f} | reference run (its own statistics) | | | "
                     f"{reference['noise_scale']:.0f} | {se.cbs_ratio(reference['noise_scale'], r['cbs_fitted_to_truth']):.2f} | "
                     f"{reference['median_abs_epochs_err_pct']:.1f}% | {reference['regret']['regret']:.2f} ({reference['regret']['pick']}) |")  # fmt: skip
        for arm in ARMS:
            a = r[arm]
            read = f"{a['noise_scale']:.0f}" if a["noise_scale"] else "-"
            ratio = f"{a['cbs_ratio']:.2f}" if a["cbs_ratio"] else "-"
            lines.append(f"| {r['task']} | | pilot, {arm.replace('_', ' ')} | {a['first_loss']:.3f} | {a['pilot_steps']} | {read} | {ratio} | "
                         f"{a['median_abs_epochs_err_pct']:.1f}% | {a['regret']['regret']:.2f} ({a['regret']['pick']}) |")  # fmt: skip
    lines += ["", "`" + summary_line(results) + "`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the first task, a 100-step pilot, into a temporary folder")
    parser.add_argument("--tasks", nargs="*", help="fine-tuning tasks of the ground truth (default: all)")
    parser.add_argument("--truth", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    names = fine_tuning_tasks(args.tasks)
    truths = {t.name: t for t in se.cpu_tasks(args.truth) if t.name in names}
    names = [name for name in names if name in truths]
    if not names:
        raise SystemExit(f"no fine-tuning task in {args.truth}: generate one with benchmarks/efficiency_tasks.py --add")
    if args.quick:
        names = names[:1]
    out = Path(tempfile.mkdtemp(prefix="fine_tuning-")) if args.quick else (args.out or DEFAULT_OUT)
    given = os.environ.get(DATA_ROOTS_ENV)
    roots = [r for r in (given or "").split(os.pathsep) if r]
    os.environ[DATA_ROOTS_ENV] = os.pathsep.join([*roots, str(PRETRAINED_DIR)])  # the spec's initial_weights lie here
    results = []
    try:
        for name in names:
            result = evaluate(name, truths[name], QUICK_PILOT_STEPS if args.quick else None)
            results.append(result)
            print(f"{name}: " + ", ".join(f"{arm} B_noise {result[arm]['noise_scale'] or 0:.0f} "
                                          f"{result[arm]['median_abs_epochs_err_pct']:.1f}% regret {result[arm]['regret']['regret']:.2f}"
                                          for arm in ARMS) + f"; truth {result['cbs_fitted_to_truth']:.0f}", flush=True)  # fmt: skip
    finally:  # as it was (main also runs inside the tests' process)
        if given is None:
            os.environ.pop(DATA_ROOTS_ENV, None)
        else:
            os.environ[DATA_ROOTS_ENV] = given
    meta = {"date": dt.date.today().isoformat(), "host": platform.node() or "?", "quick": args.quick}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    (out / "report.md").write_text(markdown(results, meta))
    print(f"wrote {out}")
    print(summary_line(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
