"""Measurements + spec -> recommendation. A pure function: re-planning needs no new profiling.

Every number in the result carries where it came from:
- "measured": read from a profiling point as is;
- "fitted": a model parameter, with its fit quality (R^2, leave-one-out relative error, std. error);
- "predicted": computed from fitted models (its error is the models' leave-one-out error);
- "spec": given by the user; "assumed": a stated default in place of a measurement.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tula_service.perfmodel import ComputeModel, EpochModel, MemoryModel, NoiseScaleModel, RingAllReduce
from tula_service.perfmodel.validation import error_summary, leave_one_out_relative_errors
from tula_service.planner import ACCUMULATION_STEPS, GIB, MEMORY_MARGIN, FittedModels, PlanInputs, choose, sweep
from tula_service.spec import JobSpec, powers_of_two_between


class NotEnoughMeasurements(ValueError):
    """Fewer than two usable points: a line cannot be fitted."""


def _usable(measurements: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int]]:
    ok = sorted((m for m in measurements if m.get("status") == "ok"), key=lambda m: m["batch_size"])
    oom_batches = sorted(m["batch_size"] for m in measurements if m.get("status") == "oom")
    return ok, oom_batches


def fit_models(spec: JobSpec, ok: list[dict[str, Any]]) -> tuple[FittedModels, dict[str, Any]]:
    batch = np.array([m["batch_size"] for m in ok], dtype=float)
    peak_bytes = np.array([m["memory"]["peak_bytes"] for m in ok], dtype=float)
    iter_time_s = np.array([m["iter_time"]["median_s"] for m in ok], dtype=float)
    grad_sq = np.array([m["gradient"]["grad_sq_norm_mean"] for m in ok], dtype=float)
    grad_sem = np.array([m["gradient"]["grad_sq_norm_sem"] or np.nan for m in ok], dtype=float)

    memory = MemoryModel().fit(batch, peak_bytes)
    compute = ComputeModel().fit(batch, iter_time_s)
    gradient_bytes = ok[0]["model"]["gradient_bytes"]
    network = RingAllReduce(gradient_bytes=gradient_bytes, bandwidth_gbps=spec.cluster.interconnect_gbps)
    noise = NoiseScaleModel().fit(batch, grad_sq, None if np.isnan(grad_sem).any() else grad_sem)
    epochs = EpochModel(spec.training.reference_batch, spec.training.reference_epochs, noise.noise_scale_)

    report = {
        "memory": {
            "formula": "M(b) = static_bytes + act_bytes_per_sample * b",
            "static_bytes": float(memory.static_bytes_),
            "act_bytes_per_sample": float(memory.act_bytes_per_sample_),
            "r2": memory.r2_,
            "leave_one_out": error_summary(leave_one_out_relative_errors(MemoryModel, batch, peak_bytes)),
            "source": "fitted",
        },
        "compute": {
            "formula": "T_comp(b) = alpha_s + beta_s_per_sample * b (non-negative least squares)",
            "alpha_s": float(compute.alpha_s_),
            "beta_s_per_sample": float(compute.beta_s_per_sample_),
            "leave_one_out": error_summary(leave_one_out_relative_errors(ComputeModel, batch, iter_time_s)),
            "source": "fitted",
        },
        "network": {
            "formula": "T_net(n) = 2(n-1) latency_s + 2(n-1)/n gradient_bytes / bandwidth",
            "gradient_bytes": {"value": gradient_bytes, "source": "measured"},
            "bandwidth_gbps": {"value": spec.cluster.interconnect_gbps, "source": "spec"},
            "latency_s": {"value": network.latency_s, "source": "assumed"},
        },
        "overlap": {"g": {"value": 1.0, "source": "assumed", "note": "no compute/communication overlap (conservative)"}},
        "efficiency": _efficiency_report(noise, epochs),
    }
    return FittedModels(memory, compute, network, epochs), report


def _efficiency_report(noise: NoiseScaleModel, epochs: EpochModel) -> dict[str, Any]:
    if not noise.informative_:
        return {
            "formula": "E(B) = reference_epochs * max(1, B / reference_batch)",
            "noise_scale": None,
            "source": "assumed",
            "note": "the |g_b|^2 vs 1/b fit was not informative (|G|^2 or tr(Sigma) not positive: the noise "
            "scale is beyond what the profiled batches resolve, or the gradients are too noisy); assumed: "
            "epochs constant up to the reference batch, and no fewer optimizer steps than the reference "
            "run beyond it",
        }
    return {
        "formula": "E(B) = E_min (1 + B / B_noise), E_min from the reference run",
        "noise_scale": {"value": noise.noise_scale_, "stderr": noise.noise_scale_stderr_, "source": "fitted"},
        "true_grad_sq_norm": noise.true_grad_sq_norm_,
        "trace_sigma": noise.trace_sigma_,
        "min_epochs": {"value": epochs.min_epochs, "source": "fitted"},
        "source": "fitted",
        "note": "noise scale measured at the initial weights; it grows as the loss falls (McCandlish et al. 2018)",
    }


def candidate_device_batches(ok_batches: list[int], oom_batches: list[int]) -> np.ndarray:
    """Powers of two inside the profiled range (and the profiled sizes), below the smallest OOM batch."""
    low, high = min(ok_batches), max(ok_batches)
    values = set(powers_of_two_between(low, high)) | set(ok_batches)
    if oom_batches:
        values = {v for v in values if v < min(oom_batches)}
    return np.array(sorted(values))


def plan(spec: JobSpec, measurements: list[dict[str, Any]], failed_points: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    ok, oom_batches = _usable(measurements)
    if len({m["batch_size"] for m in ok}) < 2:
        raise NotEnoughMeasurements(
            f"need at least 2 successfully profiled batch sizes, got {len(ok)}"
            + (f" (out of memory at {oom_batches})" if oom_batches else "")
        )
    models, report = fit_models(spec, ok)
    inputs = PlanInputs(
        device_batches=candidate_device_batches([m["batch_size"] for m in ok], oom_batches),
        total_devices=spec.cluster.total_devices,
        device_memory_bytes=spec.cluster.device_memory_gib * GIB,
        num_samples=spec.dataset.num_samples,
        pricing_kind=spec.pricing.kind,
        price=spec.pricing.price,
        objective=spec.objective,
    )
    candidates = sweep(models, inputs)
    if candidates["global_batch"].size == 0:
        raise NotEnoughMeasurements(
            f"no profiled batch fits in {spec.cluster.device_memory_gib} GiB per device "
            f"(static memory alone is {models.memory.static_bytes_ / GIB:.2f} GiB)"
        )
    chosen, knee, front = choose(candidates, spec.objective)
    measured = {m["batch_size"]: m for m in ok}
    rows = [_candidate_row(candidates, i, front, measured, report) for i in range(candidates["global_batch"].size)]
    return {
        "objective": spec.objective,
        "chosen": rows[chosen],
        "knee": None
        if knee is None
        else {
            "global_batch": knee.global_batch,
            "method": knee.method,
            "sensitivity": knee.sensitivity,
            "curve": "pareto front: log2 total time vs log2 global batch",
        },
        "candidates": rows,
        "pareto_front": [i for i in range(len(rows)) if front[i]],
        "models": report,
        "search_space": {
            "device_batches": [int(b) for b in inputs.device_batches],
            "max_device_batch": {
                "value": models.memory.max_device_batch(inputs.device_memory_bytes, MEMORY_MARGIN),
                "source": "predicted",
            },
            "memory_margin": {"value": MEMORY_MARGIN, "source": "assumed"},
            "devices": sorted({int(n) for n in candidates["devices"]}),
            "accumulation_steps": list(ACCUMULATION_STEPS),
        },
        "profiled": {
            "ok_batches": sorted(measured),
            "oom_batches": oom_batches,
            "failed": failed_points or [],
        },
    }


def _candidate_row(candidates: dict[str, np.ndarray], i: int, front: np.ndarray, measured: dict[int, dict], report: dict) -> dict[str, Any]:
    b, n, a = (int(candidates[key][i]) for key in ("device_batch", "devices", "accumulation"))
    point = measured.get(b)
    time_err = report["compute"]["leave_one_out"]["median_rel_err"]
    mem_err = report["memory"]["leave_one_out"]["median_rel_err"]

    def predicted(key: str, rel_err: float | None = time_err) -> dict[str, Any]:
        return {"value": float(candidates[key][i]), "source": "predicted", "rel_err": rel_err}

    memory = (
        {"value": float(point["memory"]["peak_bytes"]), "source": "measured"} if point else predicted("memory_bytes", mem_err)
    )
    iter_time = (
        {"value": float(point["iter_time"]["median_s"]), "source": "measured"}
        if point and n == 1 and a == 1
        else predicted("iter_time_s")
    )
    return {
        "device_batch": b,
        "devices": n,
        "accumulation": a,
        "global_batch": int(candidates["global_batch"][i]),
        "memory_bytes": memory,
        "iter_time_s": iter_time,
        "step_time_s": predicted("step_time_s"),
        "epochs": {
            "value": float(candidates["epochs"][i]),
            "source": "assumed" if report["efficiency"]["source"] == "assumed" else "predicted",
        },
        "epoch_time_s": predicted("epoch_time_s"),
        "total_time_s": predicted("total_time_s"),
        "cost_usd": predicted("cost_usd"),
        "pareto": bool(front[i]),
    }
