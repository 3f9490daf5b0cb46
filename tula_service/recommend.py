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
from tula_service.perfmodel.comm_fit import fit_comm_record
from tula_service.perfmodel.validation import error_summary, leave_one_out_relative_errors
from tula_service.maxbatch import bracket
from tula_service.planner import ACCUMULATION_STEPS, GIB, MEMORY_MARGIN, FittedModels, PlanInputs, choose, sweep
from tula_service.spec import JobSpec, powers_of_two_between


class NotEnoughMeasurements(ValueError):
    """Fewer than two usable points: a line cannot be fitted."""


def _usable(measurements: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int]]:
    """Successful compute points (one per batch size: the last taken) and the batches that ran out of memory."""
    compute = [m for m in measurements if m.get("kind", "compute") == "compute"]
    ok_by_batch = {m["batch_size"]: m for m in compute if m.get("status") == "ok"}
    oom_batches = sorted({m["batch_size"] for m in compute if m.get("status") == "oom"})
    return [ok_by_batch[b] for b in sorted(ok_by_batch)], oom_batches


def _network(spec: JobSpec, gradient_bytes: int, comm: dict[str, Any] | None) -> tuple[RingAllReduce, dict[str, Any]]:
    """The ring all-reduce model: a measured link when the benchmark ran on the GPUs' own collective
    library (NCCL), else the spec's interconnect with an assumed per-hop latency."""
    report: dict[str, Any] = {
        "formula": "T_net(n) = 2(n-1) latency_s + 2(n-1)/n gradient_bytes / bandwidth",
        "gradient_bytes": {"value": gradient_bytes, "source": "measured"},
    }
    measured = None
    if comm is not None:
        try:
            fit = fit_comm_record(comm)
            measured = fit if comm.get("backend") == "nccl" and np.isfinite(fit.bandwidth_gbps_) else None
            report["measured_link"] = {**fit.quality(), "backend": comm.get("backend"), "device": comm.get("device")}
            if not np.isfinite(fit.bandwidth_gbps_):
                report["measured_link"]["bandwidth_gbps"] = None
                report["measured_link"]["note"] = "time did not grow with message size: latency-bound, bandwidth unresolved"
        except ValueError as error:
            report["measured_link"] = {"error": str(error)}
    if measured is not None:
        report["bandwidth_gbps"] = {"value": measured.bandwidth_gbps_, "source": "fitted"}
        report["latency_s"] = {"value": measured.latency_s_, "source": "fitted"}
        return measured.to_ring_all_reduce(gradient_bytes), report
    network = RingAllReduce(gradient_bytes=gradient_bytes, bandwidth_gbps=spec.cluster.interconnect_gbps)
    report["bandwidth_gbps"] = {"value": spec.cluster.interconnect_gbps, "source": "spec"}
    report["latency_s"] = {"value": network.latency_s, "source": "assumed"}
    if comm is not None:
        report["note"] = (
            "the all-reduce benchmark ran with gloo on CPU processes of the profiling host: it measures that "
            "host's memory copies and loopback, not the cluster's GPU interconnect, so the spec's bandwidth is used"
        )
    return network, report


def fit_models(spec: JobSpec, ok: list[dict[str, Any]], comm: dict[str, Any] | None = None) -> tuple[FittedModels, dict[str, Any]]:
    batch = np.array([m["batch_size"] for m in ok], dtype=float)
    peak_bytes = np.array([m["memory"]["peak_bytes"] for m in ok], dtype=float)
    iter_time_s = np.array([m["iter_time"]["median_s"] for m in ok], dtype=float)
    with_stats = [m["gradient"] for m in ok if m.get("gradient")]

    memory = MemoryModel().fit(batch, peak_bytes)
    compute = ComputeModel().fit(batch, iter_time_s)
    gradient_bytes = ok[0]["model"]["gradient_bytes"]
    network, network_report = _network(spec, gradient_bytes, comm)
    noise = NoiseScaleModel().fit(
        [g["true_grad_sq_norm"] for g in with_stats],
        [g["trace_sigma"] for g in with_stats],
        [g["iterations"] * g["batch"] for g in with_stats],
    ) if with_stats else None
    epochs = EpochModel(
        spec.training.reference_batch, spec.training.reference_epochs, noise.noise_scale_ if noise else None
    )

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
        "network": network_report,
        "overlap": {"g": {"value": 1.0, "source": "assumed", "note": "no compute/communication overlap (conservative)"}},
        "efficiency": _efficiency_report(noise, epochs),
    }
    return FittedModels(memory, compute, network, epochs), report


def _efficiency_report(noise: NoiseScaleModel | None, epochs: EpochModel) -> dict[str, Any]:
    if noise is None or not noise.informative_:
        return {
            "formula": "E(B) = reference_epochs * max(1, B / reference_batch)",
            "noise_scale": None,
            "source": "assumed",
            "note": "no informative noise-scale measurement (none taken, or the pooled |G|^2 or tr(Sigma) "
            "is not positive: the gradient signal is below what the profiled batches resolve); assumed: "
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
        "points": noise.points_,
        "note": "noise scale measured in the first iterations of training; it grows as the loss falls "
        "(McCandlish et al. 2018), so E(B) is anchored to the reference run",
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
    comm = next((m for m in measurements if m.get("kind") == "comm" and m.get("status") == "ok"), None)
    models, report = fit_models(spec, ok, comm)
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
    tokens_per_sample = ok[0]["model"].get("tokens_per_sample")
    if tokens_per_sample:  # language models: a batch is counted in sequences and in tokens
        for row in rows:
            row["global_batch_tokens"] = row["global_batch"] * tokens_per_sample
    return {
        "objective": spec.objective,
        "batch_unit": {"unit": "sequences" if tokens_per_sample else "samples", "tokens_per_sample": tokens_per_sample},
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
            "memory_limit": _measured_limit(sorted(measured), oom_batches),
            "failed": failed_points or [],
            "points": [_point_summary(m) for m in ok],
        },
    }


def _measured_limit(ok_batches: list[int], oom_batches: list[int]) -> dict[str, Any] | None:
    """The largest batch that ran and the smallest that did not, on the profiling device."""
    limits = bracket(ok_batches, oom_batches)
    if limits is None:
        return None
    return {"largest_ok_batch": limits[0], "smallest_oom_batch": limits[1], "source": "measured"}


def _point_summary(m: dict[str, Any]) -> dict[str, Any]:
    gradient = m.get("gradient") or {}
    return {
        "batch_size": m["batch_size"],
        "iter_time_median_s": m["iter_time"]["median_s"],
        "iter_time_p10_s": m["iter_time"].get("p10_s"),
        "iter_time_p90_s": m["iter_time"].get("p90_s"),
        "iter_time_cv": m["iter_time"].get("cv"),
        "samples": m["iter_time"].get("count"),
        "peak_bytes": m["memory"]["peak_bytes"],
        "activation_bytes": m["memory"].get("activation_bytes"),
        "noise_scale": gradient.get("noise_scale"),
        "variability_median": gradient.get("variability_median"),
        "options": m.get("options"),
        "source": "measured",
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
