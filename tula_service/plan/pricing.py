"""What a plan costs: one PricingRule per pricing kind (the spec's `pricing.kind`), all in PRICING_RULES.

Per candidate of the planner's sweep (n devices on m nodes at per-device batch b, M(b) the predicted memory
per device, time_h its predicted hours to train):

    cost = fixed_overhead_usd + time_h * billed_units * price

    billed_units = n                        gpu_hour:        per GPU-hour
                 = m                        node_hour:       per node-hour (whole nodes are rented: the
                                                             nodes the placement uses, ceil(n / gpus_per_node)
                                                             when packed)
                 = n * M(b) / GiB           memory_gb_hour:  per GiB-hour of device memory actually used
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from tula_service.units import GIB


class PricingRule(Protocol):
    """How one pricing kind bills a candidate: `price` is USD per `unit`, and a run of time_h hours
    bills time_h * billed_units(...) of them."""

    kind: str  # the spec's pricing.kind
    unit: str  # what one price is for, e.g. "GPU-hour"
    formula: str  # billed_units as the module docstring writes it

    def billed_units(self, devices: np.ndarray, nodes: np.ndarray, memory_bytes: np.ndarray) -> np.ndarray:
        """Units billed per hour for n = `devices` on `nodes` nodes each using `memory_bytes`, vectorized over
        candidates."""
        ...


class GpuHour:
    kind = "gpu_hour"
    unit = "GPU-hour"
    formula = "n"

    def billed_units(self, devices: np.ndarray, nodes: np.ndarray, memory_bytes: np.ndarray) -> np.ndarray:
        return np.asarray(devices)


class NodeHour:
    kind = "node_hour"
    unit = "node-hour"
    formula = "m"

    def billed_units(self, devices: np.ndarray, nodes: np.ndarray, memory_bytes: np.ndarray) -> np.ndarray:
        return np.asarray(nodes)


class MemoryGbHour:
    kind = "memory_gb_hour"
    unit = "GiB-hour of device memory used"
    formula = "n * M(b) / GiB"

    def billed_units(self, devices: np.ndarray, nodes: np.ndarray, memory_bytes: np.ndarray) -> np.ndarray:
        return devices * memory_bytes / GIB


PRICING_RULES: Mapping[str, PricingRule] = {rule.kind: rule for rule in (GpuHour(), NodeHour(), MemoryGbHour())}


def pricing_rule(kind: str) -> PricingRule:
    """The rule of a pricing kind; ValueError naming the known kinds when `kind` is not one."""
    if kind not in PRICING_RULES:
        raise ValueError(f"pricing kind '{kind}' is unknown; known: {', '.join(sorted(PRICING_RULES))}")
    return PRICING_RULES[kind]
