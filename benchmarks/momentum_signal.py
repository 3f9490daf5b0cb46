"""Does the momentum-smoothed gradient, or the Hessian-weighted noise scale, explain the noise scale the tasks
miss? (issue 13)

On the CPU tasks of benchmarks/efficiency_tasks.py the service's noise scale (the progress-weighted mean of
B_simple = tr(Sigma) / |G|^2 over the second half of the reference run) is 1.6-3.4x below the best single
B_noise for the measured epochs on three tasks, and right on others (docs/validation/statistical_efficiency/
report.md, "What the ground truth allows"). A momentum optimizer steps along the exponential moving average of
the gradients, e_t = beta e_{t-1} + (1 - beta) g_t (bias-corrected), in which the components of G that flip
sign from step to step (the high-curvature directions) cancel. The hypothesis tested here: the signal that
counts is that persistent part, so

    B_smoothed = tr(Sigma) / |E e_t|^2,   |E e_t|^2 ~ |e_t|^2 - c_t tr(Sigma) / B,
    c_t = (1 - beta)^2 sum_{j<t} beta^(2j) / (1 - beta^t)^2      (-> (1 - beta) / (1 + beta)),

the EMA's share of the independent per-step noise tr(Sigma) / B. With beta = 0 it is B_simple. Both are read
over the same records with the service's estimator (noise_trajectory.progress_weighted_ratio over the second
half of the run); for Adam/AdamW on the preconditioned gradient P g and P e_t (beta = beta1).

Each task's reference run is trained again here as the ground truth trained it (seed 0, B_ref, the LR tuned
there, split into micro-batches: efficiency_tasks.accumulation_step) until it reaches the target. The test
passes if B_smoothed / B_simple tracks the factor each task needs (best B_noise / the service's), i.e. a
rank correlation near 1 and B_smoothed nearer the best B_noise than B_simple on most tasks.

Measured 2026-12-01 (full run, 5 tasks, 29 s): B_smoothed / B_simple is 4.0-23.7x where the tasks need
0.50-3.44x; on the four CNN/MLP tasks its order follows the needed factor's (4.0, 6.3, 19.1, 23.7 against
0.95, 1.62, 2.95, 3.44), but the GPT (AdamW, needs 0.50) gets 20.2x, so the rank correlation is 0.40, and
B_smoothed is further from the best B_noise than B_simple on every task (median |log error| 2.15 against
0.80). The service does not use it. (A one-off variant, the cross term G . e_t, gave 8-16x on three SGD
tasks: no better.)

The second hypothesis is McCandlish et al.'s own definition (2018, eq. 2.7): the critical batch follows
the Hessian-weighted noise scale, not B_simple,

    B_hessian = tr(H Sigma) / (G^T H G),

which B_simple equals only when the Hessian is a multiple of the identity. Its two-batch estimate is the
same as B_simple's with the quadratic form q(v) = v^T H v in place of |v|^2 (E q(g_b) = q(G) + tr(H Sigma) / b),
with H v a Hessian-vector product (double backward) of the loss on an independent batch of HESSIAN_BATCH
training samples, at the weights before the step. For Adam/AdamW the update is P g, so q(v) = (P v)^T H (P v)
(P from the optimizer state before the step; the first step has none and is skipped).

Measured 2026-12-02 (full run; 4 tasks, the GPT's CPU attention kernel has no double backward), both read
with the service's progress-weighted mean over the second half: B_hessian / B_simple is 0.63
(mnist1d_cnn1d_adam, needs 3.44), 0.69 (mnist1d_mlp_sgd, needs 2.95), 1.11 (digits_mlp_sgd, needs 1.62) and
1.15 (digits_cnn_sgd, needs 0.95): its order is the reverse of the needed factor's (rank correlation -1.00),
nearer the best B_noise than B_simple on 1 task of 4 (median |log error| 0.83 against 0.80 for B_simple). (A
one-off variant, the sums of each over the second half divided, gave 0.04-0.53: no better.) The tasks that
need a larger noise scale have their noise in flatter directions, not steeper. The service does not use it.

Measured again 2026-12-05 on the re-tuned ground truth (all 14 tasks, 4 min; a task whose B_simple or B_hessian
is not resolved is shown as '-' and left out): `momentum_signal: tasks=13 rank_correlation=0.47
smoothed_nearer_best=3 simple_median_abs_log_err=0.55 smoothed_median_abs_log_err=1.70 hessian_rank_correlation=-0.05
hessian_nearer_best=4 hessian_median_abs_log_err=0.61`: neither explains the misses on the better truth either.

The third hypothesis (2026-12-05, last): the |G|^2 a run measures holds, besides the gradient that makes progress,
the gradient of the weights' fluctuation about the valley floor that SGD's own noise keeps up. Near a minimum, SGD
with LR eta and heavy-ball momentum beta holds the weights at a covariance C ~ eta_eff H^-1 Sigma / (2 B), eta_eff =
eta / (1 - beta) (the small-step limit of the stationary Lyapunov equation, H and Sigma commuting), so that
E|H d theta|^2 = tr(H C H) ~ eta_eff tr(H Sigma) / (2 B): a share of |G|^2 that grows with the LR and does not move the
loss down. What is left is the signal:

    B_stationary = tr(Sigma) / (|G|^2 - eta_eff tr(H Sigma) / (2 B)),

tr(H Sigma) from the Hessian-weighted estimates above, eta the step's scheduled LR, read over the same records
with the same estimator. SGD only (Adam's step is preconditioned, and its eta_eff is another matter); nothing is
fitted. If it held, the momentum tasks' reads, taken at larger effective LRs, would rise towards their critical batch.

Measured 2026-12-05 (full run, 15 tasks with the GRU under SGD, 18 min; the GRU now has its Hessian-vector products
too): `momentum_signal: tasks=14 rank_correlation=0.45 smoothed_nearer_best=4 simple_median_abs_log_err=0.69
smoothed_median_abs_log_err=1.56 hessian_rank_correlation=0.13 hessian_nearer_best=6 hessian_median_abs_log_err=0.61
stationary_tasks=2 stationary_nearer_best=0 stationary_median_abs_log_err=2.13 simple_there=0.37`. The fluctuation
the formula subtracts is larger than the whole |G|^2 measured on five of the seven SGD tasks with Hessians (every
momentum task among them: the small-step premise fails where eta_eff lambda is of order one), so B_stationary is not
resolved there; on the two plain-SGD tasks where it is, it reads 4.5x and 7.5x B_simple where they need 0.70x and
1.11x. It overshoots as the EMA did. The service does not use it. (On the GRU under SGD, B_hessian is 1.63x B_simple,
nearer the best B_noise, 7.6x; one task.)

The fourth hypothesis (2026-12-06): the noise scale the user's own LR implies. On the quadratic model along the
gradient (McCandlish et al. 2018, sec. 2.2, eqs. 2.5-2.6) the best step at batch B is eps_opt(B) = eps_max /
(1 + B_noise / B), eps_max = |G|^2 / (G^T H G) the best step without noise. If the reference LR is the best at
B_ref (what EpochModel assumes of it, x_ref), the step it takes, eps_ref = eta / (1 - beta) for heavy-ball momentum
beta, gives

    B_lr = B_ref (eps_max / eps_ref - 1),

from the curvature along the gradient (the same two-batch G^T H G as B_hessian; |G|^2 and G^T H G summed over the
second half, then divided) and the LR, with no tr(Sigma) at all: the user's tuning would carry the noise scale.
SGD only (Adam's step is preconditioned). It needs eps_ref below eps_max. Measured 2026-12-06 on the 8 SGD tasks
with Hessians (the GRU aside, 2 min): eps_max / eps_ref is 0.21-1.17 (median 0.41): the reference runs step at or
past the best noise-free step along the gradient, as at the edge of stability (Cohen et al. 2021), so B_lr is
negative on five tasks and 1.5-5.4 on the other three, where the best B_noise is 160-1545 (`lr_implied_tasks=8
lr_implied_resolved=3 eps_ratio_median=0.41`). The premise x_ref = 1 / (1 + B_noise / B_ref) fails on every one of
them; the service does not use it, and EpochModel's cap cost, which rests on the same x_ref, says it is unmeasured.

Run:  .venv/bin/python benchmarks/momentum_signal.py [--quick] [--tasks NAME ...]
(--quick: digits_mlp_sgd and digits_cnn_sgd only, about 60 s; the full run about 4 min; nothing is written.)
Last line:  momentum_signal: tasks=N rank_correlation=R smoothed_nearer_best=K simple_median_abs_log_err=X smoothed_median_abs_log_err=Y
            hessian_rank_correlation=R2 hessian_nearer_best=K2 hessian_median_abs_log_err=Z stationary_tasks=M
            stationary_nearer_best=K3 stationary_median_abs_log_err=W simple_there=V (V: B_simple's on those M tasks)
            lr_implied_tasks=L lr_implied_resolved=J eps_ratio_median=Q (L: SGD tasks with eps_max / eps_ref; J: of them
            with eps_max above eps_ref, so a B_lr; Q: the median eps_max / eps_ref)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import efficiency_tasks as et  # noqa: E402
import statistical_efficiency as se  # noqa: E402

from profiler.gradstats import two_batch_estimates  # noqa: E402
from profiler.preconditioner import is_adaptive, preconditioner  # noqa: E402
from tula_service.fit.perfmodel.efficiency import fit_epochs_to_runs  # noqa: E402
from tula_service.fit.perfmodel.noise_trajectory import progress_weighted_ratio  # noqa: E402

QUICK_TASKS = ("digits_mlp_sgd", "digits_cnn_sgd")
HESSIAN_BATCH = 512  # samples of the independent batch whose loss the Hessian-vector products differentiate
DOUBLE_BACKWARD_MODELS = ("linear1d", "mlp1d", "small_cnn", "cnn1d", "gru1d")  # the GPT's CPU attention kernel has no double backward


def ema_noise_share(beta: float, steps: int) -> float:
    """c_t: the variance of the bias-corrected EMA of t independent unit-variance terms (module docstring)."""
    return (1 - beta) ** 2 * (1 - beta ** (2 * steps)) / (1 - beta**2) / (1 - beta**steps) ** 2


def optimizer_beta(optimizer: torch.optim.Optimizer) -> float:
    group = optimizer.param_groups[0]
    return float(group["betas"][0]) if "betas" in group else float(group.get("momentum", 0.0))


def hessian_estimates(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], inputs: torch.Tensor,
    targets: torch.Tensor, hessian_rows: torch.Tensor, data: dict[str, torch.Tensor],
) -> tuple[float, float] | None:
    """Two-batch estimates of G^T H G and tr(H Sigma) (of P g for Adam/AdamW) at the current weights; None for
    Adam's first step (no preconditioner yet). See the module docstring."""
    adam = is_adaptive(optimizer)
    if adam and not optimizer.state:
        return None
    batch, k = len(targets), et.micro_batches(len(targets))
    micro = torch.stack([
        et.flat(torch.autograd.grad(et.mean_loss(model(x), y), params)) for x, y in zip(inputs.chunk(k), targets.chunk(k))
    ])  # fmt: skip
    if adam:
        micro = micro * preconditioner(optimizer, params)
    hessian_loss = et.mean_loss(model(data["train_x"][hessian_rows]), data["train_y"][hessian_rows])
    gradient = et.flat(torch.autograd.grad(hessian_loss, params, create_graph=True))
    hessian_products = torch.stack([et.flat(torch.autograd.grad(gradient, params, grad_outputs=v, retain_graph=True)) for v in micro])
    micro_forms = (micro * hessian_products).sum(1).tolist()
    full_form = float(micro.mean(0) @ hessian_products.mean(0))  # q(mean) by linearity of H
    return two_batch_estimates(micro_forms, full_form, batch // k, batch)


def reference_run_statistics(name: str, truth: dict[str, Any], hessian: bool = False) -> list[dict[str, float]]:
    """_reference_run_statistics with dropout's masks drawn as the ground truth's seed-0 run drew them."""
    with et.run_randomness(0):
        return _reference_run_statistics(name, truth, hessian)


def _reference_run_statistics(name: str, truth: dict[str, Any], hessian: bool = False) -> list[dict[str, float]]:
    """Per step of the reference run retrained to the target: the two-batch |G|^2 and tr(Sigma) (raw, and
    preconditioned for Adam), the squared norm of the bias-corrected EMA of the full-batch gradient and, with
    `hessian`, the Hessian-weighted estimates (hessian_estimates)."""
    torch.set_num_threads(1)
    task, row = et.TASKS[name], truth["batches"][str(et.TASKS[name].reference_batch)]
    batch, lr = task.reference_batch, float(row["lr"])
    data, model = et.task_data(task), et.task_model(task, 0)
    optimizer = et.task_optimizer(task, model, lr)
    params = [p for p in model.parameters() if p.requires_grad]
    stream = et.BatchStream(task.train_samples, torch.Generator().manual_seed(10_000))
    augmentation = et.augmentation_generator(task, 0)
    eval_every = max(1, round(task.train_samples / batch / et.EVALS_PER_EPOCH))
    beta, ema, steps = optimizer_beta(optimizer), None, []
    adam = is_adaptive(optimizer)
    hessian_rows = torch.Generator().manual_seed(20_000)
    for step in range(math.ceil(task.max_epochs * task.train_samples / batch)):
        inputs, targets = et.training_batch(task, data, stream.next(batch), augmentation)
        step_lr = et.scheduled_lr(task, batch, lr, step)
        for group in optimizer.param_groups:
            group["lr"] = step_lr
        forms = None
        if hessian:
            drawn = torch.randint(task.train_samples, (min(HESSIAN_BATCH, task.train_samples),), generator=hessian_rows)
            forms = hessian_estimates(model, optimizer, params, inputs, targets, drawn, data)
        stats = et.accumulation_step(model, optimizer, inputs, targets)
        if stats is None:
            raise RuntimeError(f"{name}: the reference run diverged at step {step}")
        full = et.flat([p.grad for p in params])
        ema = (1 - beta) * full if ema is None else beta * ema + (1 - beta) * full
        smoothed = ema / (1 - beta ** (step + 1))
        record = {**stats, "ema_sqr": float(smoothed @ smoothed), "share": ema_noise_share(beta, step + 1), "effective_lr": step_lr / (1 - beta)}
        if forms is not None:
            record["hessian_grad_sqr"], record["hessian_trace_sigma"] = forms
        if adam:
            preconditioned = smoothed * preconditioner(optimizer, params)
            record["precond_ema_sqr"] = float(preconditioned @ preconditioned)
        steps.append(record)
        if (step + 1) % eval_every == 0 and et.reached(task, et.evaluate(task, model, data)):
            return steps
    raise RuntimeError(f"{name}: the reference run did not reach its target in {task.max_epochs} epochs")


def second_half_noise_scale(steps: list[dict[str, float]], batch: int, signal: str, prefix: str = "") -> float | None:
    """The service's progress-weighted mean over the second half of the steps, with |G|^2 replaced by the
    smoothed signal when signal == "ema", and by |G|^2 less the stationary fluctuation's eta_eff tr(H Sigma) / (2 B)
    when signal == "stationary" (module docstring); of the Hessian-weighted estimates when signal == "hessian"."""
    if signal in ("hessian", "stationary"):
        steps = [s for s in steps if "hessian_grad_sqr" in s]
    if signal == "hessian":
        prefix = "hessian_"
    half = steps[len(steps) // 2 :]
    trace = np.array([s[f"{prefix}trace_sigma"] for s in half])
    grad_sqr = np.array([s[f"{prefix}grad_sqr"] for s in half])
    if signal == "ema":
        grad_sqr = np.array([s[f"{prefix}ema_sqr"] for s in half]) - np.array([s["share"] for s in half]) * trace / batch
    if signal == "stationary":
        grad_sqr = grad_sqr - np.array([s["effective_lr"] * s["hessian_trace_sigma"] for s in half]) / (2 * batch)
    arrays = {"batch": np.full(len(half), float(batch)), "grad_sqr": grad_sqr, "trace_sigma": trace, "span": np.full(len(half), float(batch))}
    return progress_weighted_ratio(arrays)


def lr_implied_noise_scale(steps: list[dict[str, float]], batch: int) -> tuple[float | None, float | None]:
    """(B_lr, eps_max / eps_ref) over the second half of the steps with Hessian-weighted estimates (module docstring,
    the fourth hypothesis): eps_max = sum |G|^2 / sum G^T H G, eps_ref the mean effective LR eta / (1 - beta); B_lr is
    None where eps_max is not above eps_ref (no noise scale makes that LR the best), the ratio None where the summed
    curvature is not positive."""
    half = [s for s in steps if "hessian_grad_sqr" in s]
    half = half[len(half) // 2 :]
    curvature = sum(s["hessian_grad_sqr"] for s in half)
    if not half or curvature <= 0:
        return None, None
    ratio = sum(s["grad_sqr"] for s in half) / curvature / float(np.mean([s["effective_lr"] for s in half]))
    return (batch * (ratio - 1.0) if ratio > 1.0 else None), ratio


def evaluate(name: str, truth: dict[str, Any], task: se.Task) -> dict[str, Any]:
    hessian = et.TASKS[name].model in DOUBLE_BACKWARD_MODELS
    steps = reference_run_statistics(name, truth, hessian)
    batch = task.reference_batch
    prefix = "precond_" if se.STATISTIC_FOR_OPTIMIZER[task.optimizer] == "preconditioned" else ""
    simple, smoothed = (second_half_noise_scale(steps, batch, signal, prefix) for signal in ("raw", "ema"))
    hessian_scale = second_half_noise_scale(steps, batch, "hessian") if hessian else None
    stationary = second_half_noise_scale(steps, batch, "stationary") if hessian and task.optimizer == "sgd" else None
    lr_implied, eps_ratio = lr_implied_noise_scale(steps, batch) if hessian and task.optimizer == "sgd" else (None, None)
    service = se.evaluate(task)
    best = se.truth_floor(task, fit_epochs_to_runs(list(task.epochs), list(task.epochs.values())))["best_noise_scale"]
    return {
        "task": name, "optimizer": task.optimizer, "steps": len(steps), "service_noise_scale": service["noise_scale"],
        "best_noise_scale": best, "needed_factor": best / service["noise_scale"], "simple": simple, "smoothed": smoothed,
        "smoothed_over_simple": smoothed / simple if simple and smoothed else None, "hessian": hessian_scale,
        "hessian_over_simple": hessian_scale / simple if simple and hessian_scale else None, "stationary": stationary,
        "stationary_over_simple": stationary / simple if simple and stationary else None,
        "lr_implied": lr_implied, "eps_max_over_eps_ref": eps_ratio,
    }  # fmt: skip


def log_error(row: dict[str, Any], key: str) -> float:
    """|ln(reading / best B_noise)| of one task's reading `key`."""
    return abs(math.log(row[key] / row["best_noise_scale"]))


def median_log_error(rows: list[dict[str, Any]], key: str) -> float:
    return float(np.median([log_error(r, key) for r in rows])) if rows else float("nan")


def nearer_best(rows: list[dict[str, Any]], key: str) -> int:
    """The tasks on which reading `key` is nearer the best B_noise than B_simple."""
    return sum(log_error(r, key) < log_error(r, "simple") for r in rows)


def rank_correlation(x: list[float], y: list[float]) -> float:
    ranks = lambda values: np.argsort(np.argsort(values)).astype(float)  # noqa: E731
    return float(np.corrcoef(ranks(x), ranks(y))[0, 1]) if len(x) > 1 else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="digits_mlp_sgd and digits_cnn_sgd only")
    parser.add_argument("--tasks", nargs="+", choices=sorted(et.TASKS))
    args = parser.parse_args(argv)
    names = args.tasks or (QUICK_TASKS if args.quick else tuple(et.TASKS))
    truth = et.load_ground_truth()["tasks"]
    tasks = {t.name: t for t in se.cpu_tasks(et.DEFAULT_PATH)}
    rows = [evaluate(name, truth[name], tasks[name]) for name in names]
    print("| task | optimizer | steps | service B_noise | best B_noise (needed x) | B_simple here | B_smoothed | smoothed / simple "
          "| B_hessian | hessian / simple | B_stationary | stationary / simple | eps_max / eps_ref | B_lr |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    shown = lambda value: "-" if value is None else f"{value:.4g}"  # noqa: E731
    for r in rows:
        print(f"| {r['task']} | {r['optimizer']} | {r['steps']} | {r['service_noise_scale']:.4g} | {r['best_noise_scale']:.4g} "
              f"({r['needed_factor']:.2f}) | {shown(r['simple'])} | {shown(r['smoothed'])} | {shown(r['smoothed_over_simple'])} "
              f"| {shown(r['hessian'])} | {shown(r['hessian_over_simple'])} | {shown(r.get('stationary'))} "
              f"| {shown(r.get('stationary_over_simple'))} | {shown(r.get('eps_max_over_eps_ref'))} | {shown(r.get('lr_implied'))} |")  # fmt: skip  (a reading with no resolved signal: -)
    valid = [r for r in rows if r["smoothed_over_simple"]]
    weighted = [r for r in valid if r["hessian_over_simple"]]
    fluctuation = [r for r in valid if r.get("stationary_over_simple")]
    implied = [r for r in rows if r.get("eps_max_over_eps_ref") is not None]
    correlation = rank_correlation([r["smoothed_over_simple"] for r in valid], [r["needed_factor"] for r in valid])
    hessian_correlation = rank_correlation([r["hessian_over_simple"] for r in weighted], [r["needed_factor"] for r in weighted])
    print(f"momentum_signal: tasks={len(valid)} rank_correlation={correlation:.2f} smoothed_nearer_best={nearer_best(valid, 'smoothed')} "
          f"simple_median_abs_log_err={median_log_error(valid, 'simple'):.2f} smoothed_median_abs_log_err={median_log_error(valid, 'smoothed'):.2f} "
          f"hessian_rank_correlation={hessian_correlation:.2f} hessian_nearer_best={nearer_best(weighted, 'hessian')} "
          f"hessian_median_abs_log_err={median_log_error(weighted, 'hessian'):.2f} stationary_tasks={len(fluctuation)} "
          f"stationary_nearer_best={nearer_best(fluctuation, 'stationary')} "
          f"stationary_median_abs_log_err={median_log_error(fluctuation, 'stationary'):.2f} "
          f"simple_there={median_log_error(fluctuation, 'simple'):.2f} lr_implied_tasks={len(implied)} "
          f"lr_implied_resolved={sum(r['lr_implied'] is not None for r in implied)} "
          f"eps_ratio_median={float(np.median([r['eps_max_over_eps_ref'] for r in implied])) if implied else float('nan'):.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
