"""Fit the performance model from a job's measurements (pure functions; numpy/scipy only).

Each fitted term reports its parameters and fit quality, and labels every input as measured,
fitted, spec (given by the user) or assumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tula_service.fit.efficiency_evidence import epoch_model
from tula_service.fit.links import cluster_links, link_report
from tula_service.fit.perfmodel import MemoryModel
from tula_service.fit.perfmodel.memory import UnmeasuredMemory
from tula_service.fit.perfmodel.comm_fit import fit_comm_record
from tula_service.fit.perfmodel.compute import ComputeModel, select_compute_model
from tula_service.fit.perfmodel.efficiency import EfficiencyModel
from tula_service.fit.perfmodel.network import HierarchicalAllReduce, Link
from tula_service.fit.perfmodel.overlap import OverlapModel
from tula_service.fit.perfmodel.validation import error_summary, leave_one_out_relative_errors
from tula_service.fit.step_time import MeasuredStepTime, StepTimeModel, fit_step_time, single_device_rows, step_rows
from tula_service.measurement import CommMeasurement, ComputeMeasurement, PilotMeasurement, StepMeasurement
from tula_service.spec.job_spec import JobSpec


class NotEnoughSteps(ValueError):
    """Steps alone that cannot predict the all-reduce (the gradient's size unknown and too few placements)."""


@dataclass(frozen=True)
class FittedModels:
    """What the planner sweeps with: one fitted model per term of the performance model."""

    memory: MemoryModel
    compute: ComputeModel
    network: object  # anything with predict(devices) -> seconds (RingAllReduce, HierarchicalAllReduce)
    epochs: EfficiencyModel  # EpochModel: predict epochs, step gain, LR multiplier
    step: StepTimeModel  # seconds per step on a placement (tula_service.fit.step_time)
    overlap: OverlapModel = field(default_factory=OverlapModel)


def _measured_link(comm: CommMeasurement | None, report: dict[str, Any]) -> Link | None:
    """The intra-node link fitted from the all-reduce benchmark, when it ran on GPUs (NCCL)."""
    if comm is None:
        return None
    try:
        fit = fit_comm_record(comm)
    except ValueError as error:
        report["measured_link"] = {"error": str(error)}
        return None
    report["measured_link"] = {**fit.quality(), "backend": comm.backend, "device": comm.device}
    if not np.isfinite(fit.bandwidth_gbps_):
        report["measured_link"]["bandwidth_gbps"] = None
        report["measured_link"]["note"] = "time did not grow with message size: latency-bound, bandwidth unresolved"
        return None
    if comm.backend != "nccl":
        report["note"] = (
            "the all-reduce benchmark ran with gloo on CPU processes of the profiling host: it measures that "
            "host's memory copies and loopback, not the cluster's GPU interconnect, so it is reported, not used"
        )
        return None
    return Link(latency_s=fit.latency_s_, bandwidth_gbps=fit.bandwidth_gbps_, source="fitted", name="measured (nccl)")


def _network(spec: JobSpec, gradient_bytes: int | None, comm: CommMeasurement | None) -> tuple[HierarchicalAllReduce, dict[str, Any]]:
    """Hierarchical ring all-reduce over the links tula_service.fit.links picks: the intra-node link measured
    (NCCL benchmark) when possible, else the spec's or the catalog's; the inter-node link the spec's or
    the catalog's."""
    cluster = spec.cluster
    report: dict[str, Any] = {
        "formula": "ring over g = min(n, gpus_per_node) devices on the intra-node link, then over the m nodes "
        "on the inter-node link with S/g bytes: T = ring(g, S, intra) + ring(m, S/g, inter); "
        "ring(n, S, link) = 2(n-1) latency_s + 2(n-1)/n S / bandwidth",
        "gradient_bytes": {"value": gradient_bytes, "source": "measured"} if gradient_bytes is not None else
        {"value": None, "source": "assumed", "note": "unknown: no profiled compute point gave the model's size"},
    }
    intra, inter = cluster_links(cluster, _measured_link(comm, report))
    report["intra_node"] = link_report(intra)
    report["inter_node"] = link_report(inter) if cluster.nodes > 1 else None
    size = float(gradient_bytes) if gradient_bytes is not None else float("nan")
    return HierarchicalAllReduce(size, cluster.gpus_per_node, intra, inter), report


def _check_links_fitted(spec: JobSpec, step: StepTimeModel) -> None:
    """With the gradient's size unknown, the links the sweep will use must be fitted to measured steps."""
    used = [link for link, used in (("intra", spec.cluster.gpus_per_node > 1), ("inter", spec.cluster.nodes > 1)) if used]
    unfitted = used if not isinstance(step, MeasuredStepTime) else [link for link in used if step.model.sources_[link] == "assumed"]
    if unfitted:
        raise NotEnoughSteps(
            "without a profiled compute point the gradient's size is unknown, so the all-reduce over the "
            f"{' and '.join(f'{link}-node' for link in unfitted)} link cannot be predicted from the links: give steps measured "
            "on two or more GPUs, at 3 or more placements that use that link (or compute measurements)"
        )


def fit_models(
    spec: JobSpec, ok: list[ComputeMeasurement], comm: CommMeasurement | None = None, pilot: PilotMeasurement | None = None,
    steps: list[StepMeasurement] | None = None, earlier_headroom: dict[str, Any] | None = None,
) -> tuple[FittedModels, dict[str, Any]]:
    """Every term of the performance model fitted to a job's measurements (parsed: tula_service.measurement):
    the successful compute points, the all-reduce benchmark, the pilot and measured multi-device steps, when
    there are ones.

    Without compute points (steps from a trainer, a trace or a CSV only), the single-device steps time the
    compute model, memory is not measured (UnmeasuredMemory: no batch above the largest that ran), the
    gradient's size is unknown, and so multi-device steps must be measured on enough placements to fit
    the step-time model (NotEnoughSteps otherwise). earlier_headroom: the job's LR stability headroom when a run
    is re-planned from its live records (efficiency_evidence.measured_lr_headroom)."""
    steps = steps or []
    single = single_device_rows(ok) + [r for r in step_rows(steps) if sum(r.placement) == 1]
    batch = np.array([r.device_batch for r in single], dtype=float)
    iter_time_s = np.array([r.step_time_s for r in single], dtype=float)
    compute, compute_report = select_compute_model(batch, iter_time_s)
    chosen_compute = type(compute)
    if ok:
        memory_batch = np.array([m.batch_size for m in ok], dtype=float)
        peak_bytes = np.array([m.memory.peak_bytes for m in ok], dtype=float)
        memory = MemoryModel().fit(memory_batch, peak_bytes)
        memory_report = {
            "formula": "M(b) = static_bytes + act_bytes_per_sample * b",
            "static_bytes": float(memory.static_bytes_),
            "act_bytes_per_sample": float(memory.act_bytes_per_sample_),
            "r2": memory.r2_,
            "residual_std_bytes": memory.residual_std_bytes_,
            "max_batch_rule": "the 95% prediction interval's upper bound must fit the device (with the margin)",
            "leave_one_out": error_summary(leave_one_out_relative_errors(MemoryModel, memory_batch, peak_bytes)),
            "source": "fitted",
        }
    else:
        memory = UnmeasuredMemory(int(batch.max()))
        memory_report = memory.report()
    gradient_bytes = ok[0].model.gradient_bytes if ok else None
    network, network_report = _network(spec, gradient_bytes, comm)
    overlap = OverlapModel()
    epochs, efficiency_report = epoch_model(spec, ok, pilot, earlier_headroom)
    step = fit_step_time(single, steps, compute, network, overlap, gradient_bytes, comm)  # benchmark_rows keeps an ok NCCL record
    if gradient_bytes is None:
        _check_links_fitted(spec, step)

    report = {
        "memory": memory_report,
        "compute": {
            **compute.describe(),
            "selection": compute_report,
            "leave_one_out": error_summary(leave_one_out_relative_errors(chosen_compute, batch, iter_time_s)),
            "source": "fitted",
        },
        "network": network_report,
        "overlap": {
            "formula": "T_iter = (T_comp^g + T_net^g)^(1/g)",
            "g": {"value": overlap.g_, "source": overlap.source_,
                  "note": "no multi-device iteration measured: no compute/communication overlap assumed (conservative)"},
        },
        "step_time": step.describe(),
        "efficiency": efficiency_report,
    }
    if isinstance(step, MeasuredStepTime):
        gamma = step.model.params_()["gamma"]
        report["overlap"] = {
            "formula": report["overlap"]["formula"],
            "g": {"value": gamma["value"], "source": "fitted" if step.model.shape_.overlap else "assumed", "note": gamma["source"]},
            "from": "step_time: fitted with the placement model to the measured multi-device steps",
        }  # fmt: skip
    return FittedModels(memory, compute, network, epochs, step, overlap), report
