"""Seconds per training step on a placement: what the planner sweeps with.

A placement is g GPUs on the busiest of m nodes, n GPUs in all. Two models give T_iter(b, g, m, n), one
micro-batch step of b samples per GPU with its gradient all-reduce, and T_micro(b, g), one accumulation
micro-step (compute only):

- AnalyticStepTime, when no multi-device step was measured: the single-device compute model, the
  hierarchical ring all-reduce over the cluster's links (tula_service.fit.links; measured by the NCCL
  benchmark, else named in the spec, else the catalog's) and the overlap model (g = 1 assumed),

      T_iter = ((T_c(b))^gamma + T_net(g, m)^gamma)^(1/gamma),   T_micro = T_c(b);

  its multi-device numbers are predictions from assumed links, and the report says so.
- MeasuredStepTime, when steps were measured on two or more devices (StepMeasurement): the placement-aware
  model of tula_service.fit.perfmodel.placement fitted to them together with the single-device compute
  points (Pollux's approach: fit the throughput model to measured steps, Qiao et al. OSDI 2021),

      T_iter = (T_c(b)^gamma + T_r(g, m, n)^gamma)^(1/gamma) + kappa (g - 1) T_c(b),   T_micro = (1 + kappa (g - 1)) T_c(b),

  with its shape chosen by leave-one-placement-out error and that error reported. kappa (g - 1) T_c(b) is the
  wait for the slowest of a node's g GPUs: it grows on every micro-step and shows at the all-reduce.

In both, T_step = (a - 1) T_micro + T_iter for a accumulation steps (design.md).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from tula_service.fit.perfmodel.compute import ComputeModel
from tula_service.fit.perfmodel.network import HierarchicalAllReduce
from tula_service.fit.perfmodel.overlap import OverlapModel
from tula_service.fit.perfmodel.placement import CommRow, PlacementStepModel, StepRow
from tula_service.measurement import CommMeasurement, ComputeMeasurement, StepMeasurement


class StepTimeModel(Protocol):
    source: str  # "predicted" from fitted terms: where multi-device steps come from is in describe()

    def iter_s(self, device_batch: np.ndarray, per_node: np.ndarray, nodes: np.ndarray, devices: np.ndarray) -> np.ndarray:
        """Seconds of one micro-batch step with its all-reduce."""

    def micro_s(self, device_batch: np.ndarray, per_node: np.ndarray) -> np.ndarray:
        """Seconds of one accumulation micro-step (no all-reduce)."""

    def describe(self) -> dict[str, Any]: ...


class AnalyticStepTime:
    """Compute model + ring all-reduce over the given links + overlap (module docstring)."""

    def __init__(self, compute: ComputeModel, network: HierarchicalAllReduce, overlap: OverlapModel):
        self.compute, self.network, self.overlap = compute, network, overlap
        self.source = "predicted"

    def iter_s(self, device_batch, per_node, nodes, devices) -> np.ndarray:
        compute_s = self.compute.predict(device_batch)
        network_s = np.where(np.asarray(devices) > 1, self.network.predict_placement(per_node, nodes), 0.0)
        return self.overlap.combine(compute_s, network_s)

    def micro_s(self, device_batch, per_node) -> np.ndarray:
        return self.compute.predict(device_batch) * np.ones_like(np.asarray(per_node, dtype=float))

    def describe(self) -> dict[str, Any]:
        return {
            "model": "analytic",
            "formula": "T_iter = (T_c(b)^g + T_net(per_node, nodes)^g)^(1/g); T_step = (a - 1) T_c(b) + T_iter",
            "multi_device_steps": 0,
            "note": "no multi-device step was measured: the step time on several devices is predicted from the links "
            "in models.network and an overlap exponent that is assumed (give step measurements to fit them)",
        }


class MeasuredStepTime:
    """PlacementStepModel fitted to measured steps (module docstring)."""

    def __init__(self, model: PlacementStepModel, rows: int, placements: list[str]):
        self.model, self.rows, self.placements = model, rows, placements
        self.source = "predicted"

    def iter_s(self, device_batch, per_node, nodes, devices) -> np.ndarray:
        return self.model.predict(per_node, nodes, devices, device_batch)

    def micro_s(self, device_batch, per_node) -> np.ndarray:
        return self.model.micro_step_s(per_node, device_batch)

    def held_out_rel_err(self) -> float | None:
        held_out = self.model.candidates_.get(self.model.shape_.name, {}).get("held_out")
        return held_out["median_rel_err"] if held_out else None

    def describe(self) -> dict[str, Any]:
        return {
            "model": "placement",
            "formula": "T_iter = (T_c(b)^gamma + T_r(placement)^gamma)^(1/gamma) + kappa (g - 1) T_c(b); "
            "T_step = (a - 1) (1 + kappa (g - 1)) T_c(b) + T_iter",
            "multi_device_steps": self.rows,
            "placements": self.placements,
            "held_out_median_rel_err": self.held_out_rel_err(),
            **self.model.describe(),
        }


def single_device_rows(ok: list[ComputeMeasurement]) -> list[StepRow]:
    """The compute points as steps on one GPU: their median iteration time at their batch."""
    return [StepRow((1,), float(m.batch_size), float(m.iter_time.median_s)) for m in ok]


def step_rows(steps: list[StepMeasurement]) -> list[StepRow]:
    return [StepRow(tuple(s.placement), float(s.device_batch), float(s.step_time_s), s.sync_time_s) for s in steps]


def benchmark_rows(comm: CommMeasurement | None) -> tuple[CommRow, ...]:
    """The all-reduce benchmark's points, where they measure the GPUs' intra-node link (NCCL; gloo on CPU
    processes measures the profiling host, not the interconnect)."""
    if comm is None or not comm.ok or comm.backend != "nccl":
        return ()
    return tuple(CommRow(p.world_size, float(p.message_bytes), float(p.median_s)) for p in comm.points)


def fit_step_time(
    one_device: list[StepRow], steps: list[StepMeasurement], compute: ComputeModel, network: HierarchicalAllReduce,
    overlap: OverlapModel, gradient_bytes: float | None, comm: CommMeasurement | None = None,
) -> StepTimeModel:
    """MeasuredStepTime when steps on two or more devices were measured, else AnalyticStepTime. one_device: every
    single-device timing (the compute points and the steps on one GPU), which time T_c(b). The NCCL all-reduce
    benchmark, when there is one, joins the fit of the intra-node link (perfmodel.placement)."""
    multi = [s for s in steps if s.devices > 1]
    if not multi:
        return AnalyticStepTime(compute, network, overlap)
    model = PlacementStepModel(intra=network.intra, inter=network.inter, gradient_bytes=gradient_bytes, comm_rows=benchmark_rows(comm))
    model.fit(one_device + step_rows(multi))
    placements = sorted({"".join(map(str, s.placement)) for s in multi})
    return MeasuredStepTime(model, len(multi), placements)
