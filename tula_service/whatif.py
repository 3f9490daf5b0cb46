"""What-if: re-plan a job's stored measurements for another cluster, pricing or objective.

A pure function of (stored spec, stored measurements, overrides): no profiling, and with no
overrides it reproduces the stored recommendation exactly.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tula_service.recommend import plan
from tula_service.spec import JobSpec


class WhatIf(BaseModel):
    """Fields of the spec a what-if may change; cluster and pricing are merged into the stored ones."""

    model_config = ConfigDict(extra="forbid")

    cluster: dict[str, Any] | None = Field(None, description="e.g. {'nodes': 4} or {'device_memory_gib': 40}")
    pricing: dict[str, Any] | None = Field(None, description="e.g. {'kind': 'node_hour', 'price': 20}")
    objective: str | None = None
    deadline_h: float | None = None
    budget_usd: float | None = None


def merged_spec(stored_spec: dict[str, Any], what_if: WhatIf) -> JobSpec:
    """The stored spec with the what-if applied, validated like a new submission."""
    spec = copy.deepcopy(stored_spec)
    for section in ("cluster", "pricing"):
        overrides = getattr(what_if, section)
        if overrides:
            spec[section] = {**spec[section], **overrides}
    for key in ("objective", "deadline_h", "budget_usd"):
        value = getattr(what_if, key)
        if value is not None:
            spec[key] = value
    return JobSpec.model_validate(spec)


def replan(stored_spec: dict[str, Any], measurements: list[dict[str, Any]], what_if: WhatIf, failed_points=None) -> dict[str, Any]:
    return plan(merged_spec(stored_spec, what_if), measurements, failed_points)
