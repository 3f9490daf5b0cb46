"""Fit the performance model from a job's measurements (pure functions; numpy/scipy only).

Each fitted term reports its parameters and fit quality, and labels every input as measured,
fitted, spec (given by the user) or assumed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tula_service.catalogs import interconnect
from tula_service.perfmodel import EpochModel, MemoryModel, NoiseScaleModel
from tula_service.perfmodel.comm_fit import fit_comm_record
from tula_service.perfmodel.compute import select_compute_model
from tula_service.perfmodel.network import ASSUMED_LATENCY_S, HierarchicalAllReduce, Link
from tula_service.perfmodel.overlap import OverlapModel
from tula_service.perfmodel.validation import error_summary, leave_one_out_relative_errors
from tula_service.planner import FittedModels
from tula_service.spec import JobSpec


DEFAULT_INTRA_NODE_LINK = "pcie4_x16"  # conservative when the spec names no link
DEFAULT_INTER_NODE_LINK = "ethernet_100g"


def _link_report(link: Link) -> dict[str, Any]:
    return {
        "name": link.name or None,
        "bandwidth_gbps": {"value": link.bandwidth_gbps, "source": link.source},
        "latency_s": {"value": link.latency_s, "source": link.source if link.source != "spec" else "assumed"},
    }


def _spec_link(cluster, catalog_name: str | None, default_name: str) -> Link:
    """A link named in the spec (catalog), else the spec's interconnect_gbps, else a stated default."""
    if catalog_name:
        return interconnect(catalog_name)
    if cluster.interconnect_gbps:
        return Link(latency_s=ASSUMED_LATENCY_S, bandwidth_gbps=cluster.interconnect_gbps, source="spec", name="interconnect_gbps")
    return interconnect(default_name)


def _measured_link(comm: dict[str, Any] | None, report: dict[str, Any]) -> Link | None:
    """The intra-node link fitted from the all-reduce benchmark, when it ran on GPUs (NCCL)."""
    if comm is None:
        return None
    try:
        fit = fit_comm_record(comm)
    except ValueError as error:
        report["measured_link"] = {"error": str(error)}
        return None
    report["measured_link"] = {**fit.quality(), "backend": comm.get("backend"), "device": comm.get("device")}
    if not np.isfinite(fit.bandwidth_gbps_):
        report["measured_link"]["bandwidth_gbps"] = None
        report["measured_link"]["note"] = "time did not grow with message size: latency-bound, bandwidth unresolved"
        return None
    if comm.get("backend") != "nccl":
        report["note"] = (
            "the all-reduce benchmark ran with gloo on CPU processes of the profiling host: it measures that "
            "host's memory copies and loopback, not the cluster's GPU interconnect, so it is reported, not used"
        )
        return None
    return Link(latency_s=fit.latency_s_, bandwidth_gbps=fit.bandwidth_gbps_, source="fitted", name="measured (nccl)")


def _network(spec: JobSpec, gradient_bytes: int, comm: dict[str, Any] | None) -> tuple[HierarchicalAllReduce, dict[str, Any]]:
    """Hierarchical ring all-reduce: the intra-node link is measured (NCCL benchmark) when possible,
    else named in the spec or its interconnect_gbps, else an assumed catalog default; the inter-node
    link likewise from the spec or the catalog."""
    cluster = spec.cluster
    report: dict[str, Any] = {
        "formula": "ring over g = min(n, gpus_per_node) devices on the intra-node link, then over the m nodes "
        "on the inter-node link with S/g bytes: T = ring(g, S, intra) + ring(m, S/g, inter); "
        "ring(n, S, link) = 2(n-1) latency_s + 2(n-1)/n S / bandwidth",
        "gradient_bytes": {"value": gradient_bytes, "source": "measured"},
    }
    intra = _measured_link(comm, report) or _spec_link(cluster, cluster.intra_node_link, DEFAULT_INTRA_NODE_LINK)
    inter = _spec_link(cluster, cluster.inter_node_link, DEFAULT_INTER_NODE_LINK)
    report["intra_node"] = _link_report(intra)
    report["inter_node"] = _link_report(inter) if cluster.nodes > 1 else None
    return HierarchicalAllReduce(gradient_bytes, cluster.gpus_per_node, intra, inter), report


def fit_models(spec: JobSpec, ok: list[dict[str, Any]], comm: dict[str, Any] | None = None) -> tuple[FittedModels, dict[str, Any]]:
    batch = np.array([m["batch_size"] for m in ok], dtype=float)
    peak_bytes = np.array([m["memory"]["peak_bytes"] for m in ok], dtype=float)
    iter_time_s = np.array([m["iter_time"]["median_s"] for m in ok], dtype=float)
    with_stats = [m["gradient"] for m in ok if m.get("gradient")]

    memory = MemoryModel().fit(batch, peak_bytes)
    compute, compute_report = select_compute_model(batch, iter_time_s)
    chosen_compute = type(compute)
    gradient_bytes = ok[0]["model"]["gradient_bytes"]
    network, network_report = _network(spec, gradient_bytes, comm)
    overlap = OverlapModel()
    noise = NoiseScaleModel().fit(
        [g["true_grad_sq_norm"] for g in with_stats],
        [g["trace_sigma"] for g in with_stats],
        [g["iterations"] * g["batch"] for g in with_stats],
    ) if with_stats else None
    epochs = EpochModel(
        spec.training.reference_batch, spec.training.reference_epochs, noise.noise_scale_ if noise else None,
        spec.training.max_step_gain,
    )

    report = {
        "memory": {
            "formula": "M(b) = static_bytes + act_bytes_per_sample * b",
            "static_bytes": float(memory.static_bytes_),
            "act_bytes_per_sample": float(memory.act_bytes_per_sample_),
            "r2": memory.r2_,
            "residual_std_bytes": memory.residual_std_bytes_,
            "max_batch_rule": "the 95% prediction interval's upper bound must fit the device (with the margin)",
            "leave_one_out": error_summary(leave_one_out_relative_errors(MemoryModel, batch, peak_bytes)),
            "source": "fitted",
        },
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
        "efficiency": _efficiency_report(noise, epochs),
    }
    return FittedModels(memory, compute, network, epochs, overlap), report


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
    floor = epochs.max_step_gain is not None
    return {
        "formula": "E(B) = E_min (1 + B / B_noise), E_min from the reference run"
        + ("; never below E_ref B / (B_ref max_step_gain)" if floor else ""),
        "noise_scale": {"value": noise.noise_scale_, "stderr": noise.noise_scale_stderr_, "source": "fitted"},
        "max_step_gain": {
            "value": epochs.max_step_gain, "source": "spec",
            "why": "training.max_lr / reference_lr (squared for Adam): the LR, and with it the progress per step, "
            "cannot grow past max_lr, so a step is worth at most this many reference steps",
        } if floor else None,  # fmt: skip
        "true_grad_sq_norm": noise.true_grad_sq_norm_,
        "trace_sigma": noise.trace_sigma_,
        "min_epochs": {"value": epochs.min_epochs, "source": "fitted"},
        "source": "fitted",
        "points": noise.points_,
        "note": "noise scale measured in the first iterations of training; it grows as the loss falls "
        "(McCandlish et al. 2018), so E(B) is anchored to the reference run",
    }
