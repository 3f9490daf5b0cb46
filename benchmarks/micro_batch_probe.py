"""Does the noise scale read depend on how a batch is cut into micro-batches (per-device batches)? (issue 13)

The records' two-batch estimates (McCandlish et al. 2018, App. A.1) take the micro-batch gradients g_b (b samples each,
k = B / b of them) and their mean g_B:

    |G|^2 ~ (B |g_B|^2 - b mean|g_b|^2) / (B - b),   tr(Sigma) ~ (mean|g_b|^2 - |g_B|^2) / (1/b - 1/B).

Without batch norm E|g_b|^2 = |G|^2 + tr(Sigma) / b, and the estimates are unbiased at any b. With batch norm each
micro-batch is normalized by its own statistics (as each device is under DDP without SyncBatchNorm), so g_b's mean and
spread depend on b, and so might the read: a user's read would then depend on the per-device batch of their run. The
digits ResNet (batch norm) reads 4-10x its critical batch (docs/validation.md), which made the question concrete.

Per task: seed 0 trains at the reference batch with the ground truth's LR as efficiency_tasks.train_to_target trains
it (a micro_batched task split, the others whole) for PROBE_FRACTION of the reference run's steps; then, at those
weights, DRAWS random batches of PROBE_BATCH samples are each cut into micro-batches of every size in MICRO_BATCHES
(the same batches for every size), the gradients taken at the same weights (time_to_accuracy.noise_probe: batch norm's
running statistics put back after it), and the estimates averaged over the draws (numerator and denominator
separately, as the service pools them). Reported:
|G|^2, tr(Sigma) and B_simple = tr(Sigma) / |G|^2 per micro-batch size, and the spread of B_simple over the sizes
(largest / smallest).

Run:   .venv/bin/python benchmarks/micro_batch_probe.py            # digits_resnet_sgd, digits_resnet_adamw, digits_cnn_sgd
       .venv/bin/python benchmarks/micro_batch_probe.py --quick    # digits_resnet_sgd and digits_cnn_sgd, fewer draws
Prints a markdown table (nothing is written); last line:
       micro_batch_probe: tasks=N batch_norm_spread_max=X plain_spread_max=Y
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import efficiency_tasks as et  # noqa: E402
from time_to_accuracy import noise_probe  # noqa: E402

PROBE_FRACTION = 0.75  # of the reference run's steps: the second half, where the service reads
PROBE_BATCH = 64
MICRO_BATCHES = (32, 16, 8, 4)
DRAWS = 200
QUICK_DRAWS = 40
TASKS = ("digits_resnet_sgd", "digits_resnet_adamw", "digits_cnn_sgd")
QUICK_TASKS = ("digits_resnet_sgd", "digits_cnn_sgd")


def has_batch_norm(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def probe(name: str, truth: dict[str, Any], draws: int) -> dict[str, Any]:
    """_probe with torch's global generator seeded as the ground truth's runs seed it (run_randomness): its dropout
    masks do not depend on the jobs its process ran before (whole-batch steps, so they are not the truth's split run's)."""
    with et.run_randomness(0):
        return _probe(name, truth, draws)


def _probe(name: str, truth: dict[str, Any], draws: int) -> dict[str, Any]:
    """Train task `name` to PROBE_FRACTION of its reference run, then read |G|^2, tr(Sigma) and B_simple at every
    micro-batch size of MICRO_BATCHES from the same draws (module docstring)."""
    torch.set_num_threads(1)
    task = et.TASKS[name]
    ref = task.reference_batch
    row = truth["batches"][str(ref)]
    steps = int(round(row["epochs"] * task.train_samples / ref * PROBE_FRACTION))
    data, model = et.task_data(task), et.task_model(task, 0)
    optimizer = et.task_optimizer(task, model, float(row["lr"]))
    stream = et.BatchStream(task.train_samples, torch.Generator().manual_seed(10_000))
    augmentation = et.augmentation_generator(task, 0)
    step = et.step_function(task)
    for index in range(steps):
        rows = stream.next(ref)
        for group in optimizer.param_groups:
            group["lr"] = et.scheduled_lr(task, ref, float(row["lr"]), index)
        step(model, optimizer, *et.training_batch(task, data, rows, augmentation))
    reads = {}
    for micro in MICRO_BATCHES:  # the same seed draws the same batches for every size
        read = noise_probe(model, data, torch.Generator().manual_seed(1), micro_batch=micro, micro_batches=PROBE_BATCH // micro,
                           draws=draws, loss_fn=et.mean_loss)  # fmt: skip
        reads[micro] = {"grad_sqr": read["true_grad_sq_norm"], "trace_sigma": read["trace_sigma"],
                        "b_simple": read["trace_sigma"] / read["true_grad_sq_norm"]}  # fmt: skip
    simple = [r["b_simple"] for r in reads.values()]
    return {"task": name, "batch_norm": has_batch_norm(model), "steps": steps, "reads": reads,
            "spread": max(simple) / min(simple) if min(simple) > 0 else float("inf")}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK_TASKS)} with {QUICK_DRAWS} draws")
    parser.add_argument("--tasks", nargs="+", choices=sorted(et.TASKS))
    args = parser.parse_args(argv)
    names = args.tasks or (QUICK_TASKS if args.quick else TASKS)
    truth = et.load_ground_truth()["tasks"]
    rows = [probe(name, truth[name], QUICK_DRAWS if args.quick else DRAWS) for name in names]
    print("| task | batch norm | steps trained | " + " | ".join(f"micro-batch {b}: grad_sqr, trace_sigma, B_simple" for b in MICRO_BATCHES)
          + " | B_simple spread |")  # fmt: skip
    print("|---|---|---:|" + "---:|" * len(MICRO_BATCHES) + "---:|")
    for r in rows:
        cells = " | ".join(f"{v['grad_sqr']:.3g}, {v['trace_sigma']:.3g}, {v['b_simple']:.4g}" for v in r["reads"].values())
        print(f"| {r['task']} | {'yes' if r['batch_norm'] else 'no'} | {r['steps']} | {cells} | {r['spread']:.2f} |")
    spread = lambda norm: max((r["spread"] for r in rows if r["batch_norm"] == norm), default=float("nan"))  # noqa: E731
    print(json.dumps({r["task"]: r for r in rows}, default=float), file=sys.stderr)
    print(f"micro_batch_probe: tasks={len(rows)} batch_norm_spread_max={spread(True):.2f} plain_spread_max={spread(False):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
