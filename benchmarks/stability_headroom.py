"""How far could the LR rise along the reference run before it is unstable, and what does capping the service's
LR advice there do to its epochs predictions? The stability headroom of the CPU tasks' reference runs.

The service advises, at a batch B, the reference LR times the AdaScale gain of its B_noise (Johnson et al. 2020;
its square root for Adam/AdamW/RMSprop; tula_service/fit/perfmodel/efficiency.py). Nothing in the gradient noise scale
says whether that LR still trains: on plain SGD the advice took 2.8x the epochs of the tuned LR at 4x the
reference batch (benchmarks/advised_lr.py). profiler/sharpness.py measures the stability headroom

    h = (2 + 2 beta) / (eta lambda_max)                      SGD, heavy-ball momentum beta (0: plain SGD)
    h = (2 + 2 beta1) / ((1 - beta1) eta lambda_max)         Adam/AdamW, lambda_max of P^(1/2) H P^(1/2) (times 1 - beta1^t,
                                                             torch's bias correction, at the coming step t)
    h = 2 / (eta lambda_max)                                 RMSprop (no momentum), of P^(1/2) H P^(1/2)

the factor by which the LR eta can grow before the top Hessian direction is unstable on a quadratic (Cohen et
al. 2021, "Gradient Descent on Neural Networks Typically Occurs at the Edge of Stability"; Cohen et al. 2022,
"Adaptive Gradient Methods at the Edge of Stability"). The service (EpochModel(lr_headroom=h)) caps its LR at h
times the reference LR and predicts the epochs of the capped step from the quadratic model of the loss along
the step (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", Sec. 2.2). It reads h as the
smallest "stability_headroom" over the second half of the reference run's gradient-stats records.

h is a lower bound on how far the LR can go, not an upper one: sharpness adapts to the LR (raise the LR and
lambda_max falls back towards the new 2 / eta, the edge of stability; a warm-up gives it time to), so an LR
above h x the reference may well train. A cap that binds makes the predictions conservative where that happens.

Measuring (the full run): per task of efficiency_tasks.TASKS, seed 0 trains at the reference batch with the
ground truth's tuned LR there, as efficiency_tasks.train_to_target trains (BatchStream seeded 10_000 + seed,
scheduled_lr, plain_step or, for a micro_batched task, accumulation_step; one torch thread), for the ground
truth's reference steps, round(epochs D / B_ref) (the median over seeds). At 1/8, 2/8, ..., 8/8 of those steps,
profiler.sharpness.stability_headroom on a fixed loss, the mean loss over the first min(2048, D) training samples
(in a forked RNG, and batch norm's running statistics restored after it, so training is unchanged; with batch norm
that loss normalizes by those samples' statistics, not by a micro-batch's as training does); recorded per point:
step, samples (step B_ref), headroom, sharpness (lambda_max), LR and the task's metric.
Tasks run in 2 spawned worker processes. Cache: docs/validation/statistical_efficiency/stability_headroom.json.

Evaluating (both modes): each measured headroom is attached to the reference trajectory record (on the median
run's clock, the records statistical_efficiency.service_model reads) whose samples are nearest to the point's
samples (ties: the later record), as a user's logger attaches it to the next record it writes. The service's
model is built as statistical_efficiency.service_model builds it (epoch_model of reference_spec with the
_contract_record-ed records), once with the key and once without; the service reads h as the smallest over the
records in the second half of the run to the target (tula_service.fit.efficiency_evidence.measured_lr_headroom:
early in a run the sharpness swings, and a cap at an early dip bound where a 4x LR trained). Per task: h, the largest AdaScale LR multiplier on the grid without
the cap, whether the cap binds (and where), predicted epochs with and without the cap against the ground
truth's tuned epochs per batch and against the epochs measured under the (uncapped) advised LR
(docs/validation/statistical_efficiency/advised_lr.json); median |error| % over batches, reference excluded.

Run:   .venv/bin/python benchmarks/stability_headroom.py                # measures (about 5-10 min, 2 workers), writes
                                                                       # docs/validation/statistical_efficiency/stability_headroom.{json,md}
       .venv/bin/python benchmarks/stability_headroom.py --quick        # evaluates the cache into a temporary folder
Last line: stability_headroom: tasks=N capped_tasks=N median_epochs_err_pct_without=X median_epochs_err_pct_with=Y
           worst_task_err_pct_without=A worst_task_err_pct_with=B   (over tasks, of the per-task median |error| against
           the tuned ground truth)
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

from tula_service.fit.efficiency_evidence import epoch_model  # noqa: E402
from tula_service.fit.perfmodel.efficiency import EpochModel  # noqa: E402

DEFAULT_CACHE = se.DEFAULT_OUT / "stability_headroom.json"
ADVISED_RUNS = se.DEFAULT_OUT / "advised_lr.json"
GROUND_TRUTH = se.DEFAULT_OUT / "ground_truth.json"
MEASUREMENTS = 8  # at 1/8, 2/8, ..., 8/8 of the reference steps
LOSS_SAMPLES = 2048  # the fixed loss: the first min(this, D) training samples
KEY = se.HEADROOM_KEY


# -- measuring ----------------------------------------------------------------------------------------------


def reference_steps(truth_task: dict[str, Any]) -> int:
    """The ground truth's steps to the target at the reference batch: round(median epochs x D / B_ref)."""
    ref = int(truth_task["reference_batch"])
    return max(1, round(float(truth_task["batches"][str(ref)]["epochs"]) * int(truth_task["dataset_size"]) / ref))


def measurement_steps(steps: int, count: int = MEASUREMENTS) -> list[int]:
    """1/count, 2/count, ..., count/count of the steps (rounded, at least step 1, no repeats)."""
    return sorted({max(1, round(i * steps / count)) for i in range(1, count + 1)})


def measure_task(job: dict[str, Any]) -> dict[str, Any]:
    """_measure_task with torch's global generator seeded as the ground truth's runs seed it (run_randomness): its dropout
    masks do not depend on the jobs its process ran before (whole-batch steps, so they are not the truth's split run's)."""
    from efficiency_tasks import run_randomness

    with run_randomness(int(job.get("seed", 0))):
        return _measure_task(job)


def _measure_task(job: dict[str, Any]) -> dict[str, Any]:
    """Train seed 0 of job["task"] at its reference batch and job["lr"] for job["steps"] steps, as
    efficiency_tasks.train_to_target does, and measure the stability headroom at measurement_steps (module
    docstring). Runs in a worker process (one torch thread)."""
    import torch
    from efficiency_tasks import (BatchStream, Task, augmentation_generator, evaluate, mean_loss, scheduled_lr, step_function, task_data,
                                  task_model, task_optimizer, training_batch)  # fmt: skip

    from profiler.sharpness import stability_headroom, training_left_as_it_was

    torch.set_num_threads(1)
    started = time.perf_counter()
    task, lr, steps, seed = Task(**job["task"]), float(job["lr"]), int(job["steps"]), int(job.get("seed", 0))
    batch = task.reference_batch
    data = task_data(task)
    model = task_model(task, seed)
    optimizer = task_optimizer(task, model, lr)
    stream = BatchStream(task.train_samples, torch.Generator().manual_seed(10_000 + seed))
    augmentation = augmentation_generator(task, seed)
    inputs, targets = data["train_x"], data["train_y"]
    n = min(LOSS_SAMPLES, task.train_samples)
    params = [p for p in model.parameters() if p.requires_grad]
    marks = set(measurement_steps(steps, int(job.get("measurements", MEASUREMENTS))))
    points: list[dict[str, Any]] = []
    outcome, measure_s = "done", 0.0
    model.train()
    for step in range(1, steps + 1):
        rows = stream.next(batch)
        for group in optimizer.param_groups:
            group["lr"] = scheduled_lr(task, batch, lr, step - 1)
        if step_function(task)(model, optimizer, *training_batch(task, data, rows, augmentation)) is None:
            outcome = "diverged"
            break
        if step not in marks:
            continue
        tick = time.perf_counter()
        with training_left_as_it_was(list(model.buffers()), torch.device("cpu")):  # batch norm's statistics, dropout's draws
            measured = stability_headroom(lambda: mean_loss(model(inputs[:n]), targets[:n]), params, optimizer)
        metric = evaluate(task, model, data)
        measure_s += time.perf_counter() - tick
        points.append({
            "step": step, "fraction": step / steps, "samples": step * batch,
            KEY: measured[KEY] if measured else None, "sharpness": measured["sharpness"] if measured else None,
            "lr": float(optimizer.param_groups[0]["lr"]), task.target_metric: metric,
        })  # fmt: skip
    return {
        "task": job["name"], "optimizer": task.optimizer, "momentum": {"sgd": task.momentum, "rmsprop": task.rmsprop_momentum}.get(task.optimizer),
        "reference_batch": batch, "lr": lr, "seed": seed, "reference_steps": steps, "loss_samples": n,
        "outcome": outcome, "points": points, "measure_s": measure_s, "wall_s": time.perf_counter() - started,
    }  # fmt: skip


def measure(names: list[str], workers: int, path: Path, truth_path: Path = GROUND_TRUTH) -> dict[str, Any]:
    """measure_task for every named task (the longest first) in `workers` spawned processes; writes and returns
    {"meta", "tasks": {name: measure_task's result}}. Tasks already in the cache at `path` and not named keep
    their measurements (meta "added" says which tasks were measured when)."""
    from efficiency_tasks import TASKS, load_ground_truth, write_stdlib_token_file

    started = time.perf_counter()
    truth = load_ground_truth(truth_path)["tasks"]
    if any(TASKS[name].dataset == "stdlib_bytes" for name in names):
        write_stdlib_token_file()
    jobs = []
    for name in names:
        entry = truth[name]
        ref = int(entry["reference_batch"])
        jobs.append({"name": name, "task": asdict(TASKS[name]), "lr": float(entry["batches"][str(ref)]["lr"]), "steps": reference_steps(entry)})
    jobs.sort(key=lambda j: -j["steps"] * j["task"]["reference_batch"] * (8 if j["task"]["model"] == "gpt" else 1))
    results: dict[str, dict[str, Any]] = {}

    def collect(result: dict[str, Any]) -> None:
        results[result["task"]] = result
        line = " ".join(f"{p['fraction']:.2f}:{p[KEY]:.3g}" if p[KEY] else f"{p['fraction']:.2f}:-" for p in result["points"])
        print(f"  [{time.perf_counter() - started:5.0f} s] {result['task']} headroom {line} ({result['wall_s']:.0f} s, "
              f"{result['outcome']})", file=sys.stderr, flush=True)  # fmt: skip

    if workers > 1:
        with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
            pending = {pool.submit(measure_task, job) for job in jobs}
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    collect(future.result())
    else:
        for job in jobs:
            collect(measure_task(job))
    import torch

    cache = {
        "meta": {
            "generated_by": "benchmarks/stability_headroom.py", "date": dt.date.today().isoformat(),
            "machine": f"{os.cpu_count()}-core {platform.machine()} CPU", "platform": platform.platform(),
            "python": sys.version.split()[0], "torch": torch.__version__, "torch_threads_per_process": 1, "workers": workers,
            "command": " ".join([".venv/bin/python", "benchmarks/stability_headroom.py", *sys.argv[1:]]),
            "measurements": MEASUREMENTS, "loss_samples": LOSS_SAMPLES, "wall_s": time.perf_counter() - started,
        },
        "tasks": {name: results[name] for name in names},
    }  # fmt: skip
    kept = json.loads(path.read_text()) if path.exists() else None
    if kept and set(kept["tasks"]) - set(names):
        added = {**cache["meta"], "tasks": names}
        cache = {"meta": {**kept["meta"], "added": [*kept["meta"].get("added", []), added]},
                 "tasks": {**kept["tasks"], **cache["tasks"]}}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cache, indent=1, default=float))
    return cache


# -- evaluating ---------------------------------------------------------------------------------------------


def headroom_models(task: se.Task, points: list[dict[str, Any]]) -> tuple[EpochModel, EpochModel, dict[str, Any]]:
    """The service's epochs model of the task's reference run without and with the measured headroom on its
    records (module docstring), and {"headroom", "headroom_evidence", "noise_scale"}: the headroom the service
    read (the smallest over the second half of the run to the target) and where it read it."""
    ref = task.reference_batch
    without_key = [{k: v for k, v in se._contract_record(r).items() if k != KEY} for r in task.trajectories[ref]]
    with_key = se.attach_headroom(without_key, points)
    plain, report = epoch_model(se.reference_spec(task, ref, without_key, False), [], None)
    capped, capped_report = epoch_model(se.reference_spec(task, ref, with_key, False), [], None)
    read = capped_report.get("lr_headroom") or {}
    noise = report["noise_scale"]["value"] if report.get("noise_scale") else None
    return plain, capped, {"headroom": read.get("value"), "headroom_evidence": read.get("evidence"), "noise_scale": noise}


def _finite(value: Any) -> float | None:
    return float(value) if value is not None and math.isfinite(float(value)) else None


def evaluate(task: se.Task, measured: dict[str, Any], advised: dict[str, Any] | None = None) -> dict[str, Any]:
    """The cap's effect on the service's predictions for one task (module docstring). advised: the task's entry
    of advised_lr.json, or None."""
    ref = task.reference_batch
    plain, capped, info = headroom_models(task, measured["points"])
    grid = sorted(set(task.lr) | set(task.epochs))
    multipliers = {b: float(plain.lr_multiplier(b)) if plain.noise_scale else 1.0 for b in grid}
    capped_multipliers = {b: float(capped.lr_multiplier(b)) if capped.noise_scale else 1.0 for b in grid}
    binds_at = [b for b in grid if capped.lr_capped(b)]
    without = {b: float(plain.predict(b)) for b in grid}
    with_cap = {b: float(capped.predict(b)) for b in grid}
    advised_epochs = {int(b): e for b, row in (advised or {}).get("batches", {}).items() if (e := _finite(row.get("epochs"))) is not None}

    def errors(truth: dict[int, float], predicted: dict[int, float]) -> dict[int, float]:
        return {b: 100.0 * (predicted[b] / e - 1.0) for b, e in truth.items() if b != ref and b in predicted}

    intervals = {b: capped.cap_interval(b) for b in binds_at if b in advised_epochs}
    inside = [b for b, (low, high) in intervals.items() if low <= advised_epochs[b] <= high]
    scores = {}
    for name, truth in (("tuned", task.epochs), ("advised", advised_epochs)):
        for label, predicted in (("without", without), ("with", with_cap)):
            err = errors(truth, predicted)
            scores[f"{name}_{label}"] = {"err_pct": {str(b): e for b, e in sorted(err.items())}, "median_abs_err_pct": se.median_abs(err) if err else None}
    return {
        "task": task.name, "optimizer": task.optimizer, "reference_batch": ref, "noise_scale": info["noise_scale"],
        "headroom": info["headroom"], "headroom_evidence": info["headroom_evidence"], "lr_cap": capped.lr_headroom,
        "headroom_points": [{k: p[k] for k in ("fraction", "step", KEY, "sharpness", "lr")} for p in measured["points"]],
        "max_lr_multiplier_uncapped": max(multipliers.values()), "binds": bool(binds_at), "binds_at": binds_at,
        "lr_multiplier_uncapped": {str(b): m for b, m in multipliers.items()},
        "lr_multiplier_capped": {str(b): m for b, m in capped_multipliers.items()},
        "tuned_lr_multiplier": {str(b): task.lr[b] / task.lr[ref] for b in grid if b in task.lr and ref in task.lr},
        "tuned_epochs": {str(b): e for b, e in sorted(task.epochs.items())},
        "advised_epochs": {str(b): e for b, e in sorted(advised_epochs.items())},
        "predicted_without": {str(b): e for b, e in without.items()}, "predicted_with": {str(b): e for b, e in with_cap.items()},
        "advised_capped_batches": sorted(intervals), "advised_inside_cap_interval": inside,
        "scores": scores,
    }  # fmt: skip


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def summary_line(results: list[dict[str, Any]]) -> str:
    without = [r["scores"]["tuned_without"]["median_abs_err_pct"] for r in results]
    with_cap = [r["scores"]["tuned_with"]["median_abs_err_pct"] for r in results]
    return (
        f"stability_headroom: tasks={len(results)} capped_tasks={sum(r['binds'] for r in results)} "
        f"median_epochs_err_pct_without={np.median(without):.1f} median_epochs_err_pct_with={np.median(with_cap):.1f} "
        f"worst_task_err_pct_without={max(without):.1f} worst_task_err_pct_with={max(with_cap):.1f} "
        f"advised_inside_cap_interval={sum(len(r['advised_inside_cap_interval']) for r in results)}/"
        f"{sum(len(r['advised_capped_batches']) for r in results)}"
    )


def markdown(results: list[dict[str, Any]], meta: dict[str, Any], line: str) -> str:
    out = [
        f"Measured {meta['date']} on a {meta['machine']} ({meta.get('platform', '')}); `{meta['command']}` "
        f"({meta['wall_s']:.0f} s; module docstring of benchmarks/stability_headroom.py).", "",
        "```", line, "```", "",
        "Headroom h: the smallest of the points in the second half of the reference run, as the service reads it (a lower bound on how far the LR can grow: "
        "sharpness adapts to the LR). Errors: median |predicted / measured - 1| over the batches, reference excluded, "
        "against the tuned ground truth and against the epochs measured under the LR the service advises (advised_lr.json: "
        "capped where the cap binds, since the runs follow the current advice). Inside: capped batches whose epochs under the "
        "advice lie in the interval the service reports, [no cost from the cap, the quadratic model's cost].", "",
        "| task | optimizer | B_noise | h | largest AdaScale LR multiplier (uncapped) | cap binds at | "
        "err % vs tuned: without / with | err % vs advised: without / with | advised inside the cap's interval |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|",
    ]  # fmt: skip
    for r in results:
        s = r["scores"]
        binds = ", ".join(str(b) for b in r["binds_at"]) if r["binds"] else "no"
        out.append(f"| {r['task']} | {r['optimizer']} | {_fmt(r['noise_scale'], '.4g')} | {_fmt(r['headroom'], '.3g')} | "
                   f"{r['max_lr_multiplier_uncapped']:.3g} | {binds} | {_fmt(s['tuned_without']['median_abs_err_pct'])} / "
                   f"{_fmt(s['tuned_with']['median_abs_err_pct'])} | {_fmt(s['advised_without']['median_abs_err_pct'])} / "
                   f"{_fmt(s['advised_with']['median_abs_err_pct'])} | "
                   f"{len(r['advised_inside_cap_interval'])}/{len(r['advised_capped_batches'])} |")  # fmt: skip
    for r in results:
        points = ", ".join(f"{p['fraction']:.3g}: {_fmt(p[KEY], '.3g')}" for p in r["headroom_points"])
        batches = list(r["predicted_without"])
        out += ["", f"**{r['task']}** (B_ref = {r['reference_batch']}; headroom at fractions of the reference run: {points})", "",
                "| batch | " + " | ".join(batches) + " |", "|---|" + "---:|" * len(batches)]  # fmt: skip
        s = r["scores"]
        rows = (
            ("LR multiplier: AdaScale", lambda b: f"{r['lr_multiplier_uncapped'][b]:.3g}"),
            ("LR multiplier: capped", lambda b: f"{r['lr_multiplier_capped'][b]:.3g}"),
            ("LR multiplier: tuned", lambda b: _fmt(r["tuned_lr_multiplier"].get(b), ".3g")),
            ("epochs, tuned LR", lambda b: _fmt(r["tuned_epochs"].get(b), ".2f")),
            ("epochs, advised LR", lambda b: _fmt(r["advised_epochs"].get(b), ".2f")),
            ("predicted without cap", lambda b: f"{r['predicted_without'][b]:.2f}"),
            ("predicted with cap", lambda b: f"{r['predicted_with'][b]:.2f}"),
            ("err % vs tuned, without", lambda b: _fmt(s["tuned_without"]["err_pct"].get(b), "+.1f")),
            ("err % vs tuned, with", lambda b: _fmt(s["tuned_with"]["err_pct"].get(b), "+.1f")),
            ("err % vs advised, without", lambda b: _fmt(s["advised_without"]["err_pct"].get(b), "+.1f")),
            ("err % vs advised, with", lambda b: _fmt(s["advised_with"]["err_pct"].get(b), "+.1f")),
        )
        out += ["| " + label + " | " + " | ".join(cell(b) for b in batches) + " |" for label, cell in rows]
    return "\n".join(out) + "\n"


def evaluate_cache(cache: dict[str, Any], truth_path: Path = GROUND_TRUTH, advised_path: Path = ADVISED_RUNS) -> list[dict[str, Any]]:
    truth = {t.name: t for t in se.cpu_tasks(truth_path)}
    advised = json.loads(advised_path.read_text())["tasks"] if advised_path.exists() else {}
    return [evaluate(truth[name], measured, advised.get(name)) for name, measured in cache["tasks"].items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="evaluate the cached measurements into a temporary folder")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="the measurements (written without --quick)")
    parser.add_argument("--out", type=Path, default=None, help="folder of the report (default: the cache's; --quick: a temporary one)")
    parser.add_argument("--tasks", nargs="+", default=None, help="efficiency_tasks.py tasks to measure (default: all)")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    if args.quick:
        if not args.cache.exists():
            raise SystemExit(f"no cached measurements at {args.cache}: run without --quick first")
        cache = json.loads(args.cache.read_text())
        out = args.out or Path(tempfile.mkdtemp(prefix="stability-headroom-"))
    else:
        from efficiency_tasks import TASKS

        cache = measure(args.tasks or list(TASKS), args.workers, args.cache)
        out = args.out or args.cache.parent
    results = evaluate_cache(cache)
    line = summary_line(results)
    out.mkdir(parents=True, exist_ok=True)
    report = out / (args.cache.stem + ".md")
    report.write_text(markdown(results, cache["meta"], line))
    if args.quick:
        (out / (args.cache.stem + "_results.json")).write_text(json.dumps(results, indent=1, default=float))
    for r in results:
        s = r["scores"]
        print(f"  {r['task']:22s} h={_fmt(r['headroom'], '6.3g')} max_mult={r['max_lr_multiplier_uncapped']:6.3g} binds={str(r['binds']):5s} "
              f"tuned {_fmt(s['tuned_without']['median_abs_err_pct'], '5.1f')}% -> {_fmt(s['tuned_with']['median_abs_err_pct'], '5.1f')}%  "
              f"advised {_fmt(s['advised_without']['median_abs_err_pct'], '5.1f')}% -> {_fmt(s['advised_with']['median_abs_err_pct'], '5.1f')}%",
              file=sys.stderr)  # fmt: skip
    print(f"report: {report}", file=sys.stderr)
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
