"""The pilot point: train the job's model at the reference batch for a bounded budget and record
gradient statistics along the way (the noise scale grows 10-1000x as the loss falls; McCandlish et
al. 2018, Sec. 3), so that the efficiency model can read B_noise from training, not from step 0.

Training: the spec's optimizer at `lr` (training.reference_lr; else the 0.01 the compute points use,
labelled "assumed"), with a linear warm-up lr_t = lr * min(1, (t + 1) / W) over the first
W = min(10% of pilot_steps, 50) steps (or `warmup_steps` when the request gives one), on batches of the
job's dataset, seeded. It stops at the first of: `pilot_steps` optimizer steps, `pilot_seconds` of
training wall time, a settled estimate (`settled`), or a non-finite loss ("diverged": data, not a crash).

Gradient statistics at no extra forward pass: each step's batch B is split into k micro-batches of
b = B / k samples (profiling.grad_microbatches, b >= 2), whose mean gradient is the step's gradient
(accumulation). Per step, the two-batch estimator (`profiler.gradstats.two_batch_estimates`) gives
unbiased |G|^2 and tr(Sigma); a record averages them over `pilot_record_every` steps, numerator and
denominator separately, so B_simple = trace_sigma / grad_sqr of a record is a pooled ratio, never a
mean of per-step ratios. For Adam, AdamW, RMSprop, NAdam, RAdam, Adamax, Adagrad and Adafactor the same pair is estimated for the preconditioned gradient
P g, P = diag(1 / (sqrt(v) + eps)) with v the optimizer's second moment as the step divides by it (Adafactor's: its
relative step over the root of its factored second moment), the step's own
gradient folded in (profiler.preconditioner.coming_step_denominators), one P for all micro-batches and the full
gradient of the step: the micro-batches' squares are summed per coordinate, then weighed by P^2 once the step's
gradient is known. (P read before the step counted a coordinate whose second moment was still 0, a unit that had not
yet had a gradient, at 1 / eps: a record's preconditioned noise scale reached 1e9 on the digits MLP under Adamax.) The
first step has no v yet, so its precond estimates are missing from the first record.

LR stability: after the last step, the stability headroom (2 + 2 beta) / (eta lambda_max) (profiler.sharpness) on
one fixed batch of the reference batch's size, in full precision, goes into the last record as
"stability_headroom", with its LR as "stability_lr" (and the pilot's "stability" says how it was measured). It runs after the budget, and
costs about 40 backward passes of that batch. A pilot sees the start of the
run, where the sharpness is still rising. Its optimizer has the spec's settings (training.momentum, nesterov, dampening, betas,
eps, alpha, centered, amsgrad, weight_decay, momentum_decay, decoupled_weight_decay; PyTorch's defaults where not
given, but SGD's momentum 0.9, as every profiling point), reported with their sources as "optimizer_settings". They set the threshold: (2 + 2 beta) / eta
halves from beta 0.9 to plain SGD, so a plain-SGD job that leaves momentum out is told about twice its headroom;
Nesterov's is (2 + 2 beta) / ((1 + 2 beta) eta); RMSprop's is the heavy ball's on the preconditioned Hessian; Adam's,
AdamW's and Adamax's is (2 + 2 beta1) (1 - beta1^t) / ((1 - beta1) eta) for the coming step t; Adagrad's gradient descent's
2 (1 + (t - 1) lr_decay) / eta on its preconditioned Hessian, Adafactor's 2 / eta on its own; NAdam's and RAdam's are
those of their coming step (NAdam's from its momentum schedule, RAdam's from its rectification; none in RAdam's first,
un-preconditioned steps); the preconditioner is the coming step's, the gradient at the point folded in; SGD's dampening d divides the heavy ball's by 1 - d; coupled weight
decay adds weight_decay to the Hessian (profiler.sharpness). A measurement that fails (out of memory: the double backward
needs more than a training step; a model without second derivatives) is reported, not raised.

Records follow the shared gradient-statistics contract (`tula_service.spec.job_spec.GradientStatsRecord`).
"""

from __future__ import annotations

import math
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from models.workload import build_workload
from profiler.gradstats import GradientNoiseEstimator, two_batch_estimates
from profiler.measure import (
    MIN_MICRO_BATCH,
    SCHEMA_VERSION,
    Trainer,
    apply_threads,
    host_load,
    is_out_of_memory,
    make_optimizer,
    optimizer_settings_used,
    pick_device,
)
from profiler.memory import apply_memory_limit
from profiler.preconditioner import coming_step_denominators, is_adaptive
from profiler.sharpness import stability_headroom

DEFAULT_LR = 0.01  # what the compute points train with when the spec gives no reference_lr
WARMUP_FRACTION = 0.10
WARMUP_MAX_STEPS = 50
SETTLE_RECORDS = 3
SETTLE_TOLERANCE = 0.10


def warmup_steps_for(pilot_steps: int) -> int:
    """W = min(10% of the step budget, 50): long enough to pass Adam's and momentum's first noisy
    steps, short against the budget."""
    return min(int(WARMUP_FRACTION * pilot_steps), WARMUP_MAX_STEPS)


def warmup_lr(lr: float, step: int, warmup_steps: int) -> float:
    """Linear warm-up (Goyal et al. 2017, Sec. 2.2): lr_t = lr * min(1, (t + 1) / W), t counted from 0."""
    if warmup_steps <= 0:
        return lr
    return lr * min(1.0, (step + 1) / warmup_steps)


def split_batch(batch: int, requested_microbatches: int) -> tuple[int, int]:
    """(k, b): the most micro-batches k <= requested that divide `batch` into b >= MIN_MICRO_BATCH
    samples each (batch norm needs two values per channel). When no k >= 2 divides it, the requested
    k (or fewer) with b = batch // k, dropping the remainder: the record's `batch` says k * b."""
    if batch < 2 * MIN_MICRO_BATCH:
        raise ValueError(
            f"the pilot needs a reference batch of at least {2 * MIN_MICRO_BATCH} samples (two micro-batches of "
            f"{MIN_MICRO_BATCH}) for gradient statistics; training.reference_batch is {batch}"
        )
    most = max(2, min(int(requested_microbatches), batch // MIN_MICRO_BATCH))
    for k in range(most, 1, -1):
        if batch % k == 0:
            return k, batch // k
    return most, batch // most


def noise_scale(record: dict[str, Any]) -> float | None:
    """B_simple = trace_sigma / grad_sqr of a record; None while |G|^2 is not resolved (<= 0)."""
    return record["trace_sigma"] / record["grad_sqr"] if record["grad_sqr"] > 0 else None


@dataclass
class StepStats:
    """One optimizer step's gradient statistics (squared norms already unscaled)."""

    loss: float
    grad_sqr: float
    trace_sigma: float
    full_norm: float
    precond_grad_sqr: float | None = None
    precond_trace_sigma: float | None = None


@dataclass
class Window:
    """The steps since the last record; `record` pools them into one contract record."""

    steps: list[StepStats] = field(default_factory=list)
    variability: list[float] = field(default_factory=list)

    def add(self, stats: StepStats, previous_norm: float | None) -> None:
        self.steps.append(stats)
        if previous_norm is not None and previous_norm > 0:
            self.variability.append(abs(stats.full_norm - previous_norm) / previous_norm)

    def record(self, *, samples: int, batch: int, step: int) -> dict[str, Any]:
        precond = [s for s in self.steps if s.precond_grad_sqr is not None]
        return {
            "samples": samples,
            "batch": batch,
            "grad_sqr": float(np.mean([s.grad_sqr for s in self.steps])),
            "trace_sigma": float(np.mean([s.trace_sigma for s in self.steps])),
            "loss": float(np.mean([s.loss for s in self.steps])),
            "metric": None,
            "step": step,
            "window_steps": len(self.steps),
            "variability": float(np.median(self.variability)) if self.variability else None,
            "precond_grad_sqr": float(np.mean([s.precond_grad_sqr for s in precond])) if precond else None,
            "precond_trace_sigma": float(np.mean([s.precond_trace_sigma for s in precond])) if precond else None,
        }


def pooled_rel_stderr(steps: list[StepStats]) -> float | None:
    """Relative standard error of B_simple pooled over these steps, mean(tr Sigma) / mean(|G|^2), by the
    delta method (`GradientNoiseEstimator.noise_scale_stderr`); None when it is not resolved."""
    estimator = GradientNoiseEstimator(true_sq=[s.grad_sqr for s in steps], trace=[s.trace_sigma for s in steps])
    stderr = estimator.noise_scale_stderr()
    ratio = float(np.mean(estimator.trace)) / float(np.mean(estimator.true_sq)) if steps else 0.0
    return stderr / ratio if stderr is not None and ratio > 0 else None


def settled(records: list[dict[str, Any]], record_steps: list[list[StepStats]], warmup_steps: int) -> bool:
    """The settle rule, on the last SETTLE_RECORDS records taken wholly after the warm-up
    (`record_steps[i]` are the steps record i pools):

        1. each resolves B_simple = trace_sigma / grad_sqr > 0;
        2. B_simple moved by less than SETTLE_TOLERANCE in total across them:
           sum_i |B_i - B_(i-1)| / B_first < 0.10 (2 changes over 3 records; summing the changes means
           an estimate that swings up and back is not settled);
        3. that change is resolvable: B_simple pooled over their steps has a relative standard error
           (delta method) below SETTLE_TOLERANCE too.

    Without 3, noise alone fires the rule: on cnn1d / MNIST-1D with Adam, 10-step windows read B_simple
    1703, 118, 124, 129, 164 in a row, and three agreeing by chance stopped the pilot at 120 of 300
    steps. With it, the rule fires where the estimate is both steady and precise (a constant noise
    scale, or a late, slowly moving one), and otherwise the step or time budget ends the pilot."""
    eligible = [i for i, r in enumerate(records) if r["step"] - r["window_steps"] >= warmup_steps]
    if len(eligible) < SETTLE_RECORDS:
        return False
    last = eligible[-SETTLE_RECORDS:]
    scales = [noise_scale(records[i]) for i in last]
    if any(s is None or s <= 0 for s in scales):
        return False
    total_change = sum(abs(b - a) for a, b in zip(scales, scales[1:])) / scales[0]
    rel_stderr = pooled_rel_stderr([step for i in last for step in record_steps[i]])
    return total_change < SETTLE_TOLERANCE and rel_stderr is not None and rel_stderr < SETTLE_TOLERANCE


def _sq_norm(grads: list[torch.Tensor | None], weights: list[torch.Tensor | None] | None = None, squared: bool = False) -> float:
    """sum |g|^2 over the parameters, or sum |P g|^2 with weights = P^2; a missing gradient counts 0. squared: the
    tensors hold g^2 already (_add_square's sums)."""
    weights = weights if weights is not None else [None] * len(grads)
    pairs = [(g, w) for g, w in zip(grads, weights) if g is not None]
    return float(sum(((g.float() if squared else g.float().square()) * (1 if w is None else w)).sum() for g, w in pairs))


def _add_square(total: torch.Tensor | None, grad: torch.Tensor | None) -> torch.Tensor | None:
    """total + grad^2 (float32), per coordinate: the micro-batches' squares, which this step's P weighs once it is known."""
    if grad is None:
        return total
    square = grad.float().square()
    return square if total is None else total.add_(square)


def accumulated_step(trainer: Trainer, inputs, targets, microbatches: int, micro_batch: int, precondition: bool) -> StepStats | None:
    """Forward and backward k micro-batches, set the step's gradient to their mean, and step.
    Raises FloatingPointError on a non-finite loss or gradient; with fp16 loss scaling an inf
    gradient is the scaler's business instead (it skips the step and lowers its scale): None."""
    model, optimizer = trainer.model, trainer.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    scale_sq = trainer.grad_scale**2
    summed: list[torch.Tensor | None] = [None] * len(params)
    square_sums: list[torch.Tensor | None] = [None] * len(params)  # sum over micro-batches of g_b^2, per coordinate
    micro_sq, losses = [], []
    for index in range(microbatches):
        piece = slice(index * micro_batch, (index + 1) * micro_batch)
        optimizer.zero_grad(set_to_none=True)
        loss = trainer.loss(inputs[piece], targets[piece])
        trainer.backward(loss)
        losses.append(float(loss.detach()))
        grads = [p.grad.detach().clone() if p.grad is not None else None for p in params]
        micro_sq.append(_sq_norm(grads) / scale_sq)
        if precondition:
            square_sums = [_add_square(total, g) for total, g in zip(square_sums, grads)]
        summed = [g if total is None else (total if g is None else total.add_(g)) for total, g in zip(summed, grads)]
    step_loss = float(np.mean(losses))
    if not math.isfinite(step_loss):
        raise FloatingPointError(f"the training loss is {step_loss}")
    full = [None if total is None else total.div_(microbatches) for total in summed]
    full_sq = _sq_norm(full) / scale_sq
    micro_precond_sq = full_precond_sq = None
    if precondition and math.isfinite(full_sq):  # P of this step (profiler.preconditioner.coming_step_denominators)
        scale = math.sqrt(scale_sq)
        denominators = coming_step_denominators(optimizer, params, [None if g is None else g / scale for g in full])
        kept = [i for i, d in enumerate(denominators) if d is not None]  # a param without a second moment yet: left out
        if kept:
            weights = [denominators[i].reciprocal().square() for i in kept]  # P^2
            micro_precond_sq = _sq_norm([square_sums[i] for i in kept], weights, squared=True) / scale_sq / microbatches
            full_precond_sq = _sq_norm([full[i] for i in kept], weights) / scale_sq
    for param, grad in zip(params, full):
        param.grad = grad  # the step's gradient: the mean of the micro-batch gradients
    if not math.isfinite(full_sq) or not all(map(math.isfinite, micro_sq)):
        if trainer.scaler is None:
            raise FloatingPointError(f"the gradient's squared norm is {full_sq}")
        trainer.step()  # the scaler skips this step and lowers its scale
        return None
    trainer.step()
    batch = micro_batch * microbatches
    grad_sqr, trace_sigma = two_batch_estimates(micro_sq, full_sq, micro_batch, batch)
    stats = StepStats(step_loss, grad_sqr, trace_sigma, math.sqrt(full_sq))
    if full_precond_sq is not None:
        stats.precond_grad_sqr, stats.precond_trace_sigma = two_batch_estimates([micro_precond_sq], full_precond_sq, micro_batch, batch)
    return stats


def measure_stability(trainer: Trainer, workload, batch: int, seed: int) -> dict[str, Any]:
    """The stability headroom at the pilot's last weights (module docstring): on one batch drawn with its own
    seed, fp32 (no autocast, no loss scaling); a failure is reported as data."""
    inputs, targets = trainer.to_device(*workload.data.batch(batch, torch.Generator().manual_seed(seed + 1)))
    how = {"batch": batch, "method": "power iteration on Hessian-vector products (profiler.sharpness), fp32"}
    try:
        measured = stability_headroom(lambda: workload.loss_fn(trainer.model(inputs), targets), list(trainer.model.parameters()), trainer.optimizer)
    except Exception as error:  # noqa: BLE001 - an OOM or a missing second derivative is data, not a failed pilot
        if trainer.device.type == "cuda":
            torch.cuda.empty_cache()
        return {**how, "error": f"{type(error).__name__}: {str(error)[:300]}"}
    if measured is None:
        return {**how, "error": "no stability threshold known for this optimizer, or no positive curvature at these weights"}
    return {**how, **measured}


def run_pilot(request: dict[str, Any]) -> dict[str, Any]:
    """Train at request["batch_size"] (the reference batch) and return the pilot measurement; see
    `tula_service.dispatch.jobs.pilot_request` for the request's keys."""
    threads = apply_threads(request)
    device = pick_device(request.get("device", "auto"))
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    lr_given = request.get("lr")
    lr = float(lr_given) if lr_given is not None else DEFAULT_LR
    pilot_steps = int(request.get("pilot_steps", 300))
    warmup_given = request.get("warmup_steps")
    warmup = int(warmup_given) if warmup_given is not None else warmup_steps_for(pilot_steps)
    optimizer_name = request.get("optimizer", "sgd")
    # what the pilot's optimizer trains with: the request's settings, PyTorch's defaults for the rest (an optimizer
    # built on a stand-in parameter: the model is not loaded yet)
    settings = optimizer_settings_used(make_optimizer(optimizer_name, [torch.zeros(1, requires_grad=True)], lr, request.get("optimizer_settings")),
                                       request.get("optimizer_setting_sources"))  # fmt: skip
    base = {
        "schema_version": SCHEMA_VERSION,
        "kind": "pilot",
        "batch_size": int(request["batch_size"]),
        "optimizer": optimizer_name,
        "optimizer_settings": settings,
        "initial_weights": request.get("initial_weights"),  # the spec's checkpoint it started from; None: the seeded init
        "lr": {"value": lr, "source": request.get("lr_source", "spec" if lr_given is not None else "assumed")},
        "warmup": {
            "steps": warmup,
            "shape": "linear: lr_t = lr * min(1, (t + 1) / steps)",
            "source": "spec" if warmup_given is not None else "assumed: min(10% of pilot_steps, 50)",
        },
        "warmup_steps": warmup,
        "threads": threads,
        "threads_source": "spec" if request.get("threads") else "torch default",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch_version": torch.__version__,
        "settle_rule": (
            f"stop when the last {SETTLE_RECORDS} records after the warm-up have B_simple > 0, "
            f"sum |B_i - B_(i-1)| / B_first < {SETTLE_TOLERANCE:g}, and B_simple pooled over their steps "
            f"has a relative standard error < {SETTLE_TOLERANCE:g}"
        ),
    }
    run: dict[str, Any] = {"trajectory": []}
    try:
        record = {**base, "status": "ok", **_train(request, device, lr, warmup, run)}
    except Exception as error:  # noqa: BLE001 - an OOM is data; anything else is re-raised
        if not is_out_of_memory(error):
            raise
        record = {**base, "status": "oom", "error": f"{type(error).__name__}: {str(error)[:500]}", **run}
    record["elapsed_s"] = time.perf_counter() - started
    record["host_load"] = host_load(load_before)
    return record


def _train(request: dict[str, Any], device: torch.device, lr: float, warmup: int, run: dict[str, Any]) -> dict[str, Any]:
    """The training loop; `run["trajectory"]` fills as records are taken (kept when an OOM ends it)."""
    reference_batch = int(request["batch_size"])
    pilot_steps = int(request.get("pilot_steps", 300))
    pilot_seconds = float(request.get("pilot_seconds", 30.0))
    record_every = int(request.get("pilot_record_every", 10))
    microbatches, micro_batch = split_batch(reference_batch, int(request.get("grad_microbatches", 4)))
    step_batch = microbatches * micro_batch
    seed = int(request.get("seed", 0))
    torch.manual_seed(seed)
    workload = build_workload(request)
    trainer = Trainer(workload, {**request, "lr": lr}, device)
    trainer.model.train()
    limit = apply_memory_limit(request.get("memory_limit_bytes"), device)
    data_gen = torch.Generator().manual_seed(seed)
    precondition = is_adaptive(trainer.optimizer)  # the optimizer built, not a second list of names

    trajectory = run["trajectory"]
    record_steps: list[list[StepStats]] = []  # the steps each record pools, for the settle rule
    window = Window()
    previous_norm: float | None = None
    steps = 0
    stopped_by = "steps"
    train_started = time.perf_counter()
    while True:
        if steps >= pilot_steps:
            stopped_by = "steps"
            break
        if time.perf_counter() - train_started >= pilot_seconds:
            stopped_by = "seconds"
            break
        for group in trainer.optimizer.param_groups:
            group["lr"] = warmup_lr(lr, steps, warmup)
        inputs, targets = trainer.to_device(*workload.data.batch(step_batch, data_gen))
        try:
            stats = accumulated_step(trainer, inputs, targets, microbatches, micro_batch, precondition)
        except FloatingPointError as error:
            stopped_by = "diverged"
            run["diverged"] = {"step": steps + 1, "reason": str(error)}
            break
        steps += 1
        if stats is not None:
            window.add(stats, previous_norm)
            previous_norm = stats.full_norm
        if steps % record_every == 0 and window.steps:
            trajectory.append(window.record(samples=steps * step_batch, batch=step_batch, step=steps))
            record_steps.append(window.steps)
            window = Window()
            if settled(trajectory, record_steps, warmup):
                stopped_by = "settled"
                break
    train_seconds = time.perf_counter() - train_started
    if window.steps:  # the partial window the budget cut short
        trajectory.append(window.record(samples=steps * step_batch, batch=step_batch, step=steps))
    stability = measure_stability(trainer, workload, step_batch, seed) if trajectory and "diverged" not in run else None
    if stability and stability.get("stability_headroom"):
        trajectory[-1]["stability_headroom"], trajectory[-1]["stability_lr"] = stability["stability_headroom"], stability["lr"]
    return {
        "steps": steps,
        "samples": steps * step_batch,
        "train_seconds": train_seconds,
        "stopped_by": stopped_by,
        "trajectory": trajectory,
        **({"diverged": run["diverged"]} if "diverged" in run else {}),
        "budget": {"steps": pilot_steps, "seconds": pilot_seconds, "record_every": record_every},
        "gradient": {
            "estimator": "two-batch (McCandlish et al. 2018, App. A.1) over the step's micro-batches, "
            "numerator and denominator averaged over each record's window",
            "micro_batches": microbatches,
            "micro_batch": micro_batch,
            "step_batch": step_batch,
            "preconditioned": "the optimizer's second moment as the step divides by it, its gradient folded in (profiler.preconditioner)" if precondition else None,
        },
        "stability": stability,
        "options": {"dtype": request.get("dtype", "fp32"), "channels_last": bool(request.get("channels_last", False))},
        "memory_limit": limit,
        "workload": {"model": request["model"], "dataset": request["dataset"].get("name")},
    }
