"""Sweep (per-device batch x devices x accumulation), predict time and cost, pick a configuration.

Per candidate (per-device batch b, devices n, accumulation steps a; global batch B = b n a):

    T_iter  = T_comp(b) + T_net(n)              (overlap exponent g = 1: no overlap, conservative)
    T_step  = (a - 1) T_comp(b) + T_iter        (design.md; AdaptDL goodput model)
    steps   = ceil(D / B) per epoch
    time    = E(B) * steps * T_step
    cost    = time_h * n * price                      (pricing kind gpu_hour)
            = time_h * n * M(b) / GiB * price         (pricing kind memory_gb_hour; memory actually used)

Vectorized over all candidates with numpy broadcasting; memory-infeasible candidates are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tula_service.knee import Knee, find_knee
from tula_service.perfmodel import ComputeModel, EpochModel, MemoryModel, RingAllReduce

GIB = 2**30
ACCUMULATION_STEPS = (1, 2, 4, 8)
MEMORY_MARGIN = 0.05


@dataclass(frozen=True)
class FittedModels:
    memory: MemoryModel
    compute: ComputeModel
    network: RingAllReduce
    epochs: EpochModel


@dataclass(frozen=True)
class PlanInputs:
    device_batches: np.ndarray  # candidate per-device batches (already within what was profiled)
    total_devices: int
    device_memory_bytes: float
    num_samples: int
    pricing_kind: str
    price: float
    objective: str


def device_counts(total_devices: int) -> np.ndarray:
    """1, 2, 4, ... up to the cluster size, and the cluster size itself."""
    counts = {total_devices}
    n = 1
    while n <= total_devices:
        counts.add(n)
        n *= 2
    return np.array(sorted(counts))


def sweep(models: FittedModels, inputs: PlanInputs) -> dict[str, np.ndarray]:
    max_batch = models.memory.max_device_batch(inputs.device_memory_bytes, MEMORY_MARGIN)
    batches = inputs.device_batches[inputs.device_batches <= max_batch]
    b, n, a = (
        grid.ravel()
        for grid in np.meshgrid(batches, device_counts(inputs.total_devices), np.array(ACCUMULATION_STEPS), indexing="ij")
    )
    global_batch = b * n * a
    memory_bytes = models.memory.predict(b)
    compute_s = models.compute.predict(b)
    iter_time_s = compute_s + models.network.predict(n)
    step_time_s = (a - 1) * compute_s + iter_time_s
    steps_per_epoch = np.ceil(inputs.num_samples / global_batch)
    epochs = models.epochs.predict(global_batch)
    epoch_time_s = steps_per_epoch * step_time_s
    total_time_s = epochs * epoch_time_s
    hours = total_time_s / 3600.0
    if inputs.pricing_kind == "gpu_hour":
        cost_usd = hours * n * inputs.price
    else:
        cost_usd = hours * n * memory_bytes / GIB * inputs.price
    return {
        "device_batch": b,
        "devices": n,
        "accumulation": a,
        "global_batch": global_batch,
        "memory_bytes": memory_bytes,
        "iter_time_s": iter_time_s,
        "step_time_s": step_time_s,
        "epochs": epochs,
        "epoch_time_s": epoch_time_s,
        "total_time_s": total_time_s,
        "cost_usd": cost_usd,
        "max_device_batch": np.full(b.shape, max_batch),
    }


def pareto_mask(time_s: np.ndarray, cost_usd: np.ndarray) -> np.ndarray:
    """True where no other candidate is at least as fast and as cheap, and strictly better in one."""
    order = np.lexsort((cost_usd, time_s))
    mask = np.zeros(time_s.size, dtype=bool)
    best_cost = np.inf
    for index in order:
        if cost_usd[index] < best_cost:
            mask[index] = True
            best_cost = cost_usd[index]
    return mask


def choose(candidates: dict[str, np.ndarray], objective: str) -> tuple[int, Knee | None, np.ndarray]:
    """Index of the chosen candidate, the knee (for objective "knee") and the Pareto mask.

    The knee is always a point of the (time, cost) Pareto front: Kneedle runs over the front's
    points ordered by global batch (see `tula_service.knee`), and at the knee batch the fastest
    front point is chosen.
    """
    time_s, cost_usd = candidates["total_time_s"], candidates["cost_usd"]
    front = pareto_mask(time_s, cost_usd)
    if objective == "min_time":
        return int(np.lexsort((cost_usd, time_s))[0]), None, front
    if objective == "min_cost":
        return int(np.lexsort((time_s, cost_usd))[0]), None, front
    knee = find_knee(candidates["global_batch"][front], time_s[front])
    at_knee = np.flatnonzero(front & (candidates["global_batch"] == knee.global_batch))
    return int(at_knee[np.argmin(time_s[at_knee])]), knee, front
