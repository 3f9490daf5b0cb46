"""What-if: re-plan a job's stored measurements for another cluster, GPU type, pricing, objective or reference run.

A pure function of (stored spec, stored measurements, overrides): no profiling, and with no
overrides it reproduces the stored recommendation exactly.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, create_model, field_validator
from pydantic.fields import FieldInfo

from tula_service.catalogs import CATALOG_SOURCE, load_gpus, load_interconnects
from tula_service.fit.links import stale_link_fields
from tula_service.plan.recommend import plan
from tula_service.spec.job_spec import ClusterSpec, JobSpec, PricingSpec, TrainingSpec, _Strict, in_catalog

# What a GPU type decides about a cluster's memory: a what-if that switches GPU type drops these from the
# stored spec (unless it gives them itself) so that the new GPU's catalog values take their place; its
# link fields are tula_service.fit.links's (stale_link_fields).
GPU_MEMORY_FIELDS = ("device_memory_gib", "device_memory_source")
# The spec fields a what-if may give; the `*_source` fields are the server's and are re-derived.
CLUSTER_OVERRIDES = ("nodes", "gpus_per_node", "gpu_type", "device_memory_gib", "interconnect_gbps",
                     "intra_node_link", "inter_node_link")  # fmt: skip
PRICING_OVERRIDES = ("kind", "price", "fixed_overhead_usd")
TRAINING_OVERRIDES = tuple(TrainingSpec.model_fields)
TOP_LEVEL_OVERRIDES = ("objective", "deadline_h", "budget_usd")


def _catalog_names(names: list[str]) -> WithJsonSchema:
    return WithJsonSchema({"type": "string", "enum": sorted(names)})


CATALOG_NAME_SCHEMAS = {
    "gpu_type": _catalog_names(list(load_gpus())),
    "intra_node_link": _catalog_names(list(load_interconnects())),
    "inter_node_link": _catalog_names(list(load_interconnects())),
}


def _drop_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


def _override(spec_field: FieldInfo, name: str) -> tuple[Any, FieldInfo]:
    """A spec field as a what-if field: the same type and constraints, and absent unless given. A field
    the spec lets be null may be given as null; the others may not, and their schema shows no default."""
    annotation = spec_field.annotation
    if name in CATALOG_NAME_SCHEMAS:  # `str | None` in the spec; the catalog's names in the schema
        annotation = Annotated[str, CATALOG_NAME_SCHEMAS[name]] | None
    if spec_field.metadata:
        annotation = Annotated[(annotation, *spec_field.metadata)]
    nullable = type(None) in getattr(spec_field.annotation, "__args__", ())
    return annotation, Field(None, description=spec_field.description,
                             json_schema_extra=None if nullable else _drop_default)


def _overrides_model(name: str, spec_model: type[BaseModel], fields: tuple[str, ...], doc: str,
                     **validators: Any) -> type[BaseModel]:
    """A model of these `fields` of `spec_model`, each as `_override` makes it; any other key is refused,
    and a boolean is no number (the spec models' base, spec._Strict)."""
    return create_model(
        name, __base__=_Strict, __doc__=doc, __validators__=validators,
        **{field: _override(spec_model.model_fields[field], field) for field in fields},
    )  # fmt: skip


def _known(kind: str, catalog: Callable[[], dict[str, Any]]) -> Callable[[str | None], str | None]:
    """The spec's check of a catalog name (its message names the known ones and the nearest)."""

    def check(value: str | None) -> str | None:
        return None if value is None else in_catalog(kind, value, catalog())

    return check


ClusterOverrides = _overrides_model(
    "ClusterOverrides", ClusterSpec, CLUSTER_OVERRIDES, "Cluster fields of the stored spec to replace.",
    known_gpu=field_validator("gpu_type")(_known("GPU type", load_gpus)),
    known_link=field_validator("intra_node_link", "inter_node_link")(_known("interconnect", load_interconnects)),
)
PricingOverrides = _overrides_model("PricingOverrides", PricingSpec, PRICING_OVERRIDES, "Pricing fields to replace.")
TrainingOverrides = _overrides_model(
    "TrainingOverrides", TrainingSpec, TRAINING_OVERRIDES, "Reference-run fields to replace (another run, another LR ceiling)."
)
_TopLevelOverrides = _overrides_model("_TopLevelOverrides", JobSpec, TOP_LEVEL_OVERRIDES, "Objective, deadline, budget.")


class WhatIf(_TopLevelOverrides):
    """Fields of the spec a what-if may change; cluster, pricing and training are merged into the stored ones.

    Each field has the type and limits of the spec's own, so a what-if that breaks them is a 422; a
    field left out keeps its stored value, and one given (null too, where the spec allows null) is applied.
    Rules between fields (objective 'deadline' needs deadline_h, max_lr needs reference_lr, a price per
    node-hour needs a price) are checked on the stored spec with the what-if applied, as a submission is.

    Switching `cluster.gpu_type` replaces the device: its memory and intra-node link become the new
    GPU's catalog values (unless the what-if gives device_memory_gib / intra_node_link itself), and a
    price that was taken from the catalog becomes the new GPU's; a price given in the spec is kept.
    Compute speed is NOT rescaled: the iteration times are those measured on the profiled device, so a
    what-if on another GPU type answers "this speed with that memory, link and price", not "that GPU".
    """

    model_config = ConfigDict(extra="forbid")

    cluster: ClusterOverrides | None = Field(
        None, description="e.g. {'nodes': 4}, {'device_memory_gib': 40} or {'gpu_type': 'a100_40gb_sxm'}"
    )
    pricing: PricingOverrides | None = Field(None, description="e.g. {'kind': 'node_hour', 'price': 20}")
    training: TrainingOverrides | None = Field(
        None, description="e.g. {'reference_epochs': 12} or {'reference_lr': 0.1, 'max_lr': 0.4}: another reference run or LR ceiling"
    )

    def given(self) -> dict[str, Any]:
        """The fields given, as JSON: what the what-if changes."""
        return self.model_dump(mode="json", exclude_unset=True)


def _without(section: dict[str, Any], keys: set[str]) -> dict[str, Any]:
    return {key: value for key, value in section.items() if key not in keys}


def _merged_cluster(stored: dict[str, Any], overrides: dict[str, Any], gpu_changed: bool) -> dict[str, Any]:
    """Stored cluster + overrides, minus the stored values the overrides make stale: the device's
    memory when the GPU type changes, the memory's source when a memory is given, and the link fields
    tula_service.fit.links.stale_link_fields names."""
    stale = stale_link_fields(stored, overrides, gpu_changed)
    if gpu_changed:
        stale.update(GPU_MEMORY_FIELDS)
    if "device_memory_gib" in overrides:  # a memory the what-if gives is the spec's, not the catalog's
        stale.add("device_memory_source")
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
    """The stored spec with the what-if applied, validated like a new submission but for the allowlist and
    data-root decisions of the stored spec's submission, which hold (JobSpec.stored)."""
    spec, given = copy.deepcopy(stored_spec), what_if.given()
    cluster_overrides, pricing_overrides = given.pop("cluster", None) or {}, given.pop("pricing", None) or {}
    gpu_changed = "gpu_type" in cluster_overrides and cluster_overrides["gpu_type"] != spec["cluster"].get("gpu_type")
    spec["cluster"] = _merged_cluster(spec["cluster"], cluster_overrides, gpu_changed)
    spec["pricing"] = _merged_pricing(spec["pricing"], pricing_overrides, gpu_changed)
    spec["training"] = {**spec["training"], **(given.pop("training", None) or {})}
    return JobSpec.stored({**spec, **given})


def replan(stored_spec: dict[str, Any], measurements: list[dict[str, Any]], what_if: WhatIf, failed_points=None) -> dict[str, Any]:
    return plan(merged_spec(stored_spec, what_if), measurements, failed_points)
