"""The typed contract of what a profiling worker returns (torch-free): one Measurement per point.

The profiler (profiler/measure.py, profiler/comm.py, profiler/pilot.py) writes these records as JSON; the
store keeps them as it got them; the service parses them here (`parse_measurement`) and reads attributes.
Each model names the fields the service reads and their types; every other field a record carries
(phase timings, per-iteration series, budgets, host details) is kept as it came (`extra="allow"`) and
shown to users as measured, so the profiler can add detail without a change here.

- ComputeMeasurement (kind "compute", also a "retime" point's record): one batch size timed, sized and
  its gradient statistics taken (`status` "ok"), out of memory ("oom", the memory limit as data), or
  "failed" with the point's own error (a model that does not build).
- CommMeasurement (kind "comm"): all-reduce times per world size and message size.
- PilotMeasurement (kind "pilot"): training at the reference batch, with gradient-statistics records
  along the way (the contract of `training.reference_run.gradient_stats`, GradientStatsRecord).
- StepMeasurement (kind "step"): one training step measured on a placement of GPUs over nodes, with the
  per-GPU batch, the step's seconds and the all-reduce's (from a user's trainer, a trace or a CSV).

SourcedValue is how the recommendation says where a number came from: measured, fitted (with its
error), predicted (from fitted models, with their error), assumed, or given in the spec.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from tula_service.spec.job_spec import GradientStatsRecord
from tula_service.spec.spec_limits import MAX_BATCH, MAX_GPUS_PER_NODE, MAX_NODES

Source = Literal["measured", "fitted", "predicted", "assumed", "spec", "catalog-assumed"]


class _Record(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class IterTime(_Record):
    """Seconds per training iteration over the timed iterations (profiler.timing.summarize)."""

    median_s: float = Field(gt=0)
    p10_s: float | None = None
    p90_s: float | None = None
    cv: float | None = Field(None, ge=0, description="std / mean of the timed iterations")
    robust_cv: float | None = Field(None, ge=0, description="1.4826 MAD / median: the spread a few outliers do not move")
    median_rel_se: float | None = Field(None, ge=0, description="the median's relative standard error")
    count: int | None = Field(None, ge=1, description="timed iterations")

    @property
    def spread(self) -> float | None:
        """How widely the iterations scatter around the median the models fit: the robust CV, or the
        CV for a record from before the profiler wrote one."""
        return self.robust_cv if self.robust_cv is not None else self.cv


class MemoryRecord(_Record):
    """Bytes of one device: the peak (CUDA allocator, or static + saved activations on a CPU). A count
    the profiler wrote as an integer stays one, so the recommendation shows it as measured."""

    peak_bytes: int | float = Field(ge=0)
    static_bytes: int | float | None = Field(None, ge=0, description="parameters, gradients and optimizer state")
    activation_bytes: int | float | None = Field(None, ge=0, description="saved for backward at this batch")
    nvml: dict[str, Any] | None = Field(None, description="the device as NVML reports it (CUDA only)")

    @property
    def device_total_bytes(self) -> float | None:
        """The device's memory as NVML reports it, when it did."""
        total = (self.nvml or {}).get("total_bytes")
        return float(total) if total else None


class GradientRecord(_Record):
    """The two-batch estimates at this point (McCandlish et al. 2018, App. A.1): |G|^2 and tr(Sigma) per
    sample; B_simple = trace_sigma / true_grad_sq_norm. None where the batch was too small to split."""

    true_grad_sq_norm: float | None = None
    trace_sigma: float | None = None
    batch: int = Field(ge=1, description="samples whose mean gradient the estimate is of")
    iterations: int = Field(ge=0)
    nonfinite_iterations: int = Field(0, ge=0, description="iterations left out: a norm was not finite (profiler.gradstats)")
    variability_series: list[float] = Field(default_factory=list, description="| |g_t| - |g_t-1| | / |g_t-1| per step (AGS)")
    precond_true_grad_sq_norm: float | None = None
    precond_trace_sigma: float | None = None
    noise_scale: float | None = Field(
        None, description="B_simple at this point: EMA tr(Sigma) / EMA |G|^2; None when |G|^2 is not resolved"
    )
    variability_median: float | None = Field(None, description="median of variability_series (AGS)")

    @field_validator("variability_series", mode="before")
    @classmethod
    def _finite_steps(cls, series: Any) -> Any:
        """A step whose change was not finite (None after `without_nonfinite`) carries no variability."""
        return [value for value in series if value is not None] if isinstance(series, list) else series


class ModelSize(_Record):
    parameter_count: int = Field(ge=0)
    gradient_bytes: int = Field(ge=0, description="bytes one all-reduce moves per step")
    input_kind: str | None = None
    tokens_per_sample: int | None = None


class HostLoad(_Record):
    contended: bool = Field(description="the 1-minute load was above the cores around the point")


class ComputeMeasurement(_Record):
    schema_version: int = 2
    kind: Literal["compute", "retime"] = "compute"
    status: Literal["ok", "oom", "failed"]
    batch_size: int = Field(ge=1, le=MAX_BATCH)
    device: str | None = None
    iter_time: IterTime | None = None
    memory: MemoryRecord | None = None
    gradient: GradientRecord | None = None
    model: ModelSize | None = None
    options: dict[str, Any] | None = None
    host_load: HostLoad | None = None
    error: str | None = None

    @model_validator(mode="after")
    def _ok_is_measured(self) -> ComputeMeasurement:
        if self.status == "ok" and (self.iter_time is None or self.memory is None or self.model is None):
            raise ValueError("an 'ok' compute measurement needs iter_time, memory and model")
        return self

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def host_contended(self) -> bool | None:
        """Whether the host was busy around the point (HostLoad); None for a record that does not say."""
        return self.host_load.contended if self.host_load is not None else None


class CommPoint(_Record):
    world_size: int = Field(ge=2)
    message_bytes: int = Field(ge=1)
    median_s: float = Field(gt=0)
    count: int | None = Field(None, ge=1)


class CommMeasurement(_Record):
    schema_version: int = 1
    kind: Literal["comm"]
    status: Literal["ok", "failed", "skipped"]
    backend: str | None = Field(None, description="nccl (informs the network model) or gloo (does not)")
    device: str | None = None
    points: list[CommPoint] = Field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class PilotMeasurement(_Record):
    schema_version: int = 2
    kind: Literal["pilot"]
    status: Literal["ok", "oom", "failed"]
    batch_size: int = Field(ge=1, le=MAX_BATCH)
    optimizer: str | None = None
    trajectory: list[GradientStatsRecord] = Field(default_factory=list)
    samples: int | None = Field(None, ge=0, description="training samples the pilot saw")
    stopped_by: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


MAX_STEP_S = 86_400.0  # a step of more than a day is no measurement of a training step


class StepMeasurement(_Record):
    """One training step measured on a placement: the GPUs used on each node (Pollux's "22" is [2, 2]), the
    per-GPU batch, the step's seconds and, where the trainer timed it, the all-reduce's (the part of the
    step spent synchronizing gradients). From the profiler's multi-device step, a user's trainer or a trace
    (CSV: tula_service.measurement_csv). A step at placement [1] is a single-device compute step."""

    schema_version: int = 1
    kind: Literal["step"]
    status: Literal["ok", "oom", "failed"] = Field("ok", description="a step that ran out of memory or failed has no times")
    placement: list[Annotated[int, Field(ge=1, le=MAX_GPUS_PER_NODE)]] = Field(
        min_length=1, max_length=MAX_NODES, description="GPUs used on each node, e.g. [2, 2]"
    )
    device_batch: int = Field(ge=1, le=MAX_BATCH, description="samples per GPU per step (local_bsz)")
    step_time_s: float | None = Field(None, gt=0, le=MAX_STEP_S, description="required when status is ok")
    sync_time_s: float | None = Field(None, ge=0, le=MAX_STEP_S, description="seconds of the step spent in the gradient all-reduce")
    origin: str | None = Field(None, description="where the row comes from: profiler, trainer, csv, trace")
    error: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> StepMeasurement:
        if min(self.placement) < 1:
            raise ValueError(f"placement lists the GPUs used on each node, each >= 1, got {self.placement}")
        if self.status == "ok" and self.step_time_s is None:
            raise ValueError("a step with status ok needs step_time_s")
        if self.sync_time_s is not None and self.step_time_s is not None and self.sync_time_s >= self.step_time_s:
            raise ValueError(f"sync_time_s ({self.sync_time_s}) must be below step_time_s ({self.step_time_s})")
        return self

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def devices(self) -> int:
        return sum(self.placement)


def _kind(record: Any) -> str:
    """A record without a kind is a compute point (schema version 1 records had none)."""
    if isinstance(record, dict):
        return record.get("kind") or "compute"
    return getattr(record, "kind", "compute")


Measurement = ComputeMeasurement | CommMeasurement | PilotMeasurement | StepMeasurement
_ADAPTERS = {"compute": TypeAdapter(ComputeMeasurement), "retime": TypeAdapter(ComputeMeasurement),
             "comm": TypeAdapter(CommMeasurement), "pilot": TypeAdapter(PilotMeasurement),
             "step": TypeAdapter(StepMeasurement)}  # fmt: skip


NONFINITE_FIELDS = "nonfinite_fields"


def without_nonfinite(record: Any) -> Any:
    """The record with every number that is not finite (NaN, +-inf: Python's json writes and reads them) as
    None, and the paths of those numbers listed under NONFINITE_FIELDS (e.g. "gradient.trace_sigma").

    A worker's record comes back as Python's json wrote it: an fp16 overflow or a diverging model can put
    NaN or inf in it. The store keeps JSON (PostgreSQL's json type refuses NaN), the contract reads None as
    not measured, and the recommendation is JSON too, so the numbers go no further than here."""
    paths: list[str] = []

    def clean(value: Any, path: str) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            paths.append(path)
            return None
        if isinstance(value, dict):
            return {key: clean(item, f"{path}.{key}" if path else str(key)) for key, item in value.items()}
        if isinstance(value, list):
            return [clean(item, f"{path}[{index}]") for index, item in enumerate(value)]
        return value

    cleaned = clean(record, "")
    if paths and isinstance(cleaned, dict):
        cleaned[NONFINITE_FIELDS] = paths[:100]
    return cleaned


def parse_measurement(record: Any) -> Measurement:
    """The typed measurement of one stored record (a parsed one is returned as it is). Raises
    pydantic's ValidationError for a record that breaks the contract, ValueError for an unknown kind."""
    if isinstance(record, ComputeMeasurement | CommMeasurement | PilotMeasurement | StepMeasurement):
        return record
    kind = _kind(record)
    if kind not in _ADAPTERS:
        raise ValueError(f"unknown measurement kind '{kind}'; known: {', '.join(_ADAPTERS)}")
    return _ADAPTERS[kind].validate_python(record)


class SourcedValue(BaseModel):
    """A number of the recommendation and where it came from; rel_err is the model's measured relative
    error (leave-one-out) for fitted and predicted values, None for measured, assumed or given ones."""

    model_config = ConfigDict(extra="allow")

    value: float | int | None
    source: Source
    rel_err: float | None = None
