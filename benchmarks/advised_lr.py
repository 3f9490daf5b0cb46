"""Does the service's advice deliver the epochs it predicts? The CPU tasks trained at the LR the service advises.

benchmarks/statistical_efficiency.py compares the service's epochs E(B) = E_min (1 + B / B_noise) with a ground
truth whose LR was tuned at every batch (benchmarks/efficiency_tasks.py). The service does not tell a user to
tune: at a batch B it advises the reference LR times its LR rule's multiplier, the AdaScale gain of its own
B_noise (Johnson et al. 2020), r(k) = (1 + B_noise / B_ref) / (1 + B_noise / (k B_ref)), k = B / B_ref (its
square root for Adam/AdamW/RMSprop; tula_service/fit/perfmodel/efficiency.py). The Pollux traces were trained that way
(AdaScale in every run). So there are two questions, and this benchmark answers the second:
1. with the LR tuned at every batch, how many epochs does B take (statistical_efficiency.py)?
2. with the LR the service advises, how many does it take, and what does the advice cost against tuning?

Per CPU task of efficiency_tasks.py: the service reads the reference run's records exactly as
statistical_efficiency.py does (seed 0's trajectory on the median run's clock, the reference epochs), and its
EpochModel gives the advised LR multiplier at every batch of the grid. The reference LR is the ground truth's
tuned LR at the reference batch. Each batch then trains Task.seeds seeds at that LR, with no tuning and
everything else as the ground truth trained it (efficiency_tasks.train_to_target: the same batches, warm-up,
evaluations, target and max_epochs). A seed that misses the target counts as infinitely slow; the epochs are
the median over seeds. Seconds per epoch are the ground truth's (a step costs the same at any LR).

Reported per task: predicted against measured epochs under the advice (median |error|, reference excluded),
the critical batch fitted to those epochs against the service's B_noise, and the cost of the advice: at each
batch, the epochs under the advice over the epochs with the tuned LR; the service's min-time pick (on its
predicted epochs) measured under the advice against the best time under the advice, and against the best
time with tuned LRs (what a user who tunes every batch could reach).

Run:   .venv/bin/python benchmarks/advised_lr.py                 # trains (about 10 min, 2 workers), writes
                                                                # docs/validation/statistical_efficiency/advised_lr.json
       .venv/bin/python benchmarks/advised_lr.py --quick         # evaluates the cached runs into a temporary folder
Last line: advised_lr: tasks=N median_epochs_err_pct=X worst_task_epochs_err_pct=Y max_regret=Z max_regret_vs_tuned=W
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import statistical_efficiency as se  # noqa: E402

from tula_service.fit.perfmodel.efficiency import fit_epochs_to_runs  # noqa: E402

DEFAULT_RUNS = se.DEFAULT_OUT / "advised_lr.json"
STALE_TOLERANCE = 0.01  # the service now advises an LR this far from the one the cached runs trained at: retrain


def advised_lrs(task: se.Task) -> tuple[dict[int, float], dict[str, Any]]:
    """The LR the service advises at every batch of the task's grid: the tuned reference LR times the
    EpochModel's LR multiplier (the AdaScale gain of its B_noise; sqrt for Adam/AdamW/RMSprop). Also the model's
    B_noise and evidence, for the report."""
    ref = task.reference_batch
    model, report = se.service_model(task, ref)
    batches = sorted(set(task.lr) | set(task.epochs))
    multipliers = {b: model.lr_multiplier(b) for b in batches}
    if any(m is None for m in multipliers.values()):
        raise ValueError(f"{task.name}: the service read no noise scale, so it advises no LR rule to test")
    return {b: task.lr[ref] * float(m) for b, m in multipliers.items()}, {
        "noise_scale": report["noise_scale"]["value"], "evidence": report["noise_scale"]["evidence"],
        "multipliers": {str(b): float(m) for b, m in multipliers.items()},
    }  # fmt: skip


def _train(job: dict[str, Any]) -> dict[str, Any]:
    from efficiency_tasks import train_to_target

    result = train_to_target(job)
    return {k: result[k] for k in ("batch", "lr", "seed", "outcome", "reached", "steps", "epochs", "final_metric")}


def train_advised(names: list[str], workers: int, path: Path) -> dict[str, Any]:
    """Train every (task, batch, seed) of the named efficiency_tasks tasks at the advised LR; write and return
    {"meta", "tasks": {name: {"advice": ..., "batches": {B: summary and runs}}}}. The cached runs of the tasks not
    named are kept (each task's entry says when it was trained)."""
    from efficiency_tasks import TASKS, summarize_runs, write_stdlib_token_file

    started = time.perf_counter()
    truth = {t.name: t for t in se.cpu_tasks(se.DEFAULT_OUT / "ground_truth.json")}
    if any(TASKS[name].dataset == "stdlib_bytes" for name in names):
        write_stdlib_token_file()
    jobs, advice = [], {}
    for name in names:
        lrs, advice[name] = advised_lrs(truth[name])
        spec = asdict(TASKS[name])
        jobs += [{"name": name, "task": spec, "batch": b, "lr": lr, "seed": seed} for b, lr in lrs.items() for seed in range(TASKS[name].seeds)]
    jobs.sort(key=lambda j: (j["task"]["model"] != "gpt", -j["batch"]))
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {name: {} for name in names}
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        pending = {pool.submit(_train, job): job for job in jobs}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                job = pending.pop(future)
                runs[job["name"]].setdefault(job["batch"], []).append(future.result())
    tasks = {}
    for name in names:
        batches = {}
        for b, rows in sorted(runs[name].items()):
            rows.sort(key=lambda r: r["seed"])
            batches[str(b)] = {**summarize_runs([{**r, "lr_multiplier": advice[name]["multipliers"][str(b)]} for r in rows]), "runs": rows}
        tasks[name] = {"advice": advice[name], "batches": batches, "trained": dt.date.today().isoformat()}
        line = " ".join(f"{b}:{row['epochs']:.3g}" for b, row in batches.items())
        print(f"  [{time.perf_counter() - started:5.0f} s] {name} epochs under the advice: {line}", file=sys.stderr, flush=True)
    kept = json.loads(path.read_text())["tasks"] if path.exists() else {}
    result = {
        "meta": {"generated_by": "benchmarks/advised_lr.py", "date": dt.date.today().isoformat(),
                 "machine": f"{os.cpu_count()}-core {platform.machine()} CPU", "workers": workers,
                 "wall_s": time.perf_counter() - started, "trained_this_time": names},
        "tasks": {**kept, **tasks},
    }  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, separators=(",", ":"), default=float))
    return result


def _epochs(row: dict[str, Any]) -> float | None:
    value = row.get("epochs")
    return float(value) if value is not None and math.isfinite(value) else None


def evaluate(task: se.Task, advised: dict[str, Any]) -> dict[str, Any]:
    """The service's prediction against the epochs under its own advice, and the advice's cost (module docstring)."""
    ref = task.reference_batch
    model, report = se.service_model(task, ref)
    trained = {int(b): m for b, m in advised["advice"]["multipliers"].items()}
    trained_lr = {int(b): row["lr"] for b, row in advised["batches"].items() if row.get("lr")}
    off = lambda now, then: abs(now / then - 1.0) > STALE_TOLERANCE  # noqa: E731
    now = {b: float(model.lr_multiplier(b)) for b in trained}
    # another multiplier (the estimator changed), or another LR (the truth's tuned reference LR changed)
    stale = sorted(b for b, m in trained.items() if off(now[b], m) or (b in trained_lr and off(task.lr[ref] * now[b], trained_lr[b])))
    measured = {int(b): e for b, row in advised["batches"].items() if (e := _epochs(row)) is not None}
    missed = sorted(int(b) for b, row in advised["batches"].items() if _epochs(row) is None)
    reference_epochs = measured.get(ref)
    errors = {b: 100.0 * (float(model.predict(b)) / e - 1.0) for b, e in measured.items() if b != ref}
    fit = fit_epochs_to_runs(list(measured), list(measured.values())) if len(measured) >= 3 else None
    seconds = task.seconds_per_epoch
    timed = [b for b in measured if b in seconds]
    advice_s = {b: measured[b] * seconds[b] for b in timed}
    tuned_s = {b: task.epochs[b] * seconds[b] for b in task.epochs if b in seconds}
    predicted_s = {b: float(model.predict(b)) * seconds[b] for b in timed}
    pick = min(predicted_s, key=predicted_s.get) if predicted_s else None
    return {
        "task": task.name, "optimizer": task.optimizer, "reference_batch": ref, "noise_scale": report["noise_scale"]["value"],
        "stale_advice_at": stale,
        "lr_multiplier": advised["advice"]["multipliers"], "tuned_lr_multiplier": {str(b): task.lr[b] / task.lr[ref] for b in sorted(task.lr)},
        "measured_epochs": {str(b): e for b, e in sorted(measured.items())}, "did_not_reach": missed,
        "reference_epochs": {"advised_lr_runs": reference_epochs, "ground_truth": task.epochs[ref]},
        "tuned_epochs": {str(b): e for b, e in sorted(task.epochs.items())},
        "predicted_epochs": {str(b): float(model.predict(b)) for b in sorted(measured)},
        "epochs_err_pct": {str(b): e for b, e in sorted(errors.items())},
        "median_abs_epochs_err_pct": se.median_abs(errors),
        "cbs_fitted": fit["noise_scale"] if fit else None,
        "cbs_ratio": se.cbs_ratio(report["noise_scale"]["value"], fit["noise_scale"]) if fit else None,
        "advice_over_tuned_epochs": {str(b): measured[b] / task.epochs[b] for b in sorted(measured) if b in task.epochs},
        "pick": pick, "best_under_advice": min(advice_s, key=advice_s.get) if advice_s else None,
        "best_tuned": min(tuned_s, key=tuned_s.get) if tuned_s else None,
        "regret": advice_s[pick] / min(advice_s.values()) if pick is not None else None,
        "regret_vs_tuned": advice_s[pick] / min(tuned_s.values()) if pick is not None and tuned_s else None,
    }  # fmt: skip


def summary_line(results: list[dict[str, Any]]) -> str:
    errors = [r["median_abs_epochs_err_pct"] for r in results]
    return (
        f"advised_lr: tasks={len(results)} median_epochs_err_pct={np.median(errors):.1f} worst_task_epochs_err_pct={max(errors):.1f} "
        f"max_regret={max(r['regret'] for r in results):.2f} max_regret_vs_tuned={max(r['regret_vs_tuned'] for r in results):.2f}"
    )


def markdown(results: list[dict[str, Any]], meta: dict[str, Any], line: str) -> str:
    out = [
        f"Measured {meta['date']} on a {meta['machine']}; `.venv/bin/python benchmarks/advised_lr.py` (module docstring).", "",
        "```", line, "```", "",
        "| task | optimizer | B_noise read | CBS fitted to the epochs under the advice (ratio) | median abs epochs err %, advised LR | "
        "min-time pick (best under the advice, best tuned) | regret under the advice | regret against tuned LRs |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for r in results:
        cbs = f"{r['cbs_fitted']:.4g} ({r['cbs_ratio']:.2f})" if r["cbs_fitted"] else "-"
        out.append(f"| {r['task']} | {r['optimizer']} | {r['noise_scale']:.4g} | {cbs} | {r['median_abs_epochs_err_pct']:.1f} | "
                   f"{r['pick']} ({r['best_under_advice']}, {r['best_tuned']}) | {r['regret']:.2f} | {r['regret_vs_tuned']:.2f} |")  # fmt: skip
    for r in results:
        batches = list(r["measured_epochs"])
        out += ["", f"**{r['task']}** (B_ref = {r['reference_batch']}; reference epochs {r['reference_epochs']['advised_lr_runs']:.3g} "
                    f"in these runs, {r['reference_epochs']['ground_truth']:.3g} in the ground truth)"
                    + (f"; did not reach the target at {r['did_not_reach']}" if r["did_not_reach"] else ""), "",
                "| batch | " + " | ".join(batches) + " |", "|---|" + "---:|" * len(batches)]  # fmt: skip
        rows = (
            ("LR multiplier: advised", lambda b: f"{r['lr_multiplier'][b]:.3g}"),
            ("LR multiplier: tuned", lambda b: f"{r['tuned_lr_multiplier'].get(b, float('nan')):.3g}"),
            ("epochs under the advice", lambda b: f"{r['measured_epochs'][b]:.2f}"),
            ("epochs, tuned LR", lambda b: f"{r['tuned_epochs'][b]:.2f}" if b in r["tuned_epochs"] else "-"),
            ("predicted", lambda b: f"{r['predicted_epochs'][b]:.2f}"),
            ("error % (advised)", lambda b: f"{r['epochs_err_pct'][b]:+.1f}" if b in r["epochs_err_pct"] else "ref"),
        )
        out += ["| " + label + " | " + " | ".join(cell(b) for b in batches) + " |" for label, cell in rows]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="evaluate the cached runs into a temporary folder")
    parser.add_argument("--runs", type=Path, default=DEFAULT_RUNS, help="cached runs under the advised LR")
    parser.add_argument("--tasks", nargs="+", default=None, help="efficiency_tasks.py tasks to train (default: all)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="folder of the report (default: the runs' folder; --quick: a temporary one)")
    args = parser.parse_args(argv)
    out = args.out or (Path(tempfile.mkdtemp(prefix="advised-lr-")) if args.quick else args.runs.parent)
    if args.quick:
        if not args.runs.exists():
            raise SystemExit(f"no cached runs at {args.runs}: run without --quick first")
        runs = json.loads(args.runs.read_text())
    else:
        from efficiency_tasks import TASKS

        runs = train_advised(args.tasks or list(TASKS), args.workers, args.runs)
    truth = {t.name: t for t in se.cpu_tasks(se.DEFAULT_OUT / "ground_truth.json")}
    results = [evaluate(truth[name], advised) for name, advised in runs["tasks"].items()]
    line = summary_line(results)
    (out / "advised_lr_results.json").write_text(json.dumps(results, indent=1, default=float))
    (out / "advised_lr.md").write_text(markdown(results, runs["meta"], line))
    for r in results:
        if r["stale_advice_at"]:
            print(f"  {r['task']}: the service now advises another LR at batches {r['stale_advice_at']} than these runs "
                  "trained at (its estimator or the ground truth's reference run changed since): train again without --quick", file=sys.stderr)
        print(f"  {r['task']:22s} B_noise={r['noise_scale']:8.4g} cbs_advised={r['cbs_fitted'] or float('nan'):8.4g} "
              f"err={r['median_abs_epochs_err_pct']:5.1f}% regret={r['regret']:.2f} vs_tuned={r['regret_vs_tuned']:.2f}", file=sys.stderr)  # fmt: skip
    print(f"report: {out / 'advised_lr.md'}", file=sys.stderr)
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
