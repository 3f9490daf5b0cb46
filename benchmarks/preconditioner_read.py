"""Which preconditioner the precond pair weighs the gradients by, and what that does to the noise scale the service
reads (issue 13: the statistics of adaptive optimizers).

The precond pair (precond_grad_sqr, precond_trace_sigma) is the two-batch estimate for P g, P the adaptive optimizer's
diag(1 / (sqrt(v) + eps)) (profiler.preconditioner). Two readings of P:

- before the step: v as the optimizer's state holds it between backward() and step(). The user's logger
  (profiler.reference_logger) and the pilot read this until 2026-12-07;
- the step's: v with the step's own gradient folded in, as torch's step folds it before it divides
  (v' = beta2 v + (1 - beta2) g^2; Adamax u' = max(beta2 u, |g| + eps); profiler.preconditioner.coming_step_denominators).
  This is what the step divides by, what the cached ground truth's trajectories hold (benchmarks/efficiency_tasks.py
  reads P right after the step), and what the logger and the pilot read now.

They differ where a coordinate's second moment is far below its gradient now: a unit that had no gradient so far
(ReLU), whose v is still 0, counts at 1 / eps = 1e8 before the step.

Per adaptive task of efficiency_tasks.TASKS: seed 0 trains at its reference batch and tuned LR (the cached ground
truth's, exactly as it trained: efficiency_tasks.trained_lr, not the 6 digits the truth stores) for the steps its cached trajectory has (seed 0's run to the target), each step as efficiency_tasks.accumulation_step (MICRO_BATCHES
micro-batches, one torch thread), and every step's precond pair is estimated with both readings of P. The records
(efficiency_tasks.trajectory_records' windows) go through the service's reader
(statistical_efficiency.read_records: tula_service.fit.trajectory), once per reading. Reported: both reads, their
ratio, the largest per-record B_simple of each, and whether the step's reading reproduces the cached ground truth's
read (within 1%: runs are deterministic on one machine).

Last line: `preconditioner_read: tasks=N median_ratio=X max_ratio=Y min_ratio=Z reproduced=K/N` (ratio: the read with
P before the step over the read with the step's P).

Run:  .venv/bin/python benchmarks/preconditioner_read.py [--quick] [--tasks NAME ...] [--workers 2]
      --quick: two tasks, its report in a temporary folder. Full (about 4 minutes, 2 workers):
      docs/validation/statistical_efficiency/preconditioner_read.md.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import efficiency_tasks as et  # noqa: E402
from tula_service.fit.efficiency_evidence import STATISTIC_FOR_OPTIMIZER  # noqa: E402

OUT = REPO / "docs" / "validation" / "statistical_efficiency" / "preconditioner_read.md"
QUICK_TASKS = ("digits_mlp_adamax", "digits_cnn_adam")
ADAPTIVE = {name for name, statistic in STATISTIC_FOR_OPTIMIZER.items() if statistic == "preconditioned"}  # the service reads P g
READINGS = ("before", "step")
REPRODUCED_WITHIN = 0.01


def measure_task(job: dict[str, Any]) -> dict[str, Any]:
    """_measure_task with dropout's masks drawn as the ground truth's seed-0 run drew them (et.run_randomness)."""
    with et.run_randomness(0):
        return _measure_task(job)


def _measure_task(job: dict[str, Any]) -> dict[str, Any]:
    """Train seed 0 of job["task"] for job["steps"] steps at job["lr"], each step's precond pair with both readings of
    P; returns per-step statistics and the evaluations (module docstring). Runs in a worker process."""
    import torch

    from profiler.gradstats import two_batch_estimates
    from profiler.preconditioner import preconditioner

    torch.set_num_threads(1)
    task, lr, steps = et.Task(**job["task"]), float(job["lr"]), int(job["steps"])
    batch, k = task.reference_batch, et.micro_batches(task.reference_batch)
    data, model = et.task_data(task), et.task_model(task, 0)
    optimizer = et.task_optimizer(task, model, lr)
    params = [p for p in model.parameters() if p.requires_grad]
    stream = et.BatchStream(task.train_samples, torch.Generator().manual_seed(10_000))
    augmentation = et.augmentation_generator(task, 0)
    eval_every = max(1, round(task.train_samples / batch / et.EVALS_PER_EPOCH))
    per_step: dict[str, list[dict[str, float]]] = {reading: [] for reading in READINGS}
    evaluations: dict[int, float] = {}
    model.train()
    for step in range(steps):
        rows = stream.next(batch)
        for group in optimizer.param_groups:
            group["lr"] = et.scheduled_lr(task, batch, lr, step)
        micro, losses = [], []
        inputs, targets = et.training_batch(task, data, rows, augmentation)
        for x, y in zip(inputs.chunk(k), targets.chunk(k)):
            loss = et.mean_loss(model(x), y)
            micro.append(et.flat(torch.autograd.grad(loss, params)))
            losses.append(float(loss.detach()))
        stacked = torch.stack(micro)
        full = stacked.mean(0)
        before = preconditioner(optimizer, params)
        offset = 0
        for p in params:
            p.grad = full[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        optimizer.step()
        common = {"loss": float(sum(losses) / k), "grad_norm": float(full.norm())}
        common["grad_sqr"], common["trace_sigma"] = two_batch_estimates((stacked * stacked).sum(1).tolist(), float(full @ full), batch // k, batch)
        for reading, scale in (("before", before), ("step", preconditioner(optimizer, params))):
            row = dict(common)
            if scale is not None:
                scaled, scaled_full = stacked * scale, full * scale
                row["precond_grad_sqr"], row["precond_trace_sigma"] = two_batch_estimates(
                    (scaled * scaled).sum(1).tolist(), float(scaled_full @ scaled_full), batch // k, batch
                )
            per_step[reading].append(row)
        if (step + 1) % eval_every == 0:
            evaluations[step + 1] = et.evaluate(task, model, data)
    return {"task": job["name"], "per_step": per_step, "evaluations": evaluations, "eval_every": eval_every}


def _records(per_step: list[dict[str, float]], evaluations: dict[int, float], batch: int, eval_every: int) -> list[dict[str, Any]]:
    """efficiency_tasks.trajectory_records, each window's precond pair averaged over the steps that have one (P before
    the first step is none)."""
    keys = ("precond_grad_sqr", "precond_trace_sigma")
    filled = [{**row, **{key: math.nan for key in keys if key not in row}} for row in per_step]
    records = et.trajectory_records(filled, evaluations, batch, eval_every)
    window = records[0]["window_steps"]
    for index, record in enumerate(records):
        rows = [row for row in per_step[index * window : index * window + record["window_steps"]] if keys[0] in row]
        for key in keys:
            record[key] = statistics.fmean(row[key] for row in rows) if rows else None
    return records


def evaluate(result: dict[str, Any], truth: dict[str, Any]) -> dict[str, Any]:
    """Both readings through the service's reader, the largest per-record B_simple of each, and the cached truth's read."""
    import statistical_efficiency as se

    task = et.TASKS[result["task"]]
    batch = task.reference_batch
    reference = truth["batches"][str(batch)]
    target_samples = reference["epochs"] * truth["dataset_size"]
    evaluations = {int(step): value for step, value in result["evaluations"].items()}
    reader = SimpleNamespace(optimizer=task.optimizer)
    row: dict[str, Any] = {"task": result["task"], "optimizer": task.optimizer}
    for reading in READINGS:
        records = [r for r in _records(result["per_step"][reading], evaluations, batch, result["eval_every"]) if r["samples"] <= target_samples]
        row[f"read_{reading}"] = se.read_records(reader, records, target_samples)
        ratios = [r["precond_trace_sigma"] / r["precond_grad_sqr"] for r in records if r["precond_grad_sqr"]]
        row[f"largest_record_{reading}"] = max((abs(x) for x in ratios), default=None)
    stored = [r for r in reference["trajectory"] if r["samples"] <= target_samples]
    row["read_truth"] = se.read_records(reader, stored, target_samples)
    row["ratio"] = row["read_before"] / row["read_step"] if row["read_before"] and row["read_step"] else None
    row["reproduced"] = bool(row["read_truth"] and row["read_step"] and abs(row["read_step"] / row["read_truth"] - 1) <= REPRODUCED_WITHIN)
    return row


def summary_line(rows: list[dict[str, Any]]) -> str:
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    return (f"preconditioner_read: tasks={len(rows)} median_ratio={statistics.median(ratios):.2f} max_ratio={max(ratios):.1f} "
            f"min_ratio={min(ratios):.2f} reproduced={sum(r['reproduced'] for r in rows)}/{len(rows)}")  # fmt: skip


def markdown(rows: list[dict[str, Any]], line: str, command: str, wall_s: float) -> str:
    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.4g}"

    lines = [
        "# Which P the precond pair weighs by (benchmarks/preconditioner_read.py)", "",
        f"Measured {time.strftime('%Y-%m-%d')} on a 2-core x86_64 CPU in {wall_s:.0f} s: `{command}`", "",
        "The reference run of every adaptive task (seed 0, its tuned LR), each step's precond pair estimated with P read from "
        "the optimizer's state before the step (the user's logger and the pilot until 2026-12-07) and with the P the step "
        "divides by (its gradient folded in: the ground truth's, and the logger's and the pilot's now), read by the "
        "service's reader over the run to the target.", "",
        "```", line, "```", "",
        "| task | optimizer | read, P before the step | read, the step's P | ratio | largest record's B, before | largest record's B, step's | cached truth's read | reproduced |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['task']} | {r['optimizer']} | {fmt(r['read_before'])} | {fmt(r['read_step'])} | {fmt(r['ratio'])} | "
                     f"{fmt(r['largest_record_before'])} | {fmt(r['largest_record_step'])} | {fmt(r['read_truth'])} | {'yes' if r['reproduced'] else 'no'} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_TASKS)}; the report in a temporary folder")
    parser.add_argument("--tasks", nargs="+", default=None, help="efficiency_tasks.py tasks (default: every adaptive one)")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    truth = et.load_ground_truth(et.DEFAULT_PATH)["tasks"]
    names = args.tasks or (list(QUICK_TASKS) if args.quick else [n for n, t in et.TASKS.items() if t.optimizer in ADAPTIVE and n in truth])
    unknown = [n for n in names if n not in truth or et.TASKS[n].optimizer not in ADAPTIVE]
    if unknown:
        raise SystemExit(f"not an adaptive task of the cached ground truth: {', '.join(unknown)}")
    started = time.perf_counter()
    jobs = []
    for name in names:
        task, reference = et.TASKS[name], truth[name]["batches"][str(et.TASKS[name].reference_batch)]
        steps = int(reference["trajectory"][-1]["step"])  # seed 0's own run to the target, as its trajectory has it
        jobs.append({"name": name, "task": asdict(task), "lr": et.trained_lr(task, task.reference_batch, reference), "steps": steps})
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=get_context("spawn")) as pool:
        results = list(pool.map(measure_task, jobs))
    rows = [evaluate(result, truth[result["task"]]) for result in results]
    line = summary_line(rows)
    for r in rows:
        print(f"  {r['task']:28s} before {r['read_before']:10.4g}  step's {r['read_step']:8.4g}  ratio {r['ratio']:8.3g}  truth {r['read_truth']:8.4g}", file=sys.stderr)
    out = Path(tempfile.mkdtemp(prefix="tula-preconditioner-read-")) / OUT.name if args.quick else OUT
    command = ".venv/bin/python benchmarks/preconditioner_read.py" + (" --quick" if args.quick else "") + (f" --tasks {' '.join(args.tasks)}" if args.tasks else "")
    out.write_text(markdown(rows, line, command, time.perf_counter() - started))
    print(f"report: {out}", file=sys.stderr)
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
