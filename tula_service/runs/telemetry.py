"""The contracts of a run: what starts one (RunRequest), what a training loop reports (TelemetryRecord,
TelemetryBatch), and the bounds that keep a run's storage finite.

A telemetry record describes one optimizer step (or the last step of a window the trainer averaged): its
step number is its identity, so a record sent twice (a client that re-sends after a timeout) is stored once,
and records are kept in step order whatever order they arrive in. Fields a record leaves out (placement,
per-device batch, accumulation) are the run's current configuration. The gradient statistics are the
two-batch estimates of the reference-run record format (tula_service.spec.job_spec.GradientStatsRecord):
`trace_sigma` is tr(Sigma) per sample, so that B_simple = trace_sigma / grad_sqr.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from tula_service.spec.job_spec import BatchSize, Count, GradientStatistic, MeasuredNumber, PositiveInt
from tula_service.spec.spec_limits import MAX_GPUS_PER_NODE, MAX_NODES

MAX_RECORDS_PER_BATCH = 1_000  # records in one POST /v1/runs/{id}/telemetry
MAX_RECORDS_PER_RUN = 200_000  # a run's stored records; past it telemetry is refused (409), the advice stays
MAX_ACCUMULATION = 4_096
MAX_STEP_S = 86_400.0
DEFAULT_HYSTERESIS = 0.05
DEFAULT_MIN_STEPS_BETWEEN_CHANGES = 100


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunRequest(_Strict):
    """POST /v1/runs: a run of a done job, following its recommendation."""

    job_id: str = Field(min_length=1, max_length=64)
    hysteresis: float = Field(
        DEFAULT_HYSTERESIS, ge=0, le=1,
        description="change the configuration only when the move saves at least this share of the run's predicted time to the "
        "target (the gain over the rest of the run times the share of the run left)",
    )  # fmt: skip
    min_steps_between_changes: int = Field(
        DEFAULT_MIN_STEPS_BETWEEN_CHANGES, ge=0, le=10**9, description="optimizer steps after a change before the next one"
    )


class TelemetryRecord(_Strict):
    """One optimizer step of a run (module docstring)."""

    step: Count = Field(ge=0, le=10**12, description="optimizer steps done when this was taken: the record's identity")
    samples: Count | None = Field(None, ge=0, description="training samples seen (all devices)")
    statistics_samples: Count | None = Field(
        None, ge=0, description="where the window's gradient statistics were taken (samples seen; GradientStatsRecord)"
    )
    wall_time_s: MeasuredNumber | None = Field(None, ge=0, allow_inf_nan=False, description="seconds since the run started")
    step_time_s: MeasuredNumber | None = Field(None, gt=0, le=MAX_STEP_S, allow_inf_nan=False, description="seconds of this optimizer step")
    device_batch: BatchSize | None = Field(None, description="samples per device per micro-step")
    accumulation: PositiveInt | None = Field(None, le=MAX_ACCUMULATION, description="micro-steps per optimizer step")
    placement: list[Annotated[int, Field(ge=1, le=MAX_GPUS_PER_NODE)]] | None = Field(
        None, min_length=1, max_length=MAX_NODES, description="GPUs used on each node"
    )
    loss: MeasuredNumber | None = Field(None, allow_inf_nan=False, description="training loss")
    metric: MeasuredNumber | None = Field(None, allow_inf_nan=False, description="the run's evaluation metric")
    lr: MeasuredNumber | None = Field(None, gt=0, allow_inf_nan=False)
    grad_sqr: GradientStatistic | None = Field(None, allow_inf_nan=False, description="|G|^2 (two-batch estimate)")
    trace_sigma: GradientStatistic | None = Field(None, allow_inf_nan=False, description="tr(Sigma) per sample (two-batch estimate)")
    precond_grad_sqr: GradientStatistic | None = Field(None, allow_inf_nan=False, description="adaptive optimizers (Adam, AdamW, RMSprop, NAdam, RAdam, Adamax): |P G|^2")
    precond_trace_sigma: GradientStatistic | None = Field(None, allow_inf_nan=False, description="adaptive optimizers: tr(P Sigma P) per sample")
    variability: MeasuredNumber | None = Field(None, ge=0, allow_inf_nan=False, description="| |g_t| - |g_t-1| | / |g_t-1| (AGS)")
    stability_headroom: MeasuredNumber | None = Field(
        None, gt=0, allow_inf_nan=False, description="(2 + 2 beta) / (eta lambda_max) measured in this window (TulaRun.measure_stability)"
    )
    stability_lr: MeasuredNumber | None = Field(None, gt=0, allow_inf_nan=False, description="the LR eta that stability_headroom was measured at")


class TelemetryBatch(_Strict):
    """POST /v1/runs/{id}/telemetry."""

    records: list[TelemetryRecord] = Field(min_length=1, max_length=MAX_RECORDS_PER_BATCH)
