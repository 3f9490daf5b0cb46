"""What a removed gradient hook still costs every backward pass, and what clearing it saves (issue 17: the client's
fixed cost per step).

GradientStatsLogger (and through it TulaRun) puts a hook on every parameter for the steps that take statistics and
removes it after them. Tensor.register_hook registers the tensor's hook dict with autograd once, and removing a
handle only empties the dict: autograd still calls into Python for it on every backward pass. The logger now takes an
emptied dict out of autograd (profiler.reference_logger._unregister_empty_hook_dicts). This benchmark measures both, on
the models of benchmarks/efficiency_tasks.py at the batch online.py trains them at (client_overhead.task_batch):

- arms, alternated block by block (BLOCK_STEPS forward and backward passes a block, no optimizer step, so that the
  weights and every block's work stay the same; the order reversed every other round):
  - plain: the model as built;
  - plain_again: another copy of it (A/A: the method's resolution);
  - residue: every parameter had a hook registered and removed (what the sampling left on plain steps before);
  - cleared: the same, then the logger's _unregister_empty_hook_dicts (what it leaves now);
- the cost of an arm: the median over rounds of its block's seconds per pass minus plain's in the same round, in
  microseconds, and for residue per parameter tensor.

Last line: `hook_residue: tasks=N residue_us=X per_parameter_us=Y cleared_us=Z a_a_us=W` (medians over tasks; |A/A|).

Run:  .venv/bin/python benchmarks/hook_residue.py [--quick] [--tasks NAME ...] [--rounds N]
      --quick: fewer rounds, its report in a temporary folder. Full: docs/validation/hook_residue.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
for variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(variable, "1")

import torch  # noqa: E402
from client_overhead import task_batch  # noqa: E402
from efficiency_tasks import TASKS, BatchStream, mean_loss, task_data, task_model  # noqa: E402

from profiler.reference_logger import _unregister_empty_hook_dicts  # noqa: E402

DEFAULT_TASKS = ("mnist1d_mlp_sgd", "digits_cnn_sgd", "mnist1d_cnn1d_adam", "digits_resnet_sgd")
ARMS = ("plain", "plain_again", "residue", "cleared")
BLOCK_STEPS = 50
ROUNDS, QUICK_ROUNDS = 60, 16


def prepared_models(name: str) -> dict[str, torch.nn.Module]:
    """One copy of the task's model (seed 0) per arm, the residue and cleared arms' parameters hooked and unhooked."""
    models = {arm: task_model(TASKS[name], 0) for arm in ARMS}
    for arm in ("residue", "cleared"):
        parameters = [p for p in models[arm].parameters() if p.requires_grad]
        for parameter in parameters:
            parameter.register_hook(lambda grad: None).remove()
        if arm == "cleared":
            _unregister_empty_hook_dicts(parameters)
    return models


def measure(name: str, rounds: int) -> dict[str, Any]:
    """Seconds per forward and backward pass of each arm, per round (module docstring)."""
    task = TASKS[name]
    batch, _ = task_batch(name)
    data = task_data(task)
    models = prepared_models(name)
    stream = BatchStream(task.train_samples, torch.Generator().manual_seed(7))
    batches = [stream.next(batch) for _ in range(BLOCK_STEPS)]
    inputs = [(data["train_x"][rows], data["train_y"][rows]) for rows in batches]
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for round_ in range(rounds):
        for arm in ARMS if round_ % 2 == 0 else reversed(ARMS):
            model = models[arm]
            started = time.perf_counter()
            for x, y in inputs:
                model.zero_grad(set_to_none=True)
                mean_loss(model(x), y).backward()
            seconds[arm].append((time.perf_counter() - started) / BLOCK_STEPS)
    parameters = sum(1 for p in models["plain"].parameters() if p.requires_grad)
    return {"task": name, "batch": batch, "parameters": parameters, "seconds": seconds}


def summarize(measured: dict[str, Any]) -> dict[str, Any]:
    seconds = measured["seconds"]
    plain = seconds["plain"]

    def cost_us(arm: str) -> float:
        return 1e6 * statistics.median([a - p for a, p in zip(seconds[arm], plain)])

    residue = cost_us("residue")
    return {
        "task": measured["task"], "batch": measured["batch"], "parameters": measured["parameters"],
        "plain_us": 1e6 * statistics.median(plain), "a_a_us": cost_us("plain_again"), "residue_us": residue,
        "per_parameter_us": residue / measured["parameters"], "cleared_us": cost_us("cleared"),
    }  # fmt: skip


def summary_line(rows: list[dict[str, Any]]) -> str:
    def median(key: str, absolute: bool = False) -> float:
        return statistics.median(abs(row[key]) if absolute else row[key] for row in rows)

    return (f"hook_residue: tasks={len(rows)} residue_us={median('residue_us'):.1f} per_parameter_us={median('per_parameter_us'):.2f} "
            f"cleared_us={median('cleared_us'):.1f} a_a_us={median('a_a_us', absolute=True):.1f}")  # fmt: skip


def markdown(rows: list[dict[str, Any]], rounds: int) -> str:
    lines = [
        "# A removed gradient hook's cost per backward pass",
        "",
        f"Measured {time.strftime('%Y-%m-%d')}; {rounds} rounds of {BLOCK_STEPS} forward and backward passes per arm and task; one torch thread.",
        "",
        "```sh\n.venv/bin/python benchmarks/hook_residue.py\n```",
        "",
        "```\n" + summary_line(rows) + "\n```",
        "",
        "Costs are medians over rounds of the arm's seconds per pass minus plain's in the same round (benchmarks/hook_residue.py).",
        "",
        "| task | batch | parameter tensors | plain pass (us) | A/A (us) | hooks removed: +us | per parameter (us) | removed and cleared: +us |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(f"| {row['task']} | {row['batch']} | {row['parameters']} | {row['plain_us']:.0f} | {row['a_a_us']:+.1f} | "
                     f"{row['residue_us']:+.1f} | {row['per_parameter_us']:.2f} | {row['cleared_us']:+.1f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds; writes nothing tracked")
    parser.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), choices=sorted(TASKS))
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "validation", help="folder of hook_residue.md (full runs)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    rows = []
    for name in args.tasks:
        row = summarize(measure(name, rounds))
        rows.append(row)
        print(f"{row['task']:20s} batch {row['batch']:5d} params {row['parameters']:3d} plain {row['plain_us']:7.0f} us  "
              f"A/A {row['a_a_us']:+.1f}  removed {row['residue_us']:+.1f} ({row['per_parameter_us']:.2f}/param)  "
              f"cleared {row['cleared_us']:+.1f}", flush=True)  # fmt: skip
    folder = Path(tempfile.mkdtemp(prefix="tula-hook-residue-")) if args.quick else args.out
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hook_residue.md").write_text(markdown(rows, rounds))
    print(f"report: {folder / 'hook_residue.md'}")
    print(summary_line(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
