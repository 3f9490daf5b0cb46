"""Are Tula's recommendations right? Time to a target test accuracy, measured at every batch size, against
what the service predicts and picks for the same job on this machine (1 device).

Ground truth, per task and global batch B of the grid (one device, no accumulation):
- SGD with momentum 0.9 from scratch until the test accuracy reaches the target (checked EVALS_PER_EPOCH
  times per epoch; the last batch of an epoch is partial, as with a DataLoader without drop_last), or
  until max_epochs (then the batch "did not reach" the target: infinite time).
- Learning rate tuned per batch by benchmarks/efficiency_tasks.py's rule (its tune_lr and confirmed_runs):
  LR_MULTIPLIERS x lr_ref sqrt(B / B_ref) (square-root scaling, the rule that was stable at every batch
  here; linear scaling diverged at B / B_ref >= 32) on a grid spaced by sqrt 2, with a linear warm-up from
  lr_ref over WARMUP_EPOCHS when B > B_ref. A candidate scores the median steps to the target over seeds
  0..TUNING_SEEDS-1 (at a fixed batch a step costs the same at any LR, so steps, unlike wall time on a shared
  machine, decide without noise; a tie keeps the earlier multiplier); a run stops once it has taken as many
  steps as the best median so far. The grid goes on past a winning edge until the best is more than
  LR_LOOKAHEAD steps inside; where that moved the winner, both are trained on every seed and the one with
  fewer median epochs stands (runner_up: the other). The remaining seeds then train at the chosen LR. A seed
  changes the initialization and the batch order, never the data. Seeds per task: Task.seeds (8).
  (Until 2026-12-05 the LR was tuned on seed 0 alone over x0.5, 1, 2 with no extension: the MNIST-1D task's
  batches 64-1024 all won at the grid's top LR and its reference batch was slower than both neighbours,
  the signs of an LR left short of its optimum; docs/validation.md.)
- Recorded: epochs (samples seen / train set), steps, and the run's training wall time (evaluation
  excluded; one torch thread). The median over seeds is "the" measured value.
- Time to the target = measured epochs x measured seconds per epoch, the latter timed afterwards for
  all batches of a task together: EPOCH_TIMING_ROUNDS rounds, each training one epoch at every batch
  (the order rotates), median per batch. The runs themselves take minutes apart on a shared machine
  whose speed drifts by 20-40% between them (their own wall times are kept as wall_s and shown next to
  it); timing every batch in the same rounds makes the comparison between batches, which is what the
  regret is, fair. Steps to the target do not depend on the machine at all.
- Gradient noise scale along the way (seed 0 at the chosen LR): B_simple = tr(Sigma) / |G|^2 with the
  two-batch estimator of `profiler.gradstats` on fresh training samples at epochs 0, 1/8, 1/4, ... and
  when the target is reached (outside the timed region; model buffers and RNG untouched).

The service's prediction: a real `tula serve` (local executor, SQLite file, OMP_NUM_THREADS=1 as for
the ground truth) profiles the same model and data at the partial grid and, as a second job, at the
full grid, on the CPU, for a one-device cluster. Each job is given one reference run: reference_batch
B_ref with the measured median epochs to the target at B_ref (and its tuned LR). The min-time plan comes
with the job; the knee is asked for through POST /v1/jobs/{id}/plan. Each job is also re-planned (POST /plan,
no profiling) with training.max_lr = the largest LR that reached the target in the seed-0 LR sweep at any
batch (what a user's LR sweep finds): the ceiling on LR that the noise-scale model does not know about.
The pick is then trained with the plan's own LR and warm-up (training_advice) to check the advice itself.

Reported per task: predicted vs measured epochs, step time and total time per batch (error, %); regret =
measured time of the recommended batch / best measured time (target <= 1.10); speedup of the
recommendation over two habits (the largest batch that fits, and 32); partial vs full search (profiling
time, chosen batches, and the ratio of their measured times); the noise scale the profiler measured, the
one measured during training, and the one the measured epochs imply (E(B) = E_min (1 + B / B_noise),
least squares on log epochs).

Run:  .venv/bin/python benchmarks/time_to_accuracy.py [--quick] [--tasks mnist1d digits] [--seeds N] [--profile-time-cap-s S]
          [--workers 1] [--out docs/validation] [--render]
(--render: no runs; re-analyze OUT/results.json and write the report again.)
Out:  OUT/results.json, OUT/time_to_accuracy.png, and (unless --quick) the generated part of docs/validation.md.
Last line:  time_to_accuracy: tasks=N regret=X speedup_vs_largest=Y speedup_vs_default=Z epochs_err_pct=E
(X the worst min-time regret over tasks; Y, Z, E medians over tasks; E is each task's median |error| of
predicted epochs over the grid's batches other than B_ref, where it is exact by construction.)
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
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from efficiency_tasks import LR_LOOKAHEAD, LR_MULTIPLIERS, TUNING_SEEDS, confirmed_runs, sqrt_scaled_lr, tune_lr  # noqa: E402
from live_server import api_server  # noqa: E402
from offline_data import SERVICE_DATASET_FIELDS, data_shape, load_data  # noqa: E402
from profiler.gradstats import two_batch_estimates  # noqa: E402
from tula_service.units import GIB  # noqa: E402

MOMENTUM = 0.9
WARMUP_EPOCHS = 1.0
EVALS_PER_EPOCH = 8
EPOCH_TIMING_ROUNDS = 5
NOISE_PROBE_EPOCHS = (0.0, 0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256)
NOISE_MICRO_BATCH = 128
NOISE_MICRO_BATCHES = 4
NOISE_DRAWS = 4
REGRET_TARGET = 1.10
DEFAULT_HABIT_BATCH = 32
GENERATED_START = "<!-- generated by benchmarks/time_to_accuracy.py: start -->"
GENERATED_END = "<!-- generated by benchmarks/time_to_accuracy.py: end -->"


@dataclass(frozen=True)
class Task:
    dataset: str
    model: str
    train_samples: int
    test_samples: int
    target_acc: float
    batches: tuple[int, ...]  # the ground-truth grid and the full search
    partial_batches: tuple[int, ...]  # the partial search
    max_epochs: int
    reference_batch: int = 32
    reference_lr: float = 0.02
    seeds: int = 8  # ground-truth seeds per batch (--seeds overrides), TUNING_SEEDS of them tune the LR


def powers_of_two(low: int, high: int) -> tuple[int, ...]:
    return tuple(2**e for e in range(int(math.log2(low)), int(math.log2(high)) + 1))


TASKS = {
    "mnist1d": Task("mnist1d", "cnn1d", 20_000, 4_000, 0.96, powers_of_two(16, 4096), (16, 64, 256, 1024, 4096), max_epochs=200),
    "digits": Task("digits", "small_cnn", 1_437, 360, 0.98, powers_of_two(16, 1024), (16, 64, 256, 1024), max_epochs=300),
}


# -- one training run to the target -------------------------------------------------------------------


def evaluate(model: torch.nn.Module, data: dict[str, torch.Tensor]) -> float:
    model.eval()
    with torch.no_grad():
        logits = model(data["test_x"])
    model.train()
    return float((logits.argmax(1) == data["test_y"]).float().mean()) if torch.isfinite(logits).all() else 0.0


def noise_probe(model: torch.nn.Module, data: dict[str, torch.Tensor], generator: torch.Generator, micro_batch: int = NOISE_MICRO_BATCH,
                micro_batches: int = NOISE_MICRO_BATCHES, draws: int = NOISE_DRAWS, loss_fn: Any = F.cross_entropy) -> dict[str, float]:  # fmt: skip
    """|G|^2, tr(Sigma) and B_simple at the model's current weights (McCandlish et al. 2018, App. A.1):
    `draws` draws of micro_batches x micro_batch fresh training samples, each split into its micro-batches for
    `two_batch_estimates`; the two estimates are averaged over draws, then divided. The weights, batch norm's running
    statistics and the global RNG are left as they were (a generator seeded alike draws the same samples again)."""
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    big = micro_batch * micro_batches
    true_sq, trace = [], []
    with torch.random.fork_rng(devices=[]):
        for _ in range(draws):
            rows = torch.randperm(len(data["train_y"]), generator=generator)[:big]
            micro = []
            for part in rows.split(micro_batch):
                loss = loss_fn(model(data["train_x"][part]), data["train_y"][part])
                micro.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
            full = torch.stack(micro).mean(0)
            g2, s = two_batch_estimates([float(m @ m) for m in micro], float(full @ full), micro_batch, big)
            true_sq.append(g2)
            trace.append(s)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    g2, s = float(np.mean(true_sq)), float(np.mean(trace))
    return {"true_grad_sq_norm": g2, "trace_sigma": s, "noise_scale": s / g2 if g2 > 0 and s > 0 else None}


def sgd_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: dict[str, torch.Tensor], rows: torch.Tensor, lr: float) -> bool:
    """One SGD step on the training rows at this LR; False (and no update) when the loss is not finite."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = F.cross_entropy(model(data["train_x"][rows]), data["train_y"][rows])
    if not torch.isfinite(loss):
        return False
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return True


def train_to_target(run: dict[str, Any]) -> dict[str, Any]:
    """Train one (task, batch, lr, seed) until the target test accuracy; see the module docstring."""
    from models.zoo import build_model

    torch.set_num_threads(1)
    task = Task(**run["task"])
    batch, lr, seed = run["batch"], run["lr"], run["seed"]
    data = load_data(task.dataset, task.train_samples, task.test_samples)
    if batch > task.train_samples:
        raise ValueError(f"batch {batch} is larger than the {task.dataset} training set ({task.train_samples})")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(task.model, **data_shape(task.dataset))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    k = batch / task.reference_batch
    steps_per_epoch = math.ceil(task.train_samples / batch)
    warmup = math.ceil(run.get("warmup_epochs", WARMUP_EPOCHS) * steps_per_epoch) if k > 1 else 0
    eval_every = max(1, round(steps_per_epoch / EVALS_PER_EPOCH))
    order_generator = torch.Generator().manual_seed(10_000 + seed)
    probe_generator = torch.Generator().manual_seed(20_000 + seed)
    probes = list(NOISE_PROBE_EPOCHS) if run.get("probe_noise") else []
    noise: list[dict[str, Any]] = []
    if probes and probes[0] == 0.0:
        noise.append({"epoch": 0.0, "test_acc": evaluate(model, data), **noise_probe(model, data, probe_generator)})
        probes.pop(0)
    prune_after_steps = run.get("prune_after_steps")
    train_s, samples, step, accuracy, outcome = 0.0, 0, 0, 0.0, "max_epochs"
    curve: list[tuple[float, float]] = []
    model.train()
    while step < task.max_epochs * steps_per_epoch:
        index = step % steps_per_epoch
        if index == 0:
            order = torch.randperm(task.train_samples, generator=order_generator)
        started = time.perf_counter()
        current_lr = lr * (1 / k + (1 - 1 / k) * step / warmup) if step < warmup else lr
        if not sgd_step(model, optimizer, data, order[index * batch : (index + 1) * batch], current_lr):
            outcome = "diverged"
            break
        train_s += time.perf_counter() - started
        step += 1
        samples += min(batch, task.train_samples - index * batch)
        if step % eval_every and index != steps_per_epoch - 1:
            continue
        epochs = samples / task.train_samples
        accuracy = evaluate(model, data)
        curve.append((round(epochs, 4), round(accuracy, 4)))
        reached = accuracy >= task.target_acc
        if probes and (epochs >= probes[0] or reached):
            noise.append({"epoch": epochs, "test_acc": accuracy, "at_target": reached, **noise_probe(model, data, probe_generator)})
            while probes and epochs >= probes[0]:
                probes.pop(0)
        if reached:
            outcome = "reached"
            break
        if prune_after_steps is not None and step >= prune_after_steps:
            outcome = "pruned"
            break
    return {
        "dataset": task.dataset, "batch": batch, "lr": lr, "lr_multiplier": run.get("lr_multiplier"), "seed": seed,
        "outcome": outcome, "reached": outcome == "reached", "train_s": train_s, "steps": step,
        "epochs": samples / task.train_samples, "step_s": train_s / step if step else None,
        "final_test_acc": accuracy, "curve": curve, "noise": noise,
    }  # fmt: skip


# -- ground truth --------------------------------------------------------------------------------------


def seed_run(run: dict[str, Any]) -> dict[str, Any]:
    """One run of the LR tuning (efficiency_tasks.tune_lr's `train`): seed 0 probes the noise scale along the way,
    so that the chosen LR's seed-0 run carries the trajectory; the other seeds train without the probes."""
    return train_to_target({**run, "probe_noise": run["seed"] == 0})


TUNING_RECORD_KEYS = ("lr", "lr_multiplier", "seed", "outcome", "reached", "steps", "epochs", "final_test_acc")


def measure_batch(job: dict[str, Any]) -> dict[str, Any]:
    """Tune the LR by efficiency_tasks' rule (tune_lr: median steps over TUNING_SEEDS seeds, a sqrt-2 grid extended
    past a winning edge with a lookahead of LR_LOOKAHEAD, the lookahead's move kept only where every seed confirms
    it), then train the remaining seeds at it. One multiplier (--quick): no tuning, every seed at that LR.
    Tuning runs are kept without their curves and probes; the chosen runs with them."""
    task, batch = replace(Task(**job["task"]), seeds=job["seeds"]), job["batch"]
    multipliers = list(job["lr_multipliers"])
    if len(multipliers) == 1:
        lr = multipliers[0] * sqrt_scaled_lr(task, batch)
        runs = [seed_run({"task": asdict(task), "batch": batch, "lr": lr, "lr_multiplier": multipliers[0], "seed": seed}) for seed in range(task.seeds)]
        return {"batch": batch, "tuning": [{k: runs[0][k] for k in TUNING_RECORD_KEYS}], "runs": runs, "runner_up": None, **summarize_runs(runs)}
    tuning_seeds = min(task.seeds, TUNING_SEEDS)
    best, tuning = tune_lr(task, batch, multipliers, tuning_seeds, job.get("lr_lookahead", LR_LOOKAHEAD), train=seed_run)
    runner_up = None
    if best is None:  # no LR reached the target on most seeds: the batch is reported as missed, with its closest run
        runs = [max((r for r in tuning if r["seed"] == 0), key=lambda r: r["final_test_acc"])]
    else:
        runs, runner_up = confirmed_runs(task, batch, best, tuning_seeds, train=seed_run)
    records = [{k: r[k] for k in TUNING_RECORD_KEYS} for r in tuning]
    return {"batch": batch, "tuning": records, "tuning_seeds": tuning_seeds, "runs": runs, "runner_up": runner_up, **summarize_runs(runs)}


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over seeds; a seed that did not reach the target counts as infinitely slow."""
    reached = [r for r in runs if r["reached"]]
    wall_s = [r["train_s"] if r["reached"] else math.inf for r in runs]
    epochs = [r["epochs"] if r["reached"] else math.inf for r in runs]
    return {
        "reached_seeds": len(reached), "seeds": len(runs), "lr": runs[0]["lr"], "lr_multiplier": runs[0]["lr_multiplier"],
        "wall_s": float(np.median(wall_s)), "wall_s_min": float(min(wall_s)), "wall_s_max": float(max(wall_s)),
        "epochs": float(np.median(epochs)), "epochs_min": float(min(epochs)), "epochs_max": float(max(epochs)),
        "steps": float(np.median([r["steps"] for r in reached])) if reached else None,
        "wall_step_s": float(np.median([r["step_s"] for r in reached])) if reached else None,
    }  # fmt: skip


def epoch_seconds_in_rounds(task: Task, batches: list[int], rounds: int) -> dict[int, dict[str, Any]]:
    """Seconds per training epoch at each batch, all timed in the same rounds (see the module docstring).

    A round trains one epoch at every batch, the order rotating by one each round; the step loop is the
    one of train_to_target (the LR does not change a step's cost). Median over rounds per batch.
    """
    from models.zoo import build_model

    torch.set_num_threads(1)
    data = load_data(task.dataset, task.train_samples, task.test_samples)
    states = {}
    for batch in batches:
        torch.manual_seed(0)
        model = build_model(task.model, **data_shape(task.dataset))
        states[batch] = (model, torch.optim.SGD(model.parameters(), lr=sqrt_scaled_lr(task, batch), momentum=MOMENTUM))
    order = torch.randperm(task.train_samples, generator=torch.Generator().manual_seed(0))
    times: dict[int, list[float]] = {b: [] for b in batches}
    for round_index in range(rounds):
        shift = round_index % len(batches)
        for batch in batches[shift:] + batches[:shift]:
            model, optimizer = states[batch]
            model.train()
            elapsed = 0.0
            for start in range(0, task.train_samples, batch):
                started = time.perf_counter()
                sgd_step(model, optimizer, data, order[start : start + batch], sqrt_scaled_lr(task, batch))
                elapsed += time.perf_counter() - started
            times[batch].append(elapsed)
    return {b: {"epoch_s": float(np.median(t)), "rounds_s": t} for b, t in times.items()}


def timed(summary: dict[str, Any], epoch_s: float, num_samples: int) -> dict[str, Any]:
    """Time to the target from the measured epochs and the common-rounds epoch time."""
    return summary | {
        "epoch_s": epoch_s, "step_s": epoch_s / math.ceil(num_samples / summary["batch"]),
        **{f"time_s{end}": summary[f"epochs{end}"] * epoch_s for end in ("", "_min", "_max")},
    }  # fmt: skip


def ground_truth(task: Task, batches: list[int], seeds: int, lr_multipliers: tuple[float, ...], workers: int) -> dict[int, dict]:
    jobs = [{"task": asdict(task), "batch": b, "seeds": seeds, "lr_multipliers": lr_multipliers} for b in batches]
    jobs.sort(key=lambda j: -j["batch"])  # the slowest (largest) first, for the pool's sake
    if workers > 1:
        with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
            results = list(pool.map(measure_batch, jobs))
    else:
        results = [measure_batch(job) for job in jobs]
    timing = epoch_seconds_in_rounds(task, sorted(batches), EPOCH_TIMING_ROUNDS)
    results = [timed(r, timing[r["batch"]]["epoch_s"], task.train_samples) | {"epoch_rounds_s": timing[r["batch"]]["rounds_s"]} for r in results]
    for result in sorted(results, key=lambda r: r["batch"]):
        print(f"  {task.dataset:8s} B={result['batch']:<5d} lr={result['lr']:.4f} time={result['time_s']:.2f}s (in-run wall "
              f"{result['wall_s']:.2f}s) epochs={result['epochs']:.2f} reached={result['reached_seeds']}/{result['seeds']}",
              file=sys.stderr, flush=True)  # fmt: skip
    return {r["batch"]: r for r in results}


# -- the service's prediction ----------------------------------------------------------------------------


def host_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def job_spec(task: Task, batches: tuple[int, ...], reference: dict[str, Any], search: str, time_cap_s: float | None = None) -> dict[str, Any]:
    """The job a user of this machine would submit: one device (this CPU, its RAM), a device-hour price
    (cost is proportional to time), min-time objective, and the reference run."""
    return {
        "name": f"time-to-accuracy-{task.dataset}-{search}",
        "model": task.model,
        "dataset": {"name": task.dataset, "num_samples": task.train_samples, **SERVICE_DATASET_FIELDS.get(task.dataset, {})},
        "batch_sizes": list(batches),
        "cluster": {"nodes": 1, "gpus_per_node": 1, "device_memory_gib": round(host_memory_gib(), 1)},
        "pricing": {"kind": "gpu_hour", "price": 1.0},
        "objective": "min_time",
        "training": {"reference_batch": task.reference_batch, "reference_epochs": reference["epochs"],
                     "reference_lr": reference["lr"], "optimizer": "sgd"},
        "profiling": {"device": "cpu", **({"time_cap_s": time_cap_s} if time_cap_s else {})},
    }  # fmt: skip


def single_device_rows(recommendation: dict[str, Any], num_samples: int) -> dict[int, dict[str, float]]:
    """Predicted epochs, step time and total time per global batch on 1 device without accumulation. The
    step time is an epoch's mean over its ceil(D / B) steps (the last one partial), as measured."""
    rows = {}
    for row in recommendation["candidates"]:
        if row["devices"] == 1 and row["accumulation"] == 1:
            steps_per_epoch = math.ceil(num_samples / row["global_batch"])
            rows[row["global_batch"]] = {
                "epochs": row["epochs"]["value"], "step_s": row["epoch_time_s"]["value"] / steps_per_epoch,
                "time_s": row["total_time_s"]["value"],
                "epochs_source": row["epochs"]["source"],
            }  # fmt: skip
    return rows


def advice(recommendation: dict[str, Any]) -> dict[str, Any]:
    """The LR and warm-up the plan tells the user to train its chosen batch with."""
    training = recommendation["training_advice"]
    return {
        "lr": training["lr_rule"]["lr"]["value"], "lr_rule": training["lr_rule"]["recommended"],
        "lr_multiplier": training["lr_rule"]["multiplier"]["value"], "warmup_epochs": training["warmup"]["epochs"],
    }  # fmt: skip


def choice(recommendation: dict[str, Any]) -> dict[str, Any]:
    chosen = recommendation["chosen"]
    return {key: chosen[key] for key in ("global_batch", "device_batch", "devices", "accumulation")} | {
        "predicted_time_s": chosen["total_time_s"]["value"], "predicted_epochs": chosen["epochs"]["value"]}  # fmt: skip


def service_predictions(
    task: Task, reference: dict[str, Any], searches: dict[str, tuple[int, ...]], log_path: Path, time_cap_s: float | None = None,
    max_lr: float | None = None,
) -> dict[str, Any]:
    """Both jobs through a real server; each is re-planned (POST /plan, no profiling) with training.max_lr too."""
    from tula_service.client import TulaClient

    results = {}
    with api_server(None, log_path, executor="local", env={"OMP_NUM_THREADS": "1"}) as (url, _), TulaClient(url) as client:
        for search, batches in searches.items():
            started = time.perf_counter()
            job = client.submit(job_spec(task, batches, reference, search, time_cap_s))
            job = client.wait(job.id, poll_s=0.5, timeout_s=3600)
            if job.state != "done":
                raise RuntimeError(f"{search} job for {task.dataset} ended {job.state}: {job.error}")
            min_time = client.recommendation(job.id)
            knee = client.plan(job.id, {"objective": "knee"})
            capped = client.plan(job.id, {"training": {"max_lr": max_lr}}) if max_lr else None
            records = [p.measurement for p in client.measurements(job.id).points if p.measurement]
            threads = {r.get("threads") for r in records if r.get("kind", "compute") == "compute"}
            efficiency = min_time["models"]["efficiency"]
            results[search] = {
                "job_id": job.id,
                "batches": list(batches),
                "profiling_s": sum(p.duration_s or 0.0 for p in job.points),
                "job_wall_s": time.perf_counter() - started,
                "profiler_threads": sorted(t for t in threads if t is not None),
                "min_time": choice(min_time),
                "knee": choice(knee),
                "knee_detail": knee.get("knee"),
                "advice": advice(min_time),
                "with_max_lr": {
                    "max_lr": max_lr, "min_time": choice(capped), "predicted": single_device_rows(capped, task.train_samples),
                    "max_step_gain": capped["models"]["efficiency"]["max_step_gain"]["value"],
                } if capped else None,  # fmt: skip
                "predicted": single_device_rows(min_time, task.train_samples),
                "noise_scale": (efficiency.get("noise_scale") or {}).get("value"),
                "noise_scale_stderr": (efficiency.get("noise_scale") or {}).get("stderr"),
                "efficiency_source": efficiency["source"],
                "compute_model": min_time["models"]["compute"]["name"],
                "compute_loo_median_rel_err": min_time["models"]["compute"]["leave_one_out"]["median_rel_err"],
                "max_device_batch": min_time["search_space"]["max_device_batch"]["value"],
            }
            print(f"  {task.dataset:8s} {search:7s} profiled {len(batches)} batches in {results[search]['profiling_s']:.1f}s: "
                  f"min-time {results[search]['min_time']['global_batch']}, knee {results[search]['knee']['global_batch']}, "
                  f"B_noise {results[search]['noise_scale']}", file=sys.stderr, flush=True)  # fmt: skip
    return results


# -- analysis ------------------------------------------------------------------------------------------


def error_pct(predicted: float, measured: float) -> float | None:
    return 100.0 * (predicted / measured - 1.0) if math.isfinite(measured) and measured > 0 else None


def implied_noise_scale(batches: list[int], epochs: list[float]) -> dict[str, float] | None:
    """The B_noise (and E_min) of E(B) = E_min (1 + B / B_noise) that best fits the measured epochs:
    least squares on log epochs over a log grid of B_noise (E_min in closed form for each)."""
    finite = [(b, e) for b, e in zip(batches, epochs) if math.isfinite(e)]
    if len(finite) < 3:
        return None
    batch, log_epochs = np.array([b for b, _ in finite], float), np.log([e for _, e in finite])
    best = None
    for noise_scale in np.logspace(0, 6, 2401):
        shape = np.log1p(batch / noise_scale)
        log_min_epochs = float(np.mean(log_epochs - shape))
        rms = float(np.sqrt(np.mean((log_epochs - shape - log_min_epochs) ** 2)))
        if best is None or rms < best["rms_log_err"]:
            best = {"noise_scale": float(noise_scale), "min_epochs": math.exp(log_min_epochs), "rms_log_err": rms}
    return best


def measured(truth: dict[int, dict], batch: int, key: str = "time_s") -> float:
    return truth[batch][key] if batch in truth else math.inf


def recommended_batches(service: dict[str, Any]) -> set[int]:
    picks = {service[s][o]["global_batch"] for s in service for o in ("min_time", "knee")}
    return picks | {service[s]["with_max_lr"]["min_time"]["global_batch"] for s in service if service[s].get("with_max_lr")}


def advice_check(advised: dict[str, Any] | None, truth: dict[int, dict], best_time_s: float) -> dict[str, Any] | None:
    """The pick trained with the plan's LR and warm-up, against the pick with the tuned LR and against the best."""
    if advised is None:
        return None
    row = truth.get(advised["batch"])  # None when the pick is outside the ground truth's grid (a --quick run)
    return {
        **{key: advised[key] for key in ("batch", "lr", "lr_rule", "warmup_epochs", "time_s", "epochs", "reached_seeds", "seeds")},
        "tuned_lr": row["lr"] if row else None,
        "tuned_time_s": row["time_s"] if row else None, "ratio_to_tuned": advised["time_s"] / row["time_s"] if row else None,
        "regret": advised["time_s"] / best_time_s,
        "tuned_epochs": row["epochs"] if row else None, "epochs_ratio_to_tuned": advised["epochs"] / row["epochs"] if row else None,
    }  # fmt: skip


def on_wall_time(grid: list[int], truth: dict[int, dict], pick: int, largest: int) -> dict[str, Any]:
    """The headline scores again on the runs' own wall times (each batch timed when its runs happened)."""
    wall = {b: measured(truth, b, "wall_s") for b in grid}
    best = min(grid, key=wall.__getitem__)
    return {
        "best_batch": best, "regret": wall[pick] / wall[best], "speedup_vs_largest": wall[largest] / wall[pick],
        "speedup_vs_default": wall[DEFAULT_HABIT_BATCH] / wall[pick],
    }  # fmt: skip


def analyze(task: Task, truth: dict[int, dict], service: dict[str, Any], advised: dict[str, Any] | None = None) -> dict[str, Any]:
    grid = [b for b in task.batches if b in truth]
    best_batch = min(grid, key=lambda b: truth[b]["time_s"])
    best_time = truth[best_batch]["time_s"]
    rows = []
    for batch in grid:
        row = {"batch": batch, **{f"measured_{k}": truth[batch][k] for k in ("time_s", "time_s_min", "time_s_max", "wall_s", "epochs", "epochs_min", "epochs_max", "step_s", "lr")},
               "reached_seeds": truth[batch]["reached_seeds"], "seeds": truth[batch]["seeds"]}  # fmt: skip
        for search in service:
            predicted = service[search]["predicted"].get(batch)
            for key in ("time_s", "epochs", "step_s"):
                value = predicted[key] if predicted else None
                row[f"{search}_{key}"] = value
                row[f"{search}_{key}_err_pct"] = error_pct(value, truth[batch][key]) if value and truth[batch][key] else None
        capped = (service["full"].get("with_max_lr") or {}).get("predicted", {}).get(batch)
        for key in ("time_s", "epochs"):
            row[f"max_lr_{key}"] = capped[key] if capped else None
            row[f"max_lr_{key}_err_pct"] = error_pct(capped[key], truth[batch][key]) if capped else None
        rows.append(row)
    def scored(pick: dict[str, Any]) -> dict[str, Any]:
        batch = pick["global_batch"]
        return {"global_batch": batch, "accumulation": pick["accumulation"], "measured_time_s": measured(truth, batch),
                "regret": measured(truth, batch) / best_time, "predicted_time_s": pick["predicted_time_s"]}  # fmt: skip

    picks = {f"{search}_{objective}": scored(service[search][objective]) for search in service for objective in ("min_time", "knee")}
    if service["full"].get("with_max_lr"):
        picks["full_max_lr_min_time"] = scored(service["full"]["with_max_lr"]["min_time"])
    largest = max(b for b in grid if b <= min(service["full"]["max_device_batch"], task.train_samples))
    headline = picks["full_min_time"]
    epoch_errors = [abs(r["full_epochs_err_pct"]) for r in rows if r["batch"] != task.reference_batch and r["full_epochs_err_pct"] is not None]
    capped_errors = [abs(r["max_lr_epochs_err_pct"]) for r in rows if r["batch"] != task.reference_batch and r["max_lr_epochs_err_pct"] is not None]
    inside = lambda key: sum(r["measured_epochs_min"] <= r[key] <= r["measured_epochs_max"] for r in rows if r[key] is not None)  # noqa: E731
    time_errors = [abs(r["full_time_s_err_pct"]) for r in rows if r["full_time_s_err_pct"] is not None]
    step_errors = [abs(r["full_step_s_err_pct"]) for r in rows if r["full_step_s_err_pct"] is not None]
    reference_noise = [p for p in truth[task.reference_batch]["runs"][0]["noise"]]
    return {
        "rows": rows,
        "best": {"batch": best_batch, "time_s": best_time},
        "picks": picks,
        "regret": headline["regret"],
        "advice": advice_check(advised, truth, best_time),
        "habits": {
            "largest": {"batch": largest, "time_s": measured(truth, largest), "speedup": measured(truth, largest) / headline["measured_time_s"]},
            "default": {"batch": DEFAULT_HABIT_BATCH, "time_s": measured(truth, DEFAULT_HABIT_BATCH),
                        "speedup": measured(truth, DEFAULT_HABIT_BATCH) / headline["measured_time_s"]},
        },  # fmt: skip
        "on_wall_time": on_wall_time(grid, truth, picks["full_min_time"]["global_batch"], largest),
        "partial_vs_full": {
            "profiling_s": {s: service[s]["profiling_s"] for s in service},
            "points": {s: len(service[s]["batches"]) for s in service},
            "same_min_time_batch": picks["partial_min_time"]["global_batch"] == picks["full_min_time"]["global_batch"],
            "true_time_ratio_partial_over_full": picks["partial_min_time"]["measured_time_s"] / picks["full_min_time"]["measured_time_s"],
        },  # fmt: skip
        "epochs_err_pct_median": float(np.median(epoch_errors)) if epoch_errors else None,
        "epochs_err_pct_max": float(max(epoch_errors)) if epoch_errors else None,
        "max_lr_epochs_err_pct_median": float(np.median(capped_errors)) if capped_errors else None,
        "max_lr_epochs_err_pct_max": float(max(capped_errors)) if capped_errors else None,
        "epochs_inside_seed_range": {"full": inside("full_epochs"), "max_lr": inside("max_lr_epochs"), "batches": len(rows)},
        "time_err_pct_median": float(np.median(time_errors)) if time_errors else None,
        "step_err_pct_median": float(np.median(step_errors)) if step_errors else None,
        "noise_scale": {
            "profiler": {s: service[s]["noise_scale"] for s in service},
            "training_at_init": reference_noise[0]["noise_scale"] if reference_noise else None,
            "training_at_target": reference_noise[-1]["noise_scale"] if reference_noise else None,
            "training_series": [(round(p["epoch"], 3), p["noise_scale"]) for p in reference_noise],
            "implied_by_epochs": implied_noise_scale(grid, [truth[b]["epochs"] for b in grid]),
        },
    }


# -- report --------------------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 2, signed: bool = False) -> str:
    if value is None:
        return "–"
    if not math.isfinite(value):
        return "∞"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def missed_as_infinite(value: float | None) -> float:
    """A median or extreme over seeds is None in results.json where a seed missed the target."""
    return math.inf if value is None else value


def task_table(task: Task, analysis: dict[str, Any]) -> str:
    """Markdown: per batch, measured (median of seeds) vs predicted (full search) time, epochs, step time."""
    lines = [
        "| batch | LR | measured time (s) | in-run wall (s) | predicted (s) | err % | measured epochs | seeds: min-max | predicted | err % "
        "| ms per step, measured | predicted | err % | partial: predicted time (s) | with max_lr: epochs | err % |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    marks = {analysis["best"]["batch"]: " (best)"}
    for row in analysis["rows"]:
        label = f"{row['batch']}{marks.get(row['batch'], '')}"
        step_ms = lambda v: None if v is None else 1000 * v  # noqa: E731
        lines.append(
            f"| {label} | {row['measured_lr']:.4f} | {fmt(row['measured_time_s'])} | {fmt(missed_as_infinite(row['measured_wall_s']))} | {fmt(row['full_time_s'])} | {fmt(row['full_time_s_err_pct'], 0, True)} "
            f"| {fmt(row['measured_epochs'])} | {fmt(row['measured_epochs_min'])}-{fmt(missed_as_infinite(row['measured_epochs_max']))} "
            f"| {fmt(row['full_epochs'])} | {fmt(row['full_epochs_err_pct'], 0, True)} "
            f"| {fmt(step_ms(row['measured_step_s']), 3)} | {fmt(step_ms(row['full_step_s']), 3)} | {fmt(row['full_step_s_err_pct'], 0, True)} "
            f"| {fmt(row['partial_time_s'])} | {fmt(row.get('max_lr_epochs'))} | {fmt(row.get('max_lr_epochs_err_pct'), 0, True)} |"
        )  # fmt: skip
    return "\n".join(lines)


def picks_table(results: dict[str, Any]) -> str:
    lines = [
        "| task | search | points | profiling (s) | min-time pick | measured (s) | regret | knee pick | regret | best batch (s) | largest: batch, speedup | 32: speedup |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, result in results["tasks"].items():
        a = result["analysis"]
        for search in ("partial", "full"):
            mt, knee = a["picks"][f"{search}_min_time"], a["picks"][f"{search}_knee"]
            habits = a["habits"] if search == "full" else None
            lines.append(
                f"| {name} | {search} | {a['partial_vs_full']['points'][search]} | {a['partial_vs_full']['profiling_s'][search]:.1f} "
                f"| {mt['global_batch']} | {fmt(mt['measured_time_s'])} | {fmt(mt['regret'])} | {knee['global_batch']} | {fmt(knee['regret'])} "
                f"| {a['best']['batch']} ({fmt(a['best']['time_s'])}) "
                + (f"| {habits['largest']['batch']}, {fmt(habits['largest']['speedup'])}x | {fmt(habits['default']['speedup'])}x |" if habits else "| | |")
            )  # fmt: skip
    return "\n".join(lines)


def advice_lines(results: dict[str, Any]) -> str:
    lines = []
    for name, result in results["tasks"].items():
        a = result["analysis"]["advice"]
        if a:
            lines.append(
                f"- **{name}**: batch {a['batch']} with the plan's LR {a['lr']:.4f} ({a['lr_rule']}) and {a['warmup_epochs']:.2f} warm-up "
                f"epochs: {fmt(a['time_s'])} s, {fmt(a['epochs'])} epochs ({a['reached_seeds']}/{a['seeds']} seeds reached); with the "
                f"tuned LR {fmt(a['tuned_lr'], 4)}: {fmt(a['tuned_time_s'])} s, {fmt(a['tuned_epochs'])} epochs; ratio: time "
                f"{fmt(a['ratio_to_tuned'])}, epochs {fmt(a['epochs_ratio_to_tuned'])}; regret {fmt(a['regret'])}"
            )  # fmt: skip
    return "\n".join(lines)


def max_lr_lines(results: dict[str, Any]) -> str:
    lines = []
    for name, result in results["tasks"].items():
        capped, a = result["service"]["full"].get("with_max_lr"), result["analysis"]
        if capped:
            pick = a["picks"]["full_max_lr_min_time"]
            lines.append(
                f"- **{name}**: max_lr {capped['max_lr']:.4f} (max_step_gain {capped['max_step_gain']:.2f}): min-time pick {pick['global_batch']} "
                f"(regret {fmt(pick['regret'])}); epochs |error| median {fmt(a['max_lr_epochs_err_pct_median'], 1)}%, worst "
                f"{fmt(a['max_lr_epochs_err_pct_max'], 1)}% (without: {fmt(a['epochs_err_pct_median'], 1)}%, worst {fmt(a['epochs_err_pct_max'], 1)}%)"
            )  # fmt: skip
    return "\n".join(lines)


def noise_lines(results: dict[str, Any]) -> str:
    lines = []
    for name, result in results["tasks"].items():
        noise = result["analysis"]["noise_scale"]
        implied = noise["implied_by_epochs"]
        series = ", ".join(f"{e:g}: {fmt(v, 0)}" for e, v in noise["training_series"])
        lines.append(
            f"- **{name}**: profiler (at initialization) {fmt(noise['profiler']['partial'], 0)} (partial) / "
            f"{fmt(noise['profiler']['full'], 0)} (full); implied by the measured epochs "
            + (f"{implied['noise_scale']:.0f} (E_min {implied['min_epochs']:.2f}, rms log error {implied['rms_log_err']:.3f})" if implied else "–")
            + f"; measured while training at B_ref, by epoch: {series}"
        )  # fmt: skip
    return "\n".join(lines)


def summary_line(results: dict[str, Any]) -> str:
    analyses = [r["analysis"] for r in results["tasks"].values()]
    regret = max(a["regret"] for a in analyses)
    largest = float(np.median([a["habits"]["largest"]["speedup"] for a in analyses]))
    default = float(np.median([a["habits"]["default"]["speedup"] for a in analyses]))
    errors = [a["epochs_err_pct_median"] for a in analyses if a["epochs_err_pct_median"] is not None]
    epochs_err = float(np.median(errors)) if errors else float("nan")
    return (f"time_to_accuracy: tasks={len(analyses)} regret={regret:.2f} speedup_vs_largest={largest:.2f} "
            f"speedup_vs_default={default:.2f} epochs_err_pct={epochs_err:.1f}")  # fmt: skip


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = results["tasks"]
    figure, axes = plt.subplots(2, len(tasks), figsize=(5.5 * len(tasks), 8), squeeze=False)
    for column, (name, result) in enumerate(tasks.items()):
        a = result["analysis"]
        batch = np.array([r["batch"] for r in a["rows"]])
        for row, (key, label) in enumerate((("time_s", "time to target (s)"), ("epochs", "epochs to target"))):
            axis = axes[row][column]
            truth = result["truth"]
            finite = lambda values: np.array([np.nan if v is None else v for v in values], float)  # noqa: E731
            lows = finite([truth[str(b)][f"{key}_min"] for b in batch])
            highs = finite([truth[str(b)][f"{key}_max"] for b in batch])
            middle = finite([r[f"measured_{key}"] for r in a["rows"]])
            axis.errorbar(batch, middle, yerr=[middle - lows, highs - middle], fmt="o-", color="black", capsize=3,
                          label=f"measured (median, min-max of {result['seeds']} seeds)")  # fmt: skip
            for prefix, style, legend in (("full", "s--", "predicted (full search)"), ("partial", "^:", "predicted (partial search)"),
                                          ("max_lr", "d-.", "predicted (full search, with max_lr)")):  # fmt: skip
                predicted = [r.get(f"{prefix}_{key}") for r in a["rows"]]
                if any(p is not None for p in predicted):
                    axis.plot(batch, [np.nan if p is None else p for p in predicted], style, label=legend, alpha=0.8)
            if key == "time_s":
                pick = a["picks"]["full_min_time"]
                axis.axvline(pick["global_batch"], color="tab:green", alpha=0.5, label=f"min-time pick ({pick['global_batch']})")
                axis.axvline(a["best"]["batch"], color="tab:red", alpha=0.3, linestyle="--", label=f"best measured ({a['best']['batch']})")
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_xlabel("global batch (1 device)")
            axis.set_ylabel(label)
            axis.set_title(f"{name} ({result['task']['model']}, target {100 * result['task']['target_acc']:.0f}% test acc.)")
            axis.legend(fontsize=7)
            axis.grid(alpha=0.3, which="both")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def generated_markdown(results: dict[str, Any], out: Path) -> str:
    parts = [
        f"Measured {results['date']} on {results['machine']} (torch {results['torch']}, one torch thread per process, "
        f"{results['workers']} training process(es)); seeds per batch: "
        + ", ".join(f"{name} {result['seeds']}" for name, result in results["tasks"].items())
        + f"; wall time {results['wall_s'] / 60:.1f} min.",
        "",
        "```sh",
        results["command"],
        "```",
        "",
        "```",
        summary_line(results),
        "```",
        "",
        "### Recommendations against the measured best",
        "",
        picks_table(results),
        "",
        "### Predicted vs measured, per batch (full search)",
    ]
    for name, result in results["tasks"].items():
        task = task_from_json(result["task"])
        a = result["analysis"]
        parts += [
            "",
            f"**{name}**: `{task.model}`, {task.train_samples} train / {task.test_samples} test samples, target "
            f"{100 * task.target_acc:.0f}% test accuracy, reference run B_ref = {task.reference_batch}: "
            f"{result['reference']['epochs']:.2f} epochs at LR {result['reference']['lr']:.4f}. Median |error| over the grid: "
            f"epochs {fmt(a['epochs_err_pct_median'], 1)}% (B_ref excluded), step time {fmt(a['step_err_pct_median'], 1)}%, "
            f"total time {fmt(a['time_err_pct_median'], 1)}%. Predicted epochs inside the seeds' min-max: "
            f"{a['epochs_inside_seed_range']['full']} of {a['epochs_inside_seed_range']['batches']} batches "
            f"({a['epochs_inside_seed_range']['max_lr']} with max_lr).",
            "",
            task_table(task, a),
        ]
    parts += ["", "On the runs' own wall times (each batch timed while its runs happened, minutes apart): "
              + "; ".join(f"{name}: best {r['analysis']['on_wall_time']['best_batch']}, min-time regret "
                          f"{fmt(r['analysis']['on_wall_time']['regret'])}, speedup vs largest {fmt(r['analysis']['on_wall_time']['speedup_vs_largest'])}x, "
                          f"vs 32 {fmt(r['analysis']['on_wall_time']['speedup_vs_default'])}x" for name, r in results["tasks"].items()) + "."]
    parts += ["", "### Re-planned with training.max_lr (the largest LR that reached the target in the LR sweep)", "",
              max_lr_lines(results),
              "", "### Training the pick as the plan advises (LR rule and warm-up)", "", advice_lines(results),
              "", "### Gradient noise scale", "", noise_lines(results), "",
              f"![measured vs predicted time to accuracy]({out.relative_to(REPO / 'docs').as_posix()}/time_to_accuracy.png)"]  # fmt: skip
    return "\n".join(parts)


def write_docs(markdown: str, path: Path) -> None:
    """Replace the generated block of docs/validation.md, keeping the hand-written text around it."""
    text = path.read_text() if path.exists() else f"# Validation: time to accuracy\n\n{GENERATED_START}\n{GENERATED_END}\n"
    if GENERATED_START not in text or GENERATED_END not in text:
        raise ValueError(f"{path} lacks the generated-block markers")
    head, rest = text.split(GENERATED_START, 1)
    _, tail = rest.split(GENERATED_END, 1)
    path.write_text(f"{head}{GENERATED_START}\n{markdown}\n{GENERATED_END}{tail}")


def plain(value: Any) -> Any:
    """JSON-safe: infinities as null, int keys as strings."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def task_from_json(task: dict[str, Any]) -> Task:
    return Task(**{k: tuple(v) if isinstance(v, list) else v for k, v in task.items()})


MEDIANS_OVER_SEEDS = ("time_s", "time_s_min", "time_s_max", "wall_s", "wall_s_min", "wall_s_max", "epochs", "epochs_min", "epochs_max")


def restored(result: dict[str, Any]) -> dict[str, Any]:
    """One task of results.json as the analysis wants it: batch keys as ints, a missed target as infinity."""

    def by_batch(rows: dict[str, Any]) -> dict[int, Any]:
        return {int(b): row for b, row in rows.items()}

    def infinite(summary: dict[str, Any]) -> dict[str, Any]:
        return summary | {k: math.inf for k in MEDIANS_OVER_SEEDS if k in summary and summary[k] is None}

    service = {}
    for search, s in result["service"].items():
        service[search] = s | {"predicted": by_batch(s["predicted"])}
        if s.get("with_max_lr"):
            service[search]["with_max_lr"] = s["with_max_lr"] | {"predicted": by_batch(s["with_max_lr"]["predicted"])}
    truth = {b: infinite(row) for b, row in by_batch(result["truth"]).items()}
    return result | {"truth": truth, "service": service, "advised": infinite(result["advised"]) if result.get("advised") else None}


def render(out: Path) -> dict[str, Any]:
    """Re-analyze OUT/results.json (no training, no server) and write the report again: for a change to the
    analysis or the report without the 12-minute run."""
    results = json.loads((out / "results.json").read_text())
    for name, result in results["tasks"].items():
        result = restored(result)
        result["analysis"] = analyze(task_from_json(result["task"]), result["truth"], result["service"], result["advised"])
        results["tasks"][name] = result
    return plain(results)


# -- main ----------------------------------------------------------------------------------------------


def quick_task(task: Task) -> Task:
    keep = {task.reference_batch, *task.partial_batches}
    return replace(task, batches=tuple(b for b in task.batches if b in keep))


def run_task(
    task: Task, seeds: int, multipliers: tuple[float, ...], workers: int, log_path: Path, time_cap_s: float | None = None
) -> dict[str, Any]:
    print(f"{task.dataset}: ground truth at {list(task.batches)}", file=sys.stderr, flush=True)
    truth = ground_truth(task, list(task.batches), seeds, multipliers, workers)
    reference = truth[task.reference_batch]
    if not reference["reached_seeds"]:
        raise RuntimeError(f"{task.dataset}: the reference batch {task.reference_batch} did not reach the target")
    searches = {"partial": task.partial_batches, "full": task.batches}
    max_lr = max(run["lr"] for b in truth.values() for run in b["tuning"] if run["reached"])  # what an LR sweep finds
    service = service_predictions(task, {"epochs": reference["epochs"], "lr": reference["lr"]}, searches, log_path, time_cap_s, max_lr)
    extra = sorted(b for b in recommended_batches(service) if b not in truth and b <= task.train_samples)
    if extra:  # a pick outside the grid (e.g. with accumulation) is measured too
        print(f"{task.dataset}: measuring recommended batches outside the grid: {extra}", file=sys.stderr, flush=True)
        truth.update(ground_truth(task, extra, seeds, multipliers, workers))
    pick, advised = service["full"]["min_time"]["global_batch"], service["full"]["advice"]
    print(f"{task.dataset}: training the pick {pick} as advised: LR {advised['lr']:.4f}, warm-up {advised['warmup_epochs']:.2f} epochs",
          file=sys.stderr, flush=True)  # fmt: skip
    runs = [train_to_target({"task": asdict(task), "batch": pick, "lr": advised["lr"], "warmup_epochs": advised["warmup_epochs"],
                             "lr_multiplier": None, "seed": seed}) for seed in range(seeds)]  # fmt: skip
    advised = {**timed({"batch": pick, **summarize_runs(runs)}, truth[pick]["epoch_s"], task.train_samples), **advised, "runs": runs}
    return {
        "task": asdict(task), "seeds": seeds, "lr_multipliers": list(multipliers), "advised": advised,
        "reference": {"batch": task.reference_batch, "epochs": reference["epochs"], "lr": reference["lr"]},
        "truth": truth, "service": service, "analysis": analyze(task, truth, service, advised),
    }  # fmt: skip


def measure(args: argparse.Namespace, seeds: int | None, multipliers: tuple[float, ...], argv: list[str] | None) -> dict[str, Any]:
    """Every task: ground truth, the service's two jobs, the advised run, the analysis (JSON-safe)."""
    log_path = Path(tempfile.gettempdir()) / "tula-time-to-accuracy-server.log"
    started = time.perf_counter()
    results: dict[str, Any] = {
        "command": " ".join([".venv/bin/python", "benchmarks/time_to_accuracy.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": dt.date.today().isoformat(), "machine": f"{os.cpu_count()}-core {platform.machine()} CPU",
        "torch": torch.__version__, "workers": args.workers, "quick": args.quick, "tasks": {},
    }  # fmt: skip
    for name in args.tasks:
        task = quick_task(TASKS[name]) if args.quick else TASKS[name]
        results["tasks"][name] = run_task(task, seeds or task.seeds, multipliers, args.workers, log_path, args.profile_time_cap_s)
    results["wall_s"] = time.perf_counter() - started
    return plain(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, no LR tuning, the partial grid plus B_ref")
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=list(TASKS))
    parser.add_argument("--seeds", type=int, default=None, help="seeds per batch (default: the task's, 3 or 5; 1 with --quick)")
    parser.add_argument("--workers", type=int, default=1, help="training processes (more than 1 shares the cores: timings inflate)")
    parser.add_argument("--out", type=Path, default=None, help="default docs/validation (a temporary folder with --quick)")
    parser.add_argument("--profile-time-cap-s", type=float, default=None, help="profiling.time_cap_s of the jobs (default: the service's)")
    parser.add_argument("--render", action="store_true", help="no runs: re-analyze OUT/results.json and write the report again")
    args = parser.parse_args(argv)
    seeds = args.seeds or (1 if args.quick else None)
    multipliers = (1.0,) if args.quick else LR_MULTIPLIERS
    out = args.out or (Path(tempfile.gettempdir()) / "tula-time-to-accuracy-quick" if args.quick else REPO / "docs" / "validation")
    out.mkdir(parents=True, exist_ok=True)
    results = render(out) if args.render else measure(args, seeds, multipliers, argv)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "time_to_accuracy.png")
    print(picks_table(results))
    for name, result in results["tasks"].items():
        print(f"\n{name}:\n" + task_table(task_from_json(result["task"]), result["analysis"]))
    print("\n" + max_lr_lines(results))
    print("\n" + advice_lines(results))
    print("\n" + noise_lines(results))
    if out.resolve().is_relative_to((REPO / "docs").resolve()) and not results["quick"]:
        write_docs(generated_markdown(results, out), REPO / "docs" / "validation.md")
    print(summary_line(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
