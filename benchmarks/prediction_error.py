"""How well do the fitted memory and compute models predict batch sizes that were never profiled?

The analogue of the Tula paper's Figure 11 (relative error of memory and iteration-time prediction).
For three zoo models, profile a full grid of per-device batch sizes, each point in its own child
process exactly as the service does (the request from `tula_service.dispatch.jobs.point_request`, run by
`python -m profiler.run_point`), without gradient statistics (grad_iters=0). Then fit:

- partial search: `MemoryModel` on `memory.peak_bytes` and the compute model on the median
  iteration time, from 3 batch sizes only (--partial-points 4: four), evenly spaced in log2 from the
  smallest to the largest profiled (the smallest, a middle one, the largest: on a GPU the largest
  would sit near the memory limit), and predict every other, held-out batch size;
- full search: the same models fitted on the whole grid; its error is the leave-one-out error.

The compute model is `tula_service.fit.perfmodel.compute.select_compute_model` (shape picked by
cross-validation) when the package has it, else the linear `ComputeModel`; the output says which.

Time cap per point: sampling stops once the CV of iteration time is under 3% or after 5 s (the
service's defaults), after a warm-up that the profiler bounds at 5 s; --quick: four batch sizes and
a 0.3 s cap. Errors are relative: predicted / measured - 1. The last line is the summary over all
held-out points of all models (medians of absolute errors, and the largest time error):

    prediction_error: models=N median_time_err_pct=X max_time_err_pct=Y median_mem_err_pct=Z

Run: .venv/bin/python benchmarks/prediction_error.py [--quick] [--partial-points 3|4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_fidelity import WORKLOADS, run_point  # noqa: E402

from tula_service.dispatch.jobs import point_request  # noqa: E402
from tula_service.fit.perfmodel import ComputeModel, MemoryModel  # noqa: E402
from tula_service.spec.job_spec import JobSpec  # noqa: E402

try:
    from tula_service.fit.perfmodel.compute import select_compute_model
except ImportError:  # older packages: only the linear model
    select_compute_model = None

MIB = 2**20
BATCHES = {"cpu": [4, 6, 8, 12, 16, 24, 32, 48, 64], "cuda": [32, 48, 64, 96, 128, 192, 256, 384, 512]}
QUICK_BATCHES = {"cpu": [4, 8, 16, 32], "cuda": [32, 64, 128, 256]}
TIME_CAP_S, QUICK_TIME_CAP_S = 5.0, 0.3
TIME_TARGET_PCT, MEMORY_TARGET_PCT = 5.0, 2.0  # issue 4: median held-out errors
SAME_FIT_PCT = 5.0  # partial and full compute fits "agree" when their predictions differ by at most this


def job_spec(workload: dict, batches: list[int], device: str, time_cap_s: float) -> JobSpec:
    """A job spec for one workload; only its model, dataset and profiling fields shape the requests."""
    return JobSpec.model_validate(
        {
            **workload,
            "batch_sizes": batches,
            "cluster": {"device_memory_gib": 16, "interconnect_gbps": 100},
            "pricing": {"kind": "gpu_hour", "price": 1.0},
            "training": {"reference_batch": batches[0], "reference_epochs": 1},
            "profiling": {"device": device, "time_cap_s": time_cap_s, "grad_iters": 0},
        }
    )


def profile_grid(spec: JobSpec) -> list[dict]:
    """Every batch size of the spec in its own child process; each record gains the child's wall seconds."""
    records = []
    for batch in spec.batch_sizes:
        started = time.perf_counter()
        record = run_point(point_request(spec, batch))
        records.append({**record, "wall_s": time.perf_counter() - started})
    return records


def partial_batches(batches: list[int], count: int) -> list[int]:
    """`count` profiled batches nearest (in log2) to evenly log2-spaced targets from the smallest to the largest."""
    log_batches = np.log2(batches)
    targets = np.linspace(log_batches.min(), log_batches.max(), count)
    return sorted({batches[int(np.argmin(np.abs(log_batches - target)))] for target in targets})


def fit_memory(device_batch: np.ndarray, peak_bytes: np.ndarray) -> tuple[MemoryModel, str]:
    return MemoryModel().fit(device_batch, peak_bytes), "linear"


def fit_compute(device_batch: np.ndarray, iter_time_s: np.ndarray) -> tuple[object, str]:
    """The service's compute model and its name: the cross-validated shape when available, else the line."""
    if select_compute_model is None:
        return ComputeModel().fit(device_batch, iter_time_s), "linear (ComputeModel)"
    model, report = select_compute_model(device_batch, iter_time_s)
    return model, report["chosen"]


Fit = Callable[[np.ndarray, np.ndarray], tuple[object, str]]


def leave_one_out_predictions(fit: Fit, device_batch: np.ndarray, measured: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Prediction at each batch from a model fitted on all the other points (full search's error)."""
    predictions, names = [], []
    for held_out in range(device_batch.size):
        keep = np.arange(device_batch.size) != held_out
        model, name = fit(device_batch[keep], measured[keep])
        predictions.append(float(np.asarray(model.predict(device_batch[held_out : held_out + 1]))[0]))
        names.append(name)
    return np.array(predictions), names


def error_pct(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    return (np.asarray(predicted, dtype=float) / measured - 1.0) * 100.0


def score(fit: Fit, device_batch: np.ndarray, measured: np.ndarray, fit_mask: np.ndarray) -> dict:
    """Partial search (fit on the masked points, predict all) and full search (leave-one-out) of one quantity."""
    partial, partial_name = fit(device_batch[fit_mask], measured[fit_mask])
    full, full_name = fit(device_batch, measured)
    loo_predicted, loo_names = leave_one_out_predictions(fit, device_batch, measured)
    predicted = np.asarray(partial.predict(device_batch), dtype=float)
    return {
        "predicted": predicted,
        "err_pct": error_pct(predicted, measured),
        "loo_err_pct": error_pct(loo_predicted, measured),
        "model": {"partial": partial_name, "full": full_name, "leave_one_out": sorted(set(loo_names))},
        "partial_vs_full_max_gap_pct": float(np.max(np.abs(error_pct(predicted, full.predict(device_batch))))),
    }


def summarize(quantity: dict, held_out: np.ndarray) -> dict:
    """Absolute errors: held-out points of the partial search, every point of the full search."""
    held_out_err_pct = np.abs(quantity["err_pct"][held_out])
    loo_err_pct = np.abs(quantity["loo_err_pct"])
    return {
        "model": quantity["model"],
        "held_out_err_pct": held_out_err_pct.tolist(),
        "held_out_median_err_pct": float(np.median(held_out_err_pct)),
        "held_out_max_err_pct": float(np.max(held_out_err_pct)),
        "loo_err_pct": loo_err_pct.tolist(),
        "loo_median_err_pct": float(np.median(loo_err_pct)),
        "partial_vs_full_max_gap_pct": quantity["partial_vs_full_max_gap_pct"],
    }


def evaluate(name: str, records: list[dict], partial_count: int) -> dict:
    """Partial-search and full-search errors of time and memory over one model's profiled grid."""
    ok = [r for r in records if r["status"] == "ok"]
    if len(ok) <= partial_count:
        raise SystemExit(f"{name}: {len(ok)} batch sizes ran; a partial search over {partial_count} needs more to hold out")
    device_batch = np.array([r["batch_size"] for r in ok], dtype=float)
    fit_batches = partial_batches([r["batch_size"] for r in ok], partial_count)
    fit_mask = np.isin(device_batch, fit_batches)
    iter_time_s = np.array([r["iter_time"]["median_s"] for r in ok])
    peak_bytes = np.array([r["memory"]["peak_bytes"] for r in ok], dtype=float)
    iter_time = score(fit_compute, device_batch, iter_time_s, fit_mask)
    memory = score(fit_memory, device_batch, peak_bytes, fit_mask)
    result = {
        "model": name,
        "torch_threads": ok[0]["threads"],
        "fit_batches": fit_batches,
        "failed": [{"batch_size": r["batch_size"], "status": r["status"]} for r in records if r["status"] != "ok"],
        "points": [point_row(r, bool(f), iter_time, memory, i) for i, (r, f) in enumerate(zip(ok, fit_mask))],
        "time": summarize(iter_time, ~fit_mask),
        "memory": summarize(memory, ~fit_mask),
        "partial_profile_s": sum(r["wall_s"] for r, f in zip(ok, fit_mask) if f),
        "full_profile_s": sum(r["wall_s"] for r in records),
    }
    if all("process_rss" in r["memory"] for r in ok):  # CPU: the process's real peak, a measured cross-check
        rss_bytes = np.array([r["memory"]["process_rss"]["peak_bytes"] for r in ok], dtype=float)
        result["process_rss"] = summarize(score(fit_memory, device_batch, rss_bytes, fit_mask), ~fit_mask)
    return result


def point_row(record: dict, is_fit: bool, iter_time: dict, memory: dict, index: int) -> dict:
    timing = record["iter_time"]
    return {
        "batch_size": record["batch_size"],
        "role": "fit" if is_fit else "held-out",
        "wall_s": record["wall_s"],
        "iter_time_ms": timing["median_s"] * 1e3,
        "iter_time_cv": timing["cv"],
        "timed_iters": timing["count"],
        "stopped_by": timing["stopped_by"],
        "predicted_iter_time_ms": float(iter_time["predicted"][index]) * 1e3,
        "time_err_pct": float(iter_time["err_pct"][index]),
        "loo_time_err_pct": float(iter_time["loo_err_pct"][index]),
        "peak_mib": record["memory"]["peak_bytes"] / MIB,
        "predicted_peak_mib": float(memory["predicted"][index]) / MIB,
        "mem_err_pct": float(memory["err_pct"][index]),
        "loo_mem_err_pct": float(memory["loo_err_pct"][index]),
    }


def verdict(value_pct: float, target_pct: float) -> str:
    return f"{value_pct:.2f}% (target <= {target_pct:g}%: {'met' if value_pct <= target_pct else 'missed'})"


def signed(value_pct: float, digits: int) -> str:
    return f"{round(value_pct, digits) + 0.0:+.{digits}f}"  # + 0.0: no "-0.000" for a rounding-level error


def print_table(result: dict) -> None:
    shapes = result["time"]["model"]
    print(
        f"\n{result['model']} ({result['torch_threads']} torch threads): partial search fits {result['fit_batches']};"
        f" compute model {shapes['partial']} (partial), {shapes['full']} (full),"
        f" {'/'.join(shapes['leave_one_out'])} (leave-one-out fits)"
    )
    print(
        f"{'batch':>6} {'role':>8} {'meas ms':>9} {'cv %':>5} {'pred ms':>9} {'time err %':>10} {'LOO %':>7}"
        f" {'meas MiB':>9} {'pred MiB':>9} {'mem err %':>9} {'LOO %':>7}"
    )
    for p in result["points"]:
        print(
            f"{p['batch_size']:>6} {p['role']:>8} {p['iter_time_ms']:>9.2f} {p['iter_time_cv'] * 100:>5.1f}"
            f" {p['predicted_iter_time_ms']:>9.2f} {signed(p['time_err_pct'], 2):>10} {signed(p['loo_time_err_pct'], 2):>7}"
            f" {p['peak_mib']:>9.2f} {p['predicted_peak_mib']:>9.2f}"
            f" {signed(p['mem_err_pct'], 3):>9} {signed(p['loo_mem_err_pct'], 3):>7}"
        )
    for failed in result["failed"]:
        print(f"{failed['batch_size']:>6} {failed['status']} (not fitted, not scored)")


def print_model_summary(result: dict) -> None:
    iter_time, memory = result["time"], result["memory"]
    time_verdict = verdict(iter_time["held_out_median_err_pct"], TIME_TARGET_PCT)
    memory_verdict = verdict(memory["held_out_median_err_pct"], MEMORY_TARGET_PCT)
    print(
        f"  partial search, held-out: median time error {time_verdict}, max {iter_time['held_out_max_err_pct']:.2f}%;"
        f" median memory error {memory_verdict}"
    )
    print(
        f"  full search, leave-one-out: median time error {iter_time['loo_median_err_pct']:.2f}%,"
        f" median memory error {memory['loo_median_err_pct']:.3f}%"
    )
    if "process_rss" in result:
        rss = result["process_rss"]
        print(
            f"  cross-check, process peak RSS (measured, CPU): held-out median error {rss['held_out_median_err_pct']:.2f}%,"
            f" leave-one-out {rss['loo_median_err_pct']:.2f}%"
        )
    points = len(result["points"]) + len(result["failed"])
    print(
        f"  profiling seconds: partial {result['partial_profile_s']:.1f} s ({len(result['fit_batches'])} points),"
        f" full {result['full_profile_s']:.1f} s ({points} points)"
    )
    gap_pct = iter_time["partial_vs_full_max_gap_pct"]
    same = "same" if gap_pct <= SAME_FIT_PCT else "not the same"
    print(f"  partial vs full compute fit: predictions differ by up to {gap_pct:.2f}% over the grid ({same} within {SAME_FIT_PCT:g}%)")


def overall(results: list[dict]) -> dict:
    time_err = [e for r in results for e in r["time"]["held_out_err_pct"]]
    mem_err = [e for r in results for e in r["memory"]["held_out_err_pct"]]
    return {
        "models": len(results),
        "held_out_points": len(time_err),
        "median_time_err_pct": float(np.median(time_err)),
        "max_time_err_pct": float(np.max(time_err)),
        "median_mem_err_pct": float(np.median(mem_err)),
    }


def machine_load() -> str:
    """Other processes on the CPUs slow iterations down unevenly: the load average says how busy it was."""
    load_1min, load_5min, _ = os.getloadavg()
    return f"load average {load_1min:.2f} (1 min), {load_5min:.2f} (5 min) on {os.cpu_count()} CPUs"


def summary_line(totals: dict) -> str:
    return (
        f"prediction_error: models={totals['models']} median_time_err_pct={totals['median_time_err_pct']:.2f}"
        f" max_time_err_pct={totals['max_time_err_pct']:.2f} median_mem_err_pct={totals['median_mem_err_pct']:.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"four batch sizes, {QUICK_TIME_CAP_S:g} s time cap per point")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--partial-points", type=int, default=3, choices=[3, 4], help="batch sizes the partial search fits")
    parser.add_argument("--json", type=Path, help="write every number to this file")
    args = parser.parse_args(argv)
    batches = (QUICK_BATCHES if args.quick else BATCHES)[args.device]
    time_cap_s = QUICK_TIME_CAP_S if args.quick else TIME_CAP_S
    if args.partial_points >= len(batches):
        parser.error(f"--partial-points {args.partial_points} leaves no held-out point among the {len(batches)} batch sizes {batches}")
    chooser = "select_compute_model" if select_compute_model else "ComputeModel (no select_compute_model in this package)"
    print(f"{args.device}: batches {batches}, time cap {time_cap_s:g} s per point, compute model from {chooser}")
    print(machine_load())
    started = time.perf_counter()
    results = []
    for name, workload in WORKLOADS.items():
        records = profile_grid(job_spec(workload, batches, args.device, time_cap_s))
        results.append(evaluate(name, records, args.partial_points))
        print_table(results[-1])
        print_model_summary(results[-1])
    totals = overall(results)
    totals["seconds"] = time.perf_counter() - started
    print(f"\n{machine_load()}")
    print(
        f"all models, partial search: held-out median time error {verdict(totals['median_time_err_pct'], TIME_TARGET_PCT)},"
        f" median memory error {verdict(totals['median_mem_err_pct'], MEMORY_TARGET_PCT)}; {totals['seconds']:.1f} s in all"
    )
    if args.json:
        config = {
            "device": args.device, "quick": args.quick, "batches": batches, "time_cap_s": time_cap_s,
            "partial_points": args.partial_points, "compute_model_from": chooser,
            "load_average_at_end": os.getloadavg(), "cpus": os.cpu_count(),
            "targets_pct": {"time": TIME_TARGET_PCT, "memory": MEMORY_TARGET_PCT, "same_fit": SAME_FIT_PCT},
        }  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": config, "models": results, "summary": totals}, indent=2))
    print(summary_line(totals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
