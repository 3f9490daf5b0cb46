"""Sweep (per-device batch x devices on a placement x accumulation), predict time and cost, pick a configuration.

Per candidate (per-device batch b, n devices placed g on the busiest of m nodes, accumulation steps a;
global batch B = b n a). Placements (`placements`): packed (g = min(n, gpus_per_node), m = ceil(n /
gpus_per_node)) and, on a cluster of several nodes, spread (m = min(n, nodes), g = ceil(n / m)) and even
over the power-of-two node counts between: GPUs that share a node share its NIC and host, so spreading can
be faster, and under node-hour pricing it costs more nodes.

    T_iter  = the step-time model's micro-step with its all-reduce (tula_service.fit.step_time):
              (T_comp(b)^g + T_net(placement)^g)^(1/g) from the links, or the placement model fitted to
              measured multi-device steps
    T_step  = (a - 1) T_micro(b) + T_iter         (design.md; AdaptDL's goodput model)
    epoch   = floor(D / B) T_step + T_last        (a loader without drop_last: the last step holds r = D mod B)
    T_last  = (k - 1) T_micro(b) + T_iter(l)  when r > 0 (else 0), where each device
              gets ceil(r / n) samples in k = ceil(ceil(r / n) / b) micro-batches, the last of l samples
    time    = E(B) * epoch
    cost    = overhead + time_h * billed_units * price   (billed_units per pricing kind: tula_service.plan.pricing)

Vectorized over all candidates with numpy broadcasting; memory-infeasible candidates are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tula_service.fit.fitting import FittedModels
from tula_service.fit.perfmodel import MemoryModel
from tula_service.fit.step_time import StepTimeModel
from tula_service.plan.knee import Knee, find_knee
from tula_service.plan.pricing import pricing_rule

ACCUMULATION_STEPS = (1, 2, 4, 8)
MEMORY_MARGIN = 0.05


@dataclass(frozen=True)
class PlanInputs:
    device_batches: np.ndarray  # candidate per-device batches (already within what was profiled)
    total_devices: int
    device_memory_bytes: float
    num_samples: int
    pricing_kind: str
    price: float
    gpus_per_node: int = 1
    fixed_overhead_usd: float = 0.0
    nodes: int = 1
    device_counts: np.ndarray | None = None  # default: powers of two up to the cluster, and the cluster
    accumulation_steps: tuple[int, ...] = ACCUMULATION_STEPS


def max_device_batch(memory: MemoryModel, capacity_bytes: float) -> int:
    """Largest per-device batch whose memory, at the upper end of its 95% prediction interval, fits."""
    return memory.max_device_batch(capacity_bytes, MEMORY_MARGIN, upper=True)


def device_counts(total_devices: int) -> np.ndarray:
    """1, 2, 4, ... up to the cluster size, and the cluster size itself."""
    counts = {total_devices}
    n = 1
    while n <= total_devices:
        counts.add(n)
        n *= 2
    return np.array(sorted(counts))


PACKED, EVEN, SPREAD = 0, 1, 2
PLACEMENT_KINDS = ("packed", "even", "spread")


def placements(counts: np.ndarray, nodes: int, gpus_per_node: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(n, g, m, kind) of the placements swept for each device count n: packed on the fewest nodes
    (m = ceil(n / gpus_per_node), nodes filled in turn), spread over as many as can hold one
    (m = min(n, nodes)), and, between them, evenly over each power-of-two node count; g = GPUs on the
    busiest node (ceil(n / m) when dealt evenly)."""
    rows = []
    for n in (int(count) for count in np.asarray(counts)):
        fewest, most = -(-n // gpus_per_node), min(n, nodes)
        rows.append((n, min(n, gpus_per_node), fewest, PACKED))
        between = [2**k for k in range(1, most.bit_length()) if fewest < 2**k < most]
        rows += [(n, -(-n // m), m, EVEN) for m in between]
        if most > fewest:
            rows.append((n, -(-n // most), most, SPREAD))
    n, g, m, kind = (np.array(column, dtype=float) for column in zip(*rows))
    return n, g, m, kind.astype(int)


def gpus_on_nodes(devices: int, nodes: int, per_node: int, kind: int) -> list[int]:
    """The GPUs used on each node: packed fills nodes of per_node in turn; even and spread deal them out."""
    if kind == PACKED:
        return [per_node] * (devices // per_node) + ([devices % per_node] if devices % per_node else [])
    return [devices // nodes + (1 if i < devices % nodes else 0) for i in range(nodes)]


def cost_usd(inputs: PlanInputs, hours: np.ndarray, devices: np.ndarray, nodes: np.ndarray, memory_bytes: np.ndarray) -> np.ndarray:
    """USD per candidate: fixed_overhead_usd + hours * billed_units * price, billed by the rule of
    inputs.pricing_kind (tula_service.plan.pricing); ValueError naming the known kinds for another."""
    billed_units = pricing_rule(inputs.pricing_kind).billed_units(devices, nodes, memory_bytes)
    return inputs.fixed_overhead_usd + hours * billed_units * inputs.price


def epoch_seconds(
    step: StepTimeModel, num_samples: int, b: np.ndarray, n: np.ndarray, a: np.ndarray, g: np.ndarray, m: np.ndarray,
    micro_s: np.ndarray, step_time_s: np.ndarray,
) -> np.ndarray:
    """Seconds per epoch of D samples at per-device batch b, n devices (g on the busiest of m nodes), a
    accumulation steps (formula above); micro_s = T_micro(b) and step_time_s = T_step as the sweep computed them.

    The last step of an epoch holds the r = D mod B samples left over, as a DataLoader (or DistributedSampler)
    without drop_last delivers them; counting it as a full step, ceil(D / B) T_step, overstates an epoch
    by up to 2x once B nears D (docs/validation.md: digits, B = 1024 of D = 1437 samples, +43%).
    """
    global_batch = b * n * a
    full_steps = np.floor(num_samples / global_batch)
    left_over = num_samples - full_steps * global_batch
    per_device = np.ceil(left_over / n)
    micro_steps = np.maximum(1.0, np.ceil(per_device / b))
    last_micro = np.maximum(1.0, per_device - (micro_steps - 1) * b)
    last_step_s = (micro_steps - 1) * micro_s + step.iter_s(last_micro, g, m, n)
    return full_steps * step_time_s + np.where(left_over > 0, last_step_s, 0.0)


def sweep(models: FittedModels, inputs: PlanInputs) -> dict[str, np.ndarray]:
    max_batch = max_device_batch(models.memory, inputs.device_memory_bytes)
    batches = inputs.device_batches[inputs.device_batches <= max_batch]
    counts = device_counts(inputs.total_devices) if inputs.device_counts is None else inputs.device_counts
    place_n, place_g, place_m, place_kind = placements(counts, inputs.nodes, inputs.gpus_per_node)
    b, index, a = (
        grid.ravel()
        for grid in np.meshgrid(batches, np.arange(place_n.size), np.array(inputs.accumulation_steps), indexing="ij")
    )
    n, g, m = place_n[index], place_g[index], place_m[index]
    global_batch = b * n * a
    memory_bytes = models.memory.predict(b)
    step = models.step
    micro_s = step.micro_s(b, g)
    iter_time_s = step.iter_s(b, g, m, n)
    step_time_s = (a - 1) * micro_s + iter_time_s
    epochs = models.epochs.predict(global_batch)
    epoch_time_s = epoch_seconds(step, inputs.num_samples, b, n, a, g, m, micro_s, step_time_s)
    total_time_s = epochs * epoch_time_s
    return {
        "device_batch": b,
        "devices": n,
        "nodes": m,
        "per_node": g,
        "placement_kind": place_kind[index],
        "accumulation": a,
        "global_batch": global_batch,
        "memory_bytes": memory_bytes,
        "iter_time_s": iter_time_s,
        "step_time_s": step_time_s,
        "epochs": epochs,
        "epoch_time_s": epoch_time_s,
        "total_time_s": total_time_s,
        "cost_usd": cost_usd(inputs, total_time_s / 3600.0, n, m, memory_bytes),
    }


def pareto_mask(time_s: np.ndarray, cost_usd: np.ndarray) -> np.ndarray:
    """True where no other candidate is at least as fast and as cheap, and strictly better in one."""
    order = np.lexsort((cost_usd, time_s))
    sorted_cost = cost_usd[order]
    best_before = np.concatenate([[np.inf], np.minimum.accumulate(sorted_cost)[:-1]])
    mask = np.zeros(time_s.size, dtype=bool)
    mask[order] = sorted_cost < best_before
    return mask


@dataclass(frozen=True)
class Choice:
    index: int
    front: np.ndarray
    knee: Knee | None = None
    constraint: dict | None = None  # deadline/budget: {"kind", "limit", "met", "message"}


# What each objective ranks candidates by, ties broken by the other: "time" (then cost), "cost" (then
# time), or "knee" (the Pareto front's knee). deadline and budget rank as cost and time do, among the
# candidates within their limit. choose() and ranking() both read it: an objective is defined here once.
OBJECTIVE_RANKS_BY = {"min_time": "time", "budget": "time", "min_cost": "cost", "deadline": "cost", "knee": "knee"}
OBJECTIVE_LIMITS = {"deadline": "deadline_h", "budget": "budget_usd"}  # the spec field each constraint is in


def _order(time_s: np.ndarray, cost_usd: np.ndarray, ranks_by: str) -> np.ndarray:
    """Candidate indices, best first, by "time" (then cost) or "cost" (then time)."""
    return np.lexsort((cost_usd, time_s)) if ranks_by == "time" else np.lexsort((time_s, cost_usd))


def _best(time_s: np.ndarray, cost_usd: np.ndarray, ranks_by: str, allowed: np.ndarray | None = None) -> int:
    order = _order(time_s, cost_usd, ranks_by)
    return int(order[0] if allowed is None else order[allowed[order]][0])


def ranking(candidates: dict[str, np.ndarray], objective: str, front: np.ndarray, chosen_global_batch: float) -> np.ndarray:
    """Every candidate from best to worst for the objective (the runner-ups): by OBJECTIVE_RANKS_BY; for
    the knee, the front's points nearest the chosen batch (in log2) first."""
    time_s, cost = candidates["total_time_s"], candidates["cost_usd"]
    ranks_by = OBJECTIVE_RANKS_BY[objective]
    if ranks_by != "knee":
        return _order(time_s, cost, ranks_by)
    distance = np.abs(np.log2(candidates["global_batch"]) - np.log2(chosen_global_batch))
    return np.lexsort((time_s, distance, ~front))


def choose(
    candidates: dict[str, np.ndarray], objective: str, deadline_h: float | None = None, budget_usd: float | None = None
) -> Choice:
    """The chosen candidate for an objective.

    knee: always a point of the (time, cost) Pareto front: Kneedle over the front's points ordered
    by global batch (see `tula_service.plan.knee`), and at the knee batch the fastest front point.
    deadline: the cheapest candidate finishing within the deadline; budget: the fastest within the
    budget. An impossible constraint is an answer, not an error: the closest candidate (the fastest,
    or the cheapest) is returned with met=False and a message saying by how much it misses.
    """
    time_s, cost = candidates["total_time_s"], candidates["cost_usd"]
    front = pareto_mask(time_s, cost)
    ranks_by = OBJECTIVE_RANKS_BY[objective]
    if objective == "deadline":
        return _within(time_s / 3600.0, deadline_h, "deadline", time_s, cost, front)
    if objective == "budget":
        return _within(cost, budget_usd, "budget", time_s, cost, front)
    if ranks_by != "knee":
        return Choice(_best(time_s, cost, ranks_by), front)
    knee = find_knee(candidates["global_batch"][front], time_s[front])
    at_knee = np.flatnonzero(front & (candidates["global_batch"] == knee.global_batch))
    return Choice(int(at_knee[np.argmin(time_s[at_knee])]), front, knee)


def _within(value: np.ndarray, limit: float, kind: str, time_s, cost, front) -> Choice:
    allowed = value <= limit
    unit = "h" if kind == "deadline" else "USD"
    ranks_by = OBJECTIVE_RANKS_BY[kind]
    if allowed.any():
        index = _best(time_s, cost, ranks_by, allowed)
        message = f"meets the {kind} of {limit:g} {unit} ({value[index]:.3g} {unit})"
        return Choice(index, front, constraint={"kind": kind, "limit": limit, "met": True, "message": message})
    index = _best(time_s, cost, "time" if ranks_by == "cost" else "cost")  # the closest to the limit
    closest = "fastest" if kind == "deadline" else "cheapest"
    verb = "finishes within" if kind == "deadline" else "costs at most"
    message = f"no configuration {verb} {limit:g} {unit}; the {closest} needs {value[index]:.3g} {unit}"
    return Choice(index, front, constraint={"kind": kind, "limit": limit, "met": False, "message": message})
