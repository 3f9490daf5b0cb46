"""What-if: re-plan a job's stored measurements for another cluster, GPU type, pricing, objective or reference run.

A pure function of (stored spec, stored measurements, overrides): no profiling, and with no
overrides it reproduces the stored recommendation exactly.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tula_service.catalogs import CATALOG_SOURCE
from tula_service.recommend import plan
from tula_service.spec import JobSpec

# What a GPU type decides about a cluster: a what-if that switches GPU type drops these from the stored
# spec (unless it gives them itself) so that the new GPU's catalog values take their place.
GPU_CLUSTER_FIELDS = ("device_memory_gib", "device_memory_source", "intra_node_link", "intra_node_link_source")


class WhatIf(BaseModel):
    """Fields of the spec a what-if may change; cluster and pricing are merged into the stored ones.

    Switching `cluster.gpu_type` replaces the device: its memory and intra-node link become the new
    GPU's catalog values (unless the what-if gives device_memory_gib / intra_node_link itself), and a
    price that was taken from the catalog becomes the new GPU's; a price given in the spec is kept.
    Compute speed is NOT rescaled: the iteration times are those measured on the profiled device, so a
    what-if on another GPU type answers "this speed with that memory, link and price", not "that GPU".
    """

    model_config = ConfigDict(extra="forbid")

    cluster: dict[str, Any] | None = Field(
        None, description="e.g. {'nodes': 4}, {'device_memory_gib': 40} or {'gpu_type': 'a100_40gb_sxm'}"
    )
    pricing: dict[str, Any] | None = Field(None, description="e.g. {'kind': 'node_hour', 'price': 20}")
    training: dict[str, Any] | None = Field(
        None, description="e.g. {'reference_epochs': 12} or {'reference_lr': 0.1, 'max_lr': 0.4}: another reference run or LR ceiling"
    )
    objective: str | None = None
    deadline_h: float | None = None
    budget_usd: float | None = None


def _without(section: dict[str, Any], keys: set[str]) -> dict[str, Any]:
    return {key: value for key, value in section.items() if key not in keys}


def _merged_cluster(stored: dict[str, Any], overrides: dict[str, Any], gpu_changed: bool) -> dict[str, Any]:
    """Stored cluster + overrides, minus the stored values the overrides make stale: the device's
    memory and link when the GPU type changes, a catalog-assumed link when a link is given, and the
    source of any value the overrides give."""
    stale: set[str] = set(GPU_CLUSTER_FIELDS) if gpu_changed else set()
    link_given = overrides.keys() & {"intra_node_link", "interconnect_gbps"}
    if link_given and stored.get("intra_node_link_source") == CATALOG_SOURCE:
        stale.update(("intra_node_link", "intra_node_link_source"))
    stale.update(f"{key}_source" for key in ("device_memory_gib", "intra_node_link") if key in overrides)
    return {**_without(stored, stale), **overrides}


def _merged_pricing(stored: dict[str, Any], overrides: dict[str, Any], gpu_changed: bool) -> dict[str, Any]:
    """Stored pricing + overrides; a catalog-assumed price is dropped (to be re-derived, or asked for)
    when the GPU type or the pricing kind changes, and a given price is the spec's."""
    stale: set[str] = set()
    kind_changed = "kind" in overrides and overrides["kind"] != stored.get("kind")
    if stored.get("price_source") == CATALOG_SOURCE and (gpu_changed or kind_changed):
        stale.update(("price", "price_source"))
    if "price" in overrides:
        stale.add("price_source")
    return {**_without(stored, stale), **overrides}


def merged_spec(stored_spec: dict[str, Any], what_if: WhatIf) -> JobSpec:
    """The stored spec with the what-if applied, validated like a new submission."""
    spec = copy.deepcopy(stored_spec)
    cluster_overrides, pricing_overrides = what_if.cluster or {}, what_if.pricing or {}
    gpu_changed = "gpu_type" in cluster_overrides and cluster_overrides["gpu_type"] != spec["cluster"].get("gpu_type")
    spec["cluster"] = _merged_cluster(spec["cluster"], cluster_overrides, gpu_changed)
    spec["pricing"] = _merged_pricing(spec["pricing"], pricing_overrides, gpu_changed)
    spec["training"] = {**spec["training"], **(what_if.training or {})}
    for key in ("objective", "deadline_h", "budget_usd"):
        value = getattr(what_if, key)
        if value is not None:
            spec[key] = value
    return JobSpec.model_validate(spec)


def replan(stored_spec: dict[str, Any], measurements: list[dict[str, Any]], what_if: WhatIf, failed_points=None) -> dict[str, Any]:
    return plan(merged_spec(stored_spec, what_if), measurements, failed_points)
