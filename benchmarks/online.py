"""Online re-planning and batch schedules against the static recommendation, trained to the target (issue 17).

Per task of issue 9's CPU suite (benchmarks/efficiency_tasks.py: model, data, optimizer, target; one torch
thread, as the ground truth was made):
1. The static recommendation, from the real service: `tula serve --executor local` on a free port profiles the
   job (POST /v1/jobs; a 1-device cluster, objective min_time) with the reference batch's LR and median epochs
   to the target from the ground truth (docs/validation/statistical_efficiency/ground_truth.json). Noise-scale
   evidence (--evidence): the service's pilot over PILOT_SHARE of the reference run's steps (default: what a
   user who logged no reference run gets), or the ground truth's whole reference-run trajectory (seed 0's records on
   the median run's clock, efficiency_tasks.as_one_run, so that they end at the reference epochs).
2. Trained to the target, each over SEEDS seeds (a seed changes the initialization and the batch order):
   - (a) static: the chosen global batch, the recommended LR, its warm-up (linear from the reference LR);
   - (b) online: the same start, with the real client (profiler.tula_run.TulaRun; two micro-batches a step, as
     one process needs for the statistics; statistics on 2 steps in SAMPLE_EVERY or fewer: the client's overhead
     budget, OVERHEAD_BUDGET of the step time, stretches the sampling period) sending telemetry every EVERY
     steps to a run (POST /v1/runs) and
     fetching GET /v1/runs/{id}/plan every PLAN_EVERY_S, posting as often (with the last answer's ETag: the server
     re-plans only when telemetry has landed since; the report counts its answers by how they were made); an advised
     change (batch, LR) is applied at the next step, unless that step is past the change's apply_by_step (it saves
     less than the hysteresis there: the run keeps its configuration, and the result lists it in stale_changes);
   - online_replayed: the online run's batch and LR changes at the same steps, without the client: the worth
     of its decisions apart from the telemetry's cost;
   - (c) each batch schedule of the recommendation (training_advice.batch_schedule) other than "constant":
     its stages switched by epochs done, each at its LR (reference LR x the stage's lr_multiplier).
   A task with batch norm (efficiency_tasks' micro_batched: the ResNets) trains every step of every arm in its
   ground truth's micro-batches (every_step_pieces), as k devices with local batch norm would: batch norm
   normalizes each micro-batch by its own statistics, so a split only on the client's sampled steps would change
   what the online arm trains with, and its runs would no longer be the static runs of the same seeds. With the
   split everywhere the client only observes: the online arm's steps are the static arm's until advice changes them.
   Every suite task the service's catalog can describe is planned with its own model, model options and data
   (JOB_DATASETS; the GPT's Python-stdlib text as a token_file the server's data roots hold); the two digits MLP
   tasks are not (they read the 8x8 images as 64-long signals, which no catalog dataset gives).
   The clock counts training steps only (data indexing, forward, backward, optimizer, the client's calls);
   the evaluations (every 1/EVALS_PER_EPOCH epoch, as in the ground truth) are outside it. A run that does not
   reach the target within MAX_EPOCHS_FACTOR x the reference epochs counts as infinitely slow.
3. Telemetry overhead: steps at the static batch as the online arm runs them (a TulaRun attached: hooks,
   statistics, records, the sender thread posting to the server and fetching advice; the sampled steps split
   in two micro-batches, the others whole) against plain steps, alternated over OVERHEAD_ROUNDS rounds (the
   order reversed every other round); each arm's round starts from the same weights, optimizer state and
   batches, so that the arms' models do not drift apart in speed. The overhead is the ratio of the arms' total
   seconds: the sampled steps, rare under the overhead budget, count in proportion (a median over rounds would
   leave them out); the median over rounds of the per-round ratio is kept too. Next to it, the cost
   of splitting every step (what the statistics would cost without sampling, before any of their arithmetic),
   and the client's own estimate (TulaRun.overhead) with the sampling period it settled on. A second plain arm
   (plain_again) measures the method's own resolution: its difference from plain is the A/A noise; a second
   client arm (client_offline) writes JSONL instead of posting, which isolates the sender thread's share.
The training runs on one core and the server on the other (CPU affinity), as the server would run on a
machine of its own: on this 2-core machine its re-planning would otherwise take the training's core.

4. A common clock. Identical runs differ by up to 30% in wall time on this shared machine (the same 114 steps took
   1.27 s and 1.77 s in two arms), so wall-time ratios of sub-second runs do not resolve 15%. The steps a run
   needs are deterministic given its seed; only its seconds need a fair clock. So each global batch any run
   trained at is timed in plain steps over CLOCK_ROUNDS interleaved rounds (every batch from the same weights,
   the order reversed every other round, so that the machine's drift hits every batch alike; the median over
   rounds), and a run's clock time is the sum over its stages of steps x the clock's seconds per step at the
   stage's batch; the online arm adds the measured telemetry overhead per step (step 3; a negative measurement,
   which is noise, counts as zero). Arms share seeds (initialization and batch order), so each seed's run is
   compared with the static run of the same seed, and the ratio is the median over seeds of those paired
   ratios (a seed whose static run missed the target is left out; an arm's run that missed counts as infinite).

Reported per task: time-to-target ratio against static on the common clock (the summary line's), the wall-time
ratio of median seconds over seeds beside it, steps, the decisions the run took, and the recommended schedule.
Last line: `online: tasks=N time_ratio_vs_static=X overhead_pct=Y` (medians over tasks; X on the common
clock). AGS is not applied in any arm (it changes the update, not the time model under test).

On a GPU (--device cuda): the data, the models and the server's profiling on the GPU; everything else as above.
Every timed block ends in a device synchronization, so that a step's seconds hold its kernels.

Run:  .venv/bin/python benchmarks/online.py [--quick] [--tasks NAME ...] [--seeds N] [--out DIR] [--device cpu|cuda]
      --quick: 3 seeds, writes into a temporary folder. Full: docs/validation/online.{md,json}. Each task's result is
      written as soon as it is done, so that a run cut short keeps the tasks it finished.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from efficiency_tasks import TASKS, BatchStream, Task, as_one_run, evaluate, mean_loss, micro_batches, reached, task_data, task_model, task_optimizer  # noqa: E402
from live_server import api_server, plan_answers  # noqa: E402
from offline_data import STDLIB_TOKEN_FILE, write_stdlib_token_file  # noqa: E402
from pretrained import pretrained_weights  # noqa: E402
from statistical_efficiency import _contract_record as contract_record  # noqa: E402

from profiler.tula_run import TulaRun  # noqa: E402

GROUND_TRUTH = REPO / "docs" / "validation" / "statistical_efficiency" / "ground_truth.json"
DEFAULT_TASKS = ("mnist1d_cnn1d_adam", "digits_cnn_sgd", "mnist1d_mlp_sgd")
SEEDS, QUICK_SEEDS = 7, 3  # identical runs differ by up to 25% in time on this shared machine: medians need seeds
EVALS_PER_EPOCH = 8
MAX_EPOCHS_FACTOR = 10.0
EVERY = 20  # optimizer steps per telemetry record: these runs take a few hundred steps
SAMPLE_EVERY = 20  # statistics on 2 consecutive steps in 20 at most (GradientStatsLogger's sampling): a step here takes milliseconds
OVERHEAD_BUDGET = 0.02  # TulaRun(overhead_budget=): the client stretches the sampling to cost at most 2% of a step (issue 17's target)
PLAN_EVERY_S = 0.25  # and the posts as often: the runs take under a second, and advice needs their telemetry first
MICRO_BATCHES = 2
MIN_STEPS_BETWEEN_CHANGES = 20  # the runs are short: the service's default (100) would allow about one change
OVERHEAD_ROUNDS, OVERHEAD_STEPS = 40, 40
CLOCK_ROUNDS, CLOCK_STEPS = 15, 10  # the common clock: every batch's plain steps, timed in interleaved rounds
TRAINING_CPU, SERVER_CPU = 0, 1  # the server gets a core of its own, as it would have a machine of its own
JOB_TIMEOUT_S = 600.0
# The static plan's noise-scale evidence by default: the service's pilot over this share of the reference run's
# steps. A real run lasts hours and a pilot seconds, so a pilot sees the start of training only; on these
# CPU tasks its default 300 steps would see most of the run, which no real job gets.
PILOT_SHARE = 0.1


# -- the static recommendation --------------------------------------------------------------------------


# The suite's datasets as the service's catalog names them. Not here: digits_x16_flat (the digits MLP reads the 8x8
# images as 64-long signals; the catalog's digits are images, which its mlp1d does not take).
JOB_DATASETS = {
    "mnist1d": {"name": "mnist1d"},
    "digits_x16": {"name": "digits", "scaling": "unit", "split": "train"},
    "stdlib_bytes": {"name": "token_file", "path": str(STDLIB_TOKEN_FILE)},  # the server's data roots hold its folder
    "diabetes": {"name": "diabetes", "split": "train"},  # the same standardized train split, trained with mse
}


def job_dataset(task: Task) -> dict[str, Any]:
    """The spec's `dataset` that gives what the task trains on (JOB_DATASETS), sized as the task's train split."""
    if task.dataset not in JOB_DATASETS:
        raise ValueError(f"{task.dataset}: no dataset of the service's catalog gives what this task trains on ({sorted(JOB_DATASETS)} do)")
    dataset = dict(JOB_DATASETS[task.dataset])
    if dataset["name"] != "digits":  # digits' split sets its size
        dataset["num_samples"] = task.train_samples
    if task.dataset == "stdlib_bytes":
        dataset["seq_len"] = task.seq_len
    return dataset


def job_spec(task: Task, truth: dict[str, Any], evidence: str = "pilot", device: str = "cpu") -> dict[str, Any]:
    """The job a user of this task would submit: one device (a CPU core, or the GPU), min_time, the reference batch's
    LR and epochs, and as noise-scale evidence the service's pilot over PILOT_SHARE of the reference run (evidence
    "pilot") or the reference run's whole trajectory ("reference_run")."""
    reference = truth["batches"][str(task.reference_batch)]
    training = {"optimizer": task.optimizer, "reference_batch": task.reference_batch, "reference_lr": reference["lr"],
                "reference_epochs": reference["epochs"]}  # fmt: skip
    profiling = {"time_cap_s": 2, "device": device, **({"threads": 1} if device == "cpu" else {})}
    if evidence == "reference_run":
        training["reference_run"] = {"gradient_stats": [contract_record(r) for r in as_one_run(reference["trajectory"], reference)]}
    else:
        pilot_steps = max(10, round(PILOT_SHARE * reference["epochs"] * task.train_samples / task.reference_batch))
        profiling.update(pilot=True, pilot_steps=pilot_steps, pilot_record_every=max(1, pilot_steps // 20))
    dataset = job_dataset(task)
    batches = [b for b in task.batches if b <= task.train_samples // 2]
    return {
        "name": f"online-{task.dataset}-{task.model}",
        "model": task.model,
        "model_options": dict(task.model_options),
        **({"initial_weights": str(pretrained_weights(task.pretrained))} if task.pretrained else {}),  # fine-tuning: the pilot starts there
        "dataset": dataset,
        "batch_sizes": {"min": min(batches), "max": max(batches)},
        "cluster": {"nodes": 1, "gpus_per_node": 1, "device_memory_gib": 8, "interconnect_gbps": 100},
        "pricing": {"kind": "gpu_hour", "price": 1.0},
        "objective": "min_time",
        "training": training,
        "profiling": profiling,
    }  # fmt: skip


def recommendation(server: str, spec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    job = httpx.post(f"{server}/v1/jobs", json=spec, timeout=60).raise_for_status().json()
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        status = httpx.get(f"{server}/v1/jobs/{job['id']}", timeout=30).json()["state"]
        if status == "done":
            return job["id"], httpx.get(f"{server}/v1/jobs/{job['id']}/recommendation", timeout=60).raise_for_status().json()
        if status in ("failed", "cancelled"):
            raise RuntimeError(f"job {job['id']} {status}")
        time.sleep(1.0)
    raise RuntimeError(f"job {job['id']} not done in {JOB_TIMEOUT_S:g} s")


# -- one run to the target ----------------------------------------------------------------------------


class Arm:
    """What a run trains with: the global batch and LR by epoch (static, a schedule), or the live advice."""

    def __init__(self, stages: list[dict[str, Any]], reference_lr: float, warmup_steps: int, client: TulaRun | None = None):
        self.stages, self.reference_lr, self.warmup_steps, self.client = stages, reference_lr, warmup_steps, client
        self.applied_since: int | None = 0
        self.stale: list[tuple[int, int]] = []  # (decided at, arrived at) of changes that came past their apply_by_step
        self.batch, self.lr = stages[0]["global_batch"], reference_lr * stages[0]["lr_multiplier"]

    def at(self, epochs: float, step: int) -> tuple[int, float]:
        if self.client is None:
            stage = [s for s in self.stages if s["from_epoch"] <= epochs + 1e-12][-1]
            self.batch, self.lr = stage["global_batch"], self.reference_lr * stage["lr_multiplier"]
        else:
            config = (self.client.advice or {}).get("config")
            if config and config["since_step"] != self.applied_since:
                self.applied_since = config["since_step"]
                if config.get("apply_by_step") is not None and step > config["apply_by_step"]:
                    self.stale.append((config["since_step"], step))  # it came after the step it paid by: kept
                else:
                    self.batch = config["device_batch"] * config["accumulation"]
                    self.lr = config["lr"]["value"] if config.get("lr") else self.lr
        if step < self.warmup_steps:  # linear from the reference LR to the first stage's
            return self.batch, self.reference_lr + (self.lr - self.reference_lr) * step / self.warmup_steps
        return self.batch, self.lr


class Replay(Arm):
    """The batch and LR changes of a run, at the same optimizer steps, without the client: what the online run's
    decisions are worth in time, apart from what its telemetry costs."""

    def __init__(self, changes: list[tuple[int, int, float]], reference_lr: float, warmup_steps: int):
        super().__init__([{"global_batch": changes[0][1], "lr_multiplier": changes[0][2] / reference_lr}], reference_lr, warmup_steps)
        self.changes = changes

    def at(self, epochs: float, step: int) -> tuple[int, float]:
        _, self.batch, self.lr = [c for c in self.changes if c[0] <= step][-1]
        if step < self.warmup_steps:
            return self.batch, self.reference_lr + (self.lr - self.reference_lr) * step / self.warmup_steps
        return self.batch, self.lr


def on_device(task: Task, seed: int, data: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The task's model for a seed (initialized on the CPU, as the ground truth's), on the device the data are on."""
    return task_model(task, seed).to(data["train_x"].device)


def synchronize(data: dict[str, torch.Tensor]) -> None:
    """Wait for the data's device, so that a timer read after it counts the kernels launched before it."""
    if data["train_x"].device.type == "cuda":
        torch.cuda.synchronize(data["train_x"].device)


def _set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def every_step_pieces(task: Task, batch: int) -> int:
    """Micro-batches every step of the task trains in, in every arm: a batch-norm task's (efficiency_tasks'
    micro_batched) as its ground truth trains, micro_batches(B), for batch norm normalizes each micro-batch by its
    own statistics, so a split only on the client's sampled steps would change what the model trains with (module
    docstring); 1 for the others, whose split gives the same gradient."""
    return micro_batches(batch) if task.micro_batched else 1


def client_accumulation(task: Task, batch: int) -> int:
    """The client's micro-batches on the steps it samples: the task's every-step split where there is one."""
    pieces = every_step_pieces(task, batch)
    return pieces if pieces > 1 else MICRO_BATCHES


def split_step(model, optimizer, inputs, targets, client: TulaRun | None, pieces: int = 1) -> float:
    """One optimizer step over MICRO_BATCHES micro-batches (the client's statistics need them; with a client, only
    on the steps it samples, the others whole), or over `pieces` on every step where that is more (a batch-norm
    task's: every_step_pieces); the loss, read once, as plain_step reads it. The client gets what
    TulaRun.step advises: on a GPU the loss tensor (a float before optimizer.step() would make the host wait for
    the GPU there), on a CPU the float the loop reads anyway (a second read, inside step(), cost 8-12 us a step
    in this loop: benchmarks/client_overhead.py)."""
    optimizer.zero_grad(set_to_none=True)
    pieces = max(pieces, MICRO_BATCHES if client is None or client.sampling else 1)
    if pieces == 1:  # a whole step as plain_step runs it: no chunk views, no division node in the graph
        total = mean_loss(model(inputs), targets)
        total.backward()
    else:
        losses = []
        for x, y in zip(inputs.chunk(pieces), targets.chunk(pieces)):
            loss = mean_loss(model(x), y) / pieces
            loss.backward()
            losses.append(loss.detach())
        total = torch.stack(losses).sum()
    total = total.detach()
    value = None if total.is_cuda else float(total)  # on a CPU read once, now
    if client is not None:
        client.step(loss=total if value is None else value)
    optimizer.step()
    return float(total) if value is None else value


def plain_step(model, optimizer, inputs, targets, pieces: int = 1) -> float:
    """One optimizer step on the whole batch, or in `pieces` micro-batches (a batch-norm task's every step)."""
    if pieces > 1:
        return split_step(model, optimizer, inputs, targets, None, pieces)
    optimizer.zero_grad(set_to_none=True)
    loss = mean_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def train_to_target(task: Task, data: dict[str, torch.Tensor], seed: int, arm: Arm, max_epochs: float, client: TulaRun | None = None,
                    model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:  # fmt: skip
    """Train until the target (module docstring); seconds of training, steps, epochs, and the (step, global batch,
    LR after warm-up) of each change."""
    model = model or on_device(task, seed, data)
    optimizer = optimizer or task_optimizer(task, model, arm.lr)
    stream = BatchStream(task.train_samples, torch.Generator().manual_seed(10_000 + seed))
    eval_samples = task.train_samples / EVALS_PER_EPOCH
    train_s, samples, step, next_eval, batches = 0.0, 0, 0, eval_samples, []
    outcome = "max_epochs"
    model.train()
    while samples < max_epochs * task.train_samples:
        started = time.perf_counter()
        batch, lr = arm.at(samples / task.train_samples, step)
        _set_lr(optimizer, lr)
        rows = stream.next(batch)
        inputs, targets = data["train_x"][rows], data["train_y"][rows]
        pieces = every_step_pieces(task, batch)
        loss = split_step(model, optimizer, inputs, targets, client, pieces) if client is not None else plain_step(model, optimizer, inputs, targets, pieces)
        synchronize(data)
        train_s += time.perf_counter() - started
        if not math.isfinite(loss):
            outcome = "diverged"
            break
        step, samples = step + 1, samples + batch
        if not batches or batches[-1][1:] != (batch, arm.lr):
            batches.append((step - 1, batch, arm.lr))
        if samples >= next_eval:
            next_eval += eval_samples
            if reached(task, evaluate(task, model, data)):
                outcome = "reached"
                break
    return {"seed": seed, "outcome": outcome, "train_s": train_s if outcome == "reached" else math.inf, "steps": step,
            "epochs": samples / task.train_samples, "batches": batches}  # fmt: skip


def online_run(task: Task, data, seed: int, server: str, job_id: str, rec: dict[str, Any], max_epochs: float) -> dict[str, Any]:
    run = httpx.post(f"{server}/v1/runs", json={"job_id": job_id, "min_steps_between_changes": MIN_STEPS_BETWEEN_CHANGES}, timeout=30)
    run_id = run.raise_for_status().json()["id"]
    model = on_device(task, seed, data)
    optimizer = task_optimizer(task, model, task_reference_lr(rec))
    accumulation = client_accumulation(task, rec["chosen"]["global_batch"])
    client = TulaRun(server, run_id, model, optimizer, every=EVERY, accumulation=accumulation, plan_every_s=PLAN_EVERY_S,
                     post_every_s=PLAN_EVERY_S, sample_every=SAMPLE_EVERY, overhead_budget=OVERHEAD_BUDGET)
    arm = Arm(static_stages(rec), task_reference_lr(rec), rec["training_advice"]["warmup"]["steps"], client)
    try:
        result = train_to_target(task, data, seed, arm, max_epochs, client=client, model=model, optimizer=optimizer)
    finally:
        client.close(flush_timeout_s=10)
    view = httpx.get(f"{server}/v1/runs/{run_id}", timeout=30).json()
    result["decisions"] = [{"step": d["step"], "from": d["from"]["global_batch"], "to": d["to"]["global_batch"]} for d in view.get("decisions", [])]
    result["records_sent"], result["failed_posts"] = client.sent, client.failed_posts
    result["stale_changes"] = [{"decided_at": decided, "arrived_at": arrived} for decided, arrived in arm.stale]
    result["client_overhead"] = client.overhead
    result["last_advice"] = advice_summary(client.advice)
    return result


def advice_summary(advice: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the run's last answer from GET /v1/runs/{id}/plan (the one the client held at the end) said and rested on:
    why it kept or moved the batch, where its noise scale came from, and how many of the run's records carried
    gradient statistics; None when no answer came during the run."""
    if not advice:
        return None
    evidence, predicted = advice.get("evidence") or {}, advice.get("predicted") or {}
    noise = evidence.get("noise_scale") or {}
    return {"step": advice.get("step"), "why": advice.get("why"), "moved": advice.get("change") is not None,
            "telemetry_records": evidence.get("telemetry_records"), "gradient_records": evidence.get("gradient_records"),
            "noise_scale": noise.get("value"), "noise_scale_from": evidence.get("noise_scale_from"),
            "noise_scale_why": evidence.get("noise_scale_why"), "gain": predicted.get("gain"), "saving": predicted.get("saving"),
            "best_global_batch": (predicted.get("best") or {}).get("global_batch")}  # fmt: skip


def task_reference_lr(rec: dict[str, Any]) -> float:
    return rec["training_advice"]["lr_rule"]["lr"]["reference_lr"]


def static_stages(rec: dict[str, Any]) -> list[dict[str, Any]]:
    rule = rec["training_advice"]["lr_rule"]
    return [{"from_epoch": 0.0, "global_batch": rec["chosen"]["global_batch"], "lr_multiplier": rule["lr"]["value"] / rule["lr"]["reference_lr"]}]


# -- telemetry overhead ---------------------------------------------------------------------------------


def overhead(task: Task, data, server: str, job_id: str, batch: int, lr: float) -> dict[str, float]:
    """Per-step seconds of plain steps, split steps, and steps with a TulaRun (posting, and offline), and the
    overhead ratios (module docstring)."""
    run_id = httpx.post(f"{server}/v1/runs", json={"job_id": job_id}, timeout=30).raise_for_status().json()["id"]
    # the same architecture: the same step cost; plain_again is plain once more, the measurement's own A/A difference
    # client_offline: the same client writing JSONL, without the sender thread (its posts and plan requests)
    models = {arm: on_device(task, 0, data) for arm in ("plain", "split", "client", "client_offline", "plain_again")}
    optimizers = {arm: task_optimizer(task, model, lr) for arm, model in models.items()}
    start = {name: tensor.clone() for name, tensor in models["plain"].state_dict().items()}
    offline_folder = tempfile.TemporaryDirectory(prefix="tula-online-offline-")
    options = {"every": EVERY, "accumulation": client_accumulation(task, batch), "sample_every": SAMPLE_EVERY, "overhead_budget": OVERHEAD_BUDGET}
    pieces = every_step_pieces(task, batch)
    clients = {"client": TulaRun(server, run_id, models["client"], optimizers["client"], plan_every_s=PLAN_EVERY_S,
                                 post_every_s=PLAN_EVERY_S, **options),
               "client_offline": TulaRun(None, run_id, models["client_offline"], optimizers["client_offline"],
                                         offline_path=Path(offline_folder.name) / "telemetry.jsonl", **options)}  # fmt: skip
    times: dict[str, list[float]] = {arm: [] for arm in models}
    try:
        for round_ in range(OVERHEAD_ROUNDS):
            order = list(models) if round_ % 2 == 0 else list(reversed(models))  # drift hits every arm alike
            for arm in order:  # every arm's round starts from the same weights and optimizer state, on the same batches
                model = models[arm]
                model.load_state_dict(start)
                optimizers[arm].state.clear()
                stream = BatchStream(task.train_samples, torch.Generator().manual_seed(1_000 + round_))
                synchronize(data)
                started = time.perf_counter()
                for _ in range(OVERHEAD_STEPS):
                    rows = stream.next(batch)
                    inputs, targets = data["train_x"][rows], data["train_y"][rows]
                    if arm in ("plain", "plain_again"):
                        plain_step(model, optimizers[arm], inputs, targets, pieces)
                    else:
                        split_step(model, optimizers[arm], inputs, targets, clients.get(arm), pieces)
                synchronize(data)
                times[arm].append((time.perf_counter() - started) / OVERHEAD_STEPS)
    finally:
        for client in clients.values():
            client.close(flush_timeout_s=5)
        offline_folder.cleanup()
    paired = {name: statistics.median(a / b for a, b in zip(times[num], times[den]))
              for name, num, den in (("overhead", "client", "plain"), ("split_cost", "split", "plain"))}  # fmt: skip
    return {**{f"{arm}_step_s": statistics.median(seconds) for arm, seconds in times.items()}, "client_estimate": clients["client"].overhead,
            "overhead_pct": 100 * (sum(times["client"]) / sum(times["plain"]) - 1), "overhead_median_round_pct": 100 * (paired["overhead"] - 1),
            "a_a_pct": 100 * (sum(times["plain_again"]) / sum(times["plain"]) - 1),
            "offline_pct": 100 * (sum(times["client_offline"]) / sum(times["plain"]) - 1),
            "offline_client_estimate": clients["client_offline"].overhead,
            "split_cost_pct": 100 * (paired["split_cost"] - 1),
            "overhead_ms_per_step": 1e3 * (sum(times["client"]) - sum(times["plain"])) / len(times["plain"])}  # fmt: skip


# -- the common clock -------------------------------------------------------------------------------------


def step_clock(task: Task, data, batches: set[int] | list[int], lr: float) -> dict[int, float]:
    """Seconds per plain step (data indexing, forward, backward, optimizer) at each global batch, timed in
    CLOCK_ROUNDS interleaved rounds of CLOCK_STEPS steps after one untimed step, every batch from the same weights
    and optimizer state, the order reversed every other round; the median over rounds (module docstring, 4)."""
    model = on_device(task, 0, data)
    optimizer = task_optimizer(task, model, lr)
    start = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    times: dict[int, list[float]] = {int(b): [] for b in batches}
    for round_ in range(CLOCK_ROUNDS):
        for batch in sorted(times, reverse=bool(round_ % 2)):
            model.load_state_dict(start)
            optimizer.state.clear()
            stream = BatchStream(task.train_samples, torch.Generator().manual_seed(2_000 + round_))
            rows, pieces = stream.next(batch), every_step_pieces(task, batch)
            plain_step(model, optimizer, data["train_x"][rows], data["train_y"][rows], pieces)  # untimed: the first step after a reset
            synchronize(data)
            started = time.perf_counter()
            for _ in range(CLOCK_STEPS):
                rows = stream.next(batch)
                plain_step(model, optimizer, data["train_x"][rows], data["train_y"][rows], pieces)
            synchronize(data)
            times[batch].append((time.perf_counter() - started) / CLOCK_STEPS)
    return {batch: statistics.median(seconds) for batch, seconds in times.items()}


def clock_seconds(run: dict[str, Any], clock: dict[int, float], extra_s_per_step: float = 0.0) -> float:
    """A run's time to the target on the common clock: sum over its stages of steps x seconds per step at the stage's
    batch, plus extra_s_per_step for every step (the client's measured cost); infinite for a run that missed."""
    if run["outcome"] != "reached":
        return math.inf
    starts = [int(change[0]) for change in run["batches"]]
    ends = starts[1:] + [int(run["steps"])]
    return sum((end - start) * (clock[int(change[1])] + extra_s_per_step) for change, start, end in zip(run["batches"], starts, ends))


def paired_ratio(runs: list[dict[str, Any]], static_runs: list[dict[str, Any]], clock: dict[int, float],
                 extra_s_per_step: float = 0.0) -> float | None:  # fmt: skip
    """The median over seeds of an arm's clock time / the static run's of the same seed (module docstring, 4);
    None when no seed's static run reached the target or the median is infinite."""
    static_by_seed = {run["seed"]: clock_seconds(run, clock) for run in static_runs}
    ratios = [clock_seconds(run, clock, extra_s_per_step) / static_by_seed[run["seed"]]
              for run in runs if math.isfinite(static_by_seed.get(run["seed"], math.inf))]  # fmt: skip
    if not ratios:
        return None
    ratio = statistics.median(ratios)
    return ratio if math.isfinite(ratio) else None


def truth_batches(truth: dict[str, Any]) -> list[int]:
    """The batches the ground truth reached the target at on most of the seeds it trained (their median epochs)."""
    return sorted(int(b) for b, row in truth["batches"].items() if row.get("epochs") and 2 * row.get("reached_seeds", 0) > row.get("seeds", 0))


def attainable(truth: dict[str, Any], clock: dict[int, float], static_batch: int) -> dict[str, Any] | None:
    """What choosing the batch can buy at all: the ground truth's fastest constant batch against the static pick's
    batch, each trained at its tuned LR, seconds to the target E(B) D / B x T_step(B) (E the truth's median epochs over
    seeds, T_step the common clock); None when the truth has no run at the static batch. A ratio near 1 says that no
    re-planning of a constant batch could beat the static run by much on this task; a schedule (a batch changed
    within the run) is not bounded by it."""
    seconds = {b: truth["batches"][str(b)]["epochs"] * truth["dataset_size"] / b * clock[b] for b in truth_batches(truth) if b in clock}
    if static_batch not in seconds:
        return None
    best = min(seconds, key=seconds.get)
    return {"best_batch": best, "ratio_vs_static_batch": seconds[best] / seconds[static_batch],
            "seconds_by_batch": {str(b): s for b, s in seconds.items()}}  # fmt: skip


def applied_changes(run: dict[str, Any]) -> list[str]:
    """The batch changes a run made, "from->to@step" (its stages; the server's decisions may come after the run ended)."""
    stages = run["batches"]
    return [f"{int(before[1])}->{int(after[1])}@{int(after[0])}" for before, after in zip(stages, stages[1:]) if int(before[1]) != int(after[1])]


def batches_trained(arms: dict[str, list[dict[str, Any]]]) -> set[int]:
    return {int(change[1]) for runs in arms.values() for run in runs for change in run["batches"]}


# -- the benchmark ----------------------------------------------------------------------------------------


def run_task(name: str, truth: dict[str, Any], server: str, seeds: int, evidence: str, device: str = "cpu") -> dict[str, Any]:
    task = TASKS[name]
    torch.set_num_threads(1)
    data = {key: tensor.to(device) for key, tensor in task_data(task).items()}
    started = time.monotonic()
    job_id, rec = recommendation(server, job_spec(task, truth, evidence, device))
    profile_s = time.monotonic() - started
    reference_lr, warmup_steps = task_reference_lr(rec), rec["training_advice"]["warmup"]["steps"]
    max_epochs = MAX_EPOCHS_FACTOR * truth["batches"][str(task.reference_batch)]["epochs"]
    schedule = rec["training_advice"]["batch_schedule"]
    arms: dict[str, list[dict[str, Any]]] = {"static": [], "online": []}
    for name_ in schedule["schedules"]:
        if name_ != "constant":
            arms[f"schedule:{name_}"] = []
    arms["online_replayed"] = []
    for seed in range(seeds):
        arms["static"].append(train_to_target(task, data, seed, Arm(static_stages(rec), reference_lr, warmup_steps), max_epochs))
        arms["online"].append(online_run(task, data, seed, server, job_id, rec, max_epochs))
        replay = Replay(arms["online"][-1]["batches"], reference_lr, warmup_steps)
        arms["online_replayed"].append(train_to_target(task, data, seed, replay, max_epochs))
        for arm in arms:
            if arm.startswith("schedule:"):
                stages = schedule["schedules"][arm.split(":", 1)[1]]["stages"]
                arms[arm].append(train_to_target(task, data, seed, Arm(stages, reference_lr, warmup_steps), max_epochs))
    medians = {arm: statistics.median(r["train_s"] for r in runs) for arm, runs in arms.items()}
    chosen = rec["chosen"]
    static_lr = reference_lr * static_stages(rec)[0]["lr_multiplier"]
    cost = overhead(task, data, server, job_id, chosen["global_batch"], static_lr)
    clock = step_clock(task, data, batches_trained(arms) | set(truth_batches(truth)), static_lr)
    client_s = max(0.0, cost["overhead_ms_per_step"] / 1e3)  # a negative measurement is the A/A noise: counted as zero
    clock_ratios = {arm: paired_ratio(runs, arms["static"], clock, client_s if arm == "online" else 0.0) for arm, runs in arms.items()}
    return {
        "task": name, "profile_s": profile_s, "chosen_batch": chosen["global_batch"], "lr": rec["training_advice"]["lr_rule"]["lr"]["value"],
        "noise_scale": rec["models"]["efficiency"]["noise_scale"]["value"], "evidence": rec["models"]["efficiency"]["evidence"]["used"],
        "recommended_schedule": schedule["recommended"],
        "schedule_why": schedule["why"], "predicted_schedule_s": {k: v["total_time_s"]["value"] for k, v in schedule["schedules"].items()},
        "median_train_s": medians,
        "wall_ratio_vs_static": {arm: (m / medians["static"] if math.isfinite(m) and math.isfinite(medians["static"]) else None)
                                 for arm, m in medians.items()},
        "ratio_vs_static": clock_ratios, "clock_s_per_step": {str(b): s for b, s in sorted(clock.items())},
        "runs": arms, "overhead": cost, "attainable": attainable(truth, clock, chosen["global_batch"]),
    }  # fmt: skip


def summary_line(results: list[dict[str, Any]]) -> str:
    ratios = [r["ratio_vs_static"]["online"] for r in results]
    finite = [x for x in ratios if x is not None]
    ratio = statistics.median(finite) if len(finite) == len(ratios) and finite else math.inf
    overhead_pct = statistics.median(r["overhead"]["overhead_pct"] for r in results)
    return f"online: tasks={len(results)} time_ratio_vs_static={ratio:.3f} overhead_pct={overhead_pct:.2f}"


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.{digits}g}"


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = ["# Online re-planning and batch schedules against the static recommendation (issue 17)", "",
             f"Made by `{meta['command']}` on {meta['date']} ({meta['machine']}); {meta['seeds']} seeds per arm, medians.",
             "Ratio vs static: the median over seeds of each run's time on the common clock over the static run's of the same "
             "seed (steps x seconds per step at their batch, timed in interleaved rounds; the online arm with the telemetry "
             "overhead added). Wall ratio: median wall seconds over seeds, against static's; the runs' own clocks, noisy "
             "by 10-30% on this shared machine.", "",
             "Changes applied: the batch changes the runs made (from->to@step, with the number of seeds that made it); advice "
             "that came after a run had ended is not among them.", "",
             "| task | evidence | chosen batch | B_noise | arm | ratio vs static | wall: median s to target | wall ratio | steps (median) | changes applied |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        for arm, runs in r["runs"].items():
            counted = collections.Counter(change for run in runs for change in applied_changes(run))
            changes = [change + (f" ({n} seeds)" if n > 1 else "") for change, n in counted.items()]
            lines.append(f"| {r['task']} | {r['evidence']} | {r['chosen_batch']} | {_fmt(r['noise_scale'])} | {arm} | {_fmt(r['ratio_vs_static'][arm])} | "
                         f"{_fmt(r['median_train_s'][arm])} | {_fmt(r['wall_ratio_vs_static'][arm])} | "
                         f"{statistics.median(run['steps'] for run in runs):g} | {', '.join(changes[:6]) or '-'} |")  # fmt: skip
    lines += ["", "Common clock, ms per plain step at each batch trained: "
              + "; ".join(f"{r['task']}: " + ", ".join(f"{b} {1e3 * s:.2f}" for b, s in r["clock_s_per_step"].items())
                          for r in results) + "."]  # fmt: skip
    lines += ["", "| task | recommended schedule | why | plain step ms | telemetry overhead % (ms a step) | offline client % | A/A % "
              "| splitting every step % | client's own estimate %, statistics on 2 steps in |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        cost = r["overhead"]
        own = cost.get("client_estimate") or {}
        estimate = f"{100 * own['fraction']:.2f}, {own['sample_every']}" + ("" if own["within_budget"] else " (over budget)") if own else "-"
        lines.append(f"| {r['task']} | {r['recommended_schedule']} | {r['schedule_why']} | {1e3 * cost['plain_step_s']:.2f} | "
                     f"{cost['overhead_pct']:.2f} ({cost['overhead_ms_per_step']:.3f}) | {cost['offline_pct']:.2f} | {cost['a_a_pct']:+.2f} | {cost['split_cost_pct']:.1f} | {estimate} |")  # fmt: skip
    lines += attainable_lines(results) + last_advice_lines(results)
    replayed = [r["ratio_vs_static"]["online_replayed"] for r in results]
    online_ratios = [r["ratio_vs_static"]["online"] for r in results]
    lines += ["", f"Online decisions replayed without telemetry, median ratio over tasks: {_fmt(statistics.median(x if x is not None else math.inf for x in replayed))}.",
              f"Online, the largest ratio over tasks: {_fmt(max(x if x is not None else math.inf for x in online_ratios))} (target: never above 1.02)."]  # fmt: skip
    if meta.get("plan_answers"):
        answers = meta["plan_answers"]
        lines += ["", f"The server's answers to the clients' GET /v1/runs/{{id}}/plan (every {PLAN_EVERY_S:g} s), by how they were made: "
                  + ", ".join(f"{how} {answers.get(how, 0):g}" for how in ("computed", "cached", "not_modified"))
                  + " (not_modified: the client's ETag was current, nothing re-planned; tula_service/runs/plan_cache.py)."]  # fmt: skip
    lines += ["", summary_line(results)]
    return "\n".join(lines) + "\n"


def attainable_lines(results: list[dict[str, Any]]) -> list[str]:
    """The table of attainable(): what a constant batch chosen with the ground truth's epochs would give."""
    rows = [r for r in results if r.get("attainable")]
    if not rows:
        return []
    lines = ["", "What choosing a constant batch can buy (`attainable`): the ground truth's fastest batch, each batch at its tuned "
             "LR, against the static pick's batch, seconds to the target = the truth's median epochs x D / B x the common "
             "clock's step (batches most seeds reached the target at). The online arm can only change the batch, so a "
             "ratio near 1 bounds what it can win by a constant batch; its runs train at the service's LR, not the tuned one.", "",
             "| task | static batch | truth's fastest batch | its time / the static batch's | online arm / static |", "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        a = r["attainable"]
        lines.append(f"| {r['task']} | {r['chosen_batch']} | {a['best_batch']} | {a['ratio_vs_static_batch']:.3f} | {_fmt(r['ratio_vs_static']['online'])} |")
    median = statistics.median(r["attainable"]["ratio_vs_static_batch"] for r in rows)
    lines += ["", f"Attainable by the batch alone, median over {len(rows)} tasks: {median:.3f} (the issue's target for the online arm: 0.85)."]
    return lines


def last_advice_lines(results: list[dict[str, Any]]) -> list[str]:
    """The table of the online runs' last advice (advice_summary): why the runs moved or stayed."""
    rows = [(r, [run["last_advice"] for run in r["runs"]["online"] if run.get("last_advice")]) for r in results]
    rows = [(r, advice) for r, advice in rows if advice]
    if not rows:
        return []
    lines = ["", "The online runs' last answer from GET /v1/runs/{id}/plan (the one each client held when its run ended): records "
             "with gradient statistics of all records sent, median over seeds; the noise scale's evidence (seeds); B_noise; "
             "and why, for the first seed.", "",
             "| task | records with statistics / all | noise scale from | B_noise (median) | why (first seed) |", "|---|---|---|---|---|"]  # fmt: skip
    for r, advice in rows:
        sources = collections.Counter(a["noise_scale_from"] for a in advice)
        noise = [a["noise_scale"] for a in advice if a["noise_scale"] is not None]
        lines.append(f"| {r['task']} | {statistics.median(a['gradient_records'] or 0 for a in advice):g} / "
                     f"{statistics.median(a['telemetry_records'] or 0 for a in advice):g} | "
                     + ", ".join(f"{source} ({n})" for source, n in sources.most_common())
                     + f" | {_fmt(statistics.median(noise) if noise else None)} | {advice[0]['why']} |")  # fmt: skip
    return lines


ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


MACHINE_CPUS = frozenset(os.sched_getaffinity(0))  # at import: what the process may use at all


@contextlib.contextmanager
def on_cpu(cpu: int):
    """This thread (and the processes and threads it starts meanwhile) on one CPU, when the machine has more than
    one; the affinity restored after. Nested: the inner CPU wins, whatever the outer one left."""
    before = os.sched_getaffinity(0)
    if cpu in MACHINE_CPUS and len(MACHINE_CPUS) > 1:
        os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def add_attainable(folder: Path, truth: dict[str, Any]) -> int:
    """--attainable-into: the common clock at each task's ground-truth batches, timed now (its own interleaved rounds, so
    the ratio is on one clock), and attainable() from it, written into the folder's online.json and online.md."""
    saved = json.loads((folder / "online.json").read_text())
    torch.set_num_threads(1)
    with on_cpu(TRAINING_CPU):
        for result in saved["results"]:
            name, task = result["task"], TASKS[result["task"]]
            clock = step_clock(task, task_data(task), truth_batches(truth[name]), result["lr"])
            result["attainable"] = attainable(truth[name], clock, result["chosen_batch"])
            if result["attainable"] is not None:
                result["attainable"]["clock_timed"] = dt.date.today().isoformat()
                print(f"{name}: static {result['chosen_batch']}, fastest {result['attainable']['best_batch']}, "
                      f"ratio {result['attainable']['ratio_vs_static_batch']:.3f}", flush=True)  # fmt: skip
    (folder / "online.json").write_text(json.dumps(saved, indent=1, default=str))
    (folder / "online.md").write_text(markdown(saved["results"], saved["meta"]))
    rows = [r["attainable"]["ratio_vs_static_batch"] for r in saved["results"] if r.get("attainable")]
    print(f"online_attainable: tasks={len(rows)} median_ratio={statistics.median(rows):.3f} min_ratio={min(rows):.3f}" if rows else "no task has a truth run at its static batch")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_SEEDS} seeds, output in a temporary folder")
    parser.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), choices=sorted(TASKS))
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--evidence", choices=("pilot", "reference_run"), default="pilot",
                        help="the static plan's noise-scale evidence: a pilot over PILOT_SHARE of the run, or the reference run's trajectory")
    parser.add_argument("--out", type=Path, default=None, help="folder for online.md and online.json")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the runs train and the server profiles")
    parser.add_argument("--attainable-into", type=Path, default=None, metavar="DIR",
                        help="time only the common clock at the ground truth's batches for the tasks of DIR/online.json, and add "
                             "what a constant batch can buy (attainable) to it and to DIR/online.md; trains nothing")  # fmt: skip
    args = parser.parse_args(argv)
    if args.attainable_into is not None:
        return add_attainable(args.attainable_into, json.loads(GROUND_TRUTH.read_text())["tasks"])
    seeds = args.seeds or (QUICK_SEEDS if args.quick else SEEDS)
    out = args.out or (Path(tempfile.mkdtemp(prefix="tula-online-")) if args.quick else REPO / "docs" / "validation")
    out.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device on this machine")
    truth = json.loads(GROUND_TRUTH.read_text())["tasks"]
    machine = f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread"
    if args.device == "cuda":
        machine += f", {torch.cuda.get_device_name(0)}"
    meta = {"command": "benchmarks/online.py" + (" --quick" if args.quick else "") + f" --evidence {args.evidence} --device {args.device}",
            "date": dt.date.today().isoformat(), "machine": machine, "seeds": seeds}  # fmt: skip
    results = []
    server_log = Path(tempfile.mkdtemp(prefix="tula-online-server-")) / "server.log"  # never into the tracked docs
    env = dict(ONE_THREAD)
    if any(TASKS[name].dataset == "stdlib_bytes" for name in args.tasks):  # the GPT's text, a token_file the server may read
        env["TULA_DATA_ROOTS"] = str(write_stdlib_token_file().parent)
    with on_cpu(SERVER_CPU), api_server(None, server_log, executor="local", env=env) as (server, _), on_cpu(TRAINING_CPU):
        for name in args.tasks:
            result = run_task(name, truth[name], server, seeds, args.evidence, args.device)
            results.append(result)
            (out / "online.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
            (out / "online.md").write_text(markdown(results, meta))
            print(f"{name}: chosen {result['chosen_batch']}, ratio vs static {json.dumps({k: _fmt(v) for k, v in result['ratio_vs_static'].items()})} "
                  f"(wall {json.dumps({k: _fmt(v) for k, v in result['wall_ratio_vs_static'].items()})}), "
                  f"overhead {result['overhead']['overhead_pct']:.2f}% (offline {result['overhead']['offline_pct']:.2f}%, A/A {result['overhead']['a_a_pct']:+.2f}%)", flush=True)  # fmt: skip
        meta["plan_answers"] = plan_answers(server)
        (out / "online.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
        (out / "online.md").write_text(markdown(results, meta))
    print(f"plan answers (GET /v1/runs/{{id}}/plan, the server's /metrics): {json.dumps(meta['plan_answers'])}")
    print(f"wrote {out / 'online.md'} (server log: {server_log})")
    print(summary_line(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
