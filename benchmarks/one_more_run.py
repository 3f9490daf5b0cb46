"""One more measured run: how far epochs measured at a second batch settle the epochs model (issue 13).

The gradient statistics of one reference run miss the epochs by 50-64% on four of the CPU tasks of
benchmarks/statistical_efficiency.py (momentum's and Adam's large-batch gain, which no statistic of the
gradient noise carries; docs/validation.md). The service's answer to that is evidence of another kind: epochs
to the target measured at a second batch (training.other_runs), fitted jointly with the statistics' read as a
prior (tula_service.fit.efficiency_evidence.from_runs). This measures it on the same tasks, through the same
code path: for each task, the reference run's records plus ONE more run at each measured batch b_2 (its
measured epochs, as a user would give them), and the median |epochs error| over the batches other than the
two, and the regret of the min-time pick; next to it, the runs alone (the same fit without the prior).

MULTIPLES are the second run's batch over the reference batch reported per task; ADVISED_MULTIPLE is the one the
service names when it suggests a run (efficiency_evidence.NEXT_RUN_MULTIPLE must equal it), and the summary line
is at it. The prior's factors and the run scatter come from configs/epochs_calibration.json, measured on these same
tasks; so each task is scored with them computed without it (held_out_calibration), as a held-out task would be.

The joint fit's 80% interval of the epochs (EpochModel.interval from the fit's covariance) is checked too: how many
of the other batches' measured epochs fall inside it (inside_80pct_interval, summed over the tasks).

Line (printed by benchmarks/statistical_efficiency.py before its own):
    one_more_run: at=8x tasks=N median_epochs_err_pct=X worst_task_epochs_err_pct=Y max_regret=Z
                  runs_alone_worst_task_epochs_err_pct=Y2 runs_alone_max_regret=Z2 tasks_over_15pct=K inside_80pct_interval=I/M
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np

from tula_service.fit import epochs_calibration

MULTIPLES = (2, 4, 8, 16)  # the second run's batch / the reference batch, as reported per task
ADVISED_MULTIPLE = 8  # the one the service suggests (efficiency_evidence.NEXT_RUN_MULTIPLE) and the summary line's
TARGET_PCT = 15.0

# score(predict, left_out_batches) -> (median |epochs error| % over the other batches, regret of the min-time pick)
Score = Callable[[Callable[[float], float], set[int]], tuple[float, float]]


def one_more_run(epochs: dict[int, float], reference_batch: int, service_model: Callable[[dict[int, float]], tuple[Any, dict]],
                 model_from: Callable[[float, float], Callable[[float], float]], score: Score) -> dict[str, Any]:  # fmt: skip
    """Per second batch b_2 at a multiple in MULTIPLES of the reference batch (where one was measured and reached the
    target): the service's model with that run (service_model({b_2: E(b_2)})) and the runs-alone fit (model_from
    (min_epochs, noise_scale) of the report's runs_alone), each scored over the batches other than the two."""
    rows = {}
    for multiple in MULTIPLES:
        second = reference_batch * multiple
        if second not in epochs or not math.isfinite(epochs[second]):
            continue
        model, report = service_model({second: epochs[second]})
        detail = report["evidence"]["candidates"][0]["detail"]
        alone = detail.get("runs_alone") or {"min_epochs": report["min_epochs"]["value"], "noise_scale": report["noise_scale"]["value"]}
        joint_err, joint_regret = score(lambda b: float(model.predict(b)), {reference_batch, second})
        others = [b for b in epochs if b not in (reference_batch, second) and math.isfinite(epochs[b])]
        intervals = {b: model.interval(b) for b in others}
        inside = sum(lo <= epochs[b] <= hi for b, (lo, hi) in ((b, i) for b, i in intervals.items() if i is not None))
        alone_err, alone_regret = score(model_from(alone["min_epochs"], alone["noise_scale"]), {reference_batch, second})
        rows[str(multiple)] = {
            "batch": second, "noise_scale": report["noise_scale"]["value"], "interval": report["noise_scale"]["interval"],
            "median_abs_epochs_err_pct": joint_err, "regret": joint_regret, "with_prior": "prior" in detail,
            "inside_interval": [inside, sum(i is not None for i in intervals.values())],
            "runs_alone": {"noise_scale": alone["noise_scale"], "median_abs_epochs_err_pct": alone_err, "regret": alone_regret},
        }  # fmt: skip
    return rows


@contextmanager
def held_out_calibration(task: str) -> Iterator[dict[str, Any] | None]:
    """The service reads the shipped calibration with `task` left out of it: every kind of evidence's factors and
    median ratio from the other tasks' ratios, the run scatter from the other tasks' (epochs_calibration), so a task is
    not scored with a prior that it helped to set. Yields the calibration used (None without a shipped one)."""
    shipped = epochs_calibration.load_calibration()
    if not shipped:
        yield None
        return
    evidence = {}
    for key, entry in shipped.get("evidence", {}).items():
        ratios = {name: [math.inf if k == "inf" else float(k) for k in ks] for name, ks in entry["ratios"].items() if name != task}
        factors = epochs_calibration.calibration_factors(ratios)
        if factors is not None:
            evidence[key] = {**entry, **{name: factors[name] for name in ("factors", "quantiles", "tasks", "pairs", "median_ratio")}}
    held_out = {**shipped, "evidence": evidence}
    if shipped.get("run_scatter"):
        scatter = epochs_calibration.run_scatter({name: v for name, v in shipped["run_scatter"]["per_task"].items() if name != task})
        held_out.pop("run_scatter")
        if scatter:
            held_out["run_scatter"] = scatter
    shipped_loader = epochs_calibration.load_calibration
    epochs_calibration.load_calibration = lambda path=epochs_calibration.CALIBRATION_PATH: held_out
    try:
        yield held_out
    finally:
        epochs_calibration.load_calibration = shipped_loader


def summary_line(results: list[dict[str, Any]], multiple: int = ADVISED_MULTIPLE) -> str:
    """The one_more_run line (module docstring) over the tasks that measured a batch at `multiple` x the reference."""
    rows = [r["one_more_run"][str(multiple)] for r in results if str(multiple) in (r.get("one_more_run") or {})]
    if not rows:
        return f"one_more_run: at={multiple}x tasks=0"
    errors = [row["median_abs_epochs_err_pct"] for row in rows]
    alone = [row["runs_alone"] for row in rows]
    return (f"one_more_run: at={multiple}x tasks={len(rows)} median_epochs_err_pct={np.median(errors):.1f} "
            f"worst_task_epochs_err_pct={max(errors):.1f} max_regret={max(row['regret'] for row in rows):.2f} "
            f"runs_alone_worst_task_epochs_err_pct={max(a['median_abs_epochs_err_pct'] for a in alone):.1f} "
            f"runs_alone_max_regret={max(a['regret'] for a in alone):.2f} tasks_over_15pct={sum(e > TARGET_PCT for e in errors)} "
            f"inside_80pct_interval={sum(row['inside_interval'][0] for row in rows)}/{sum(row['inside_interval'][1] for row in rows)}")  # fmt: skip


def table(results: list[dict[str, Any]]) -> list[str]:
    """Markdown: per task and multiple, the joint fit's error and regret, and the runs alone's."""
    header = "| task | reference run alone: err %, regret | " + " | ".join(f"+ run at {m}x: joint; runs alone" for m in MULTIPLES) + " |"
    lines = [header, "|---|---:|" + "---:|" * len(MULTIPLES)]
    for r in results:
        cells = []
        for multiple in MULTIPLES:
            row = (r.get("one_more_run") or {}).get(str(multiple))
            cells.append("-" if row is None else
                         f"{row['batch']}: {row['median_abs_epochs_err_pct']:.1f}%, {row['regret']:.2f}; "
                         f"{row['runs_alone']['median_abs_epochs_err_pct']:.1f}%, {row['runs_alone']['regret']:.2f}")  # fmt: skip
        lines.append(f"| {r['task']} | {r['median_abs_epochs_err_pct']:.1f}%, {r['regret']['regret']:.2f} | " + " | ".join(cells) + " |")
    medians = []
    for multiple in MULTIPLES:
        rows = [r["one_more_run"][str(multiple)] for r in results if str(multiple) in (r.get("one_more_run") or {})]
        medians.append(f"{np.median([x['median_abs_epochs_err_pct'] for x in rows]):.1f}%, worst {max(x['median_abs_epochs_err_pct'] for x in rows):.1f}%; "
                       f"{np.median([x['runs_alone']['median_abs_epochs_err_pct'] for x in rows]):.1f}%, worst "
                       f"{max(x['runs_alone']['median_abs_epochs_err_pct'] for x in rows):.1f}% ({len(rows)} tasks)" if rows else "-")  # fmt: skip
    base = [r["median_abs_epochs_err_pct"] for r in results]
    lines.append(f"| median over tasks | {np.median(base):.1f}%, worst {max(base):.1f}% | " + " | ".join(medians) + " |")
    return lines
