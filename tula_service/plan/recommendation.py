"""The typed contract of a recommendation (torch-free): what `tula_service.plan.recommend.plan` returns, what
GET /v1/jobs/{job_id}/recommendation (JobRecommendation) and POST /v1/jobs/{job_id}/plan (WhatIfPlan)
serve and document in OpenAPI, and what the client checks an answer against.

- The configuration parts (the chosen candidate and every candidate, runner-ups, training advice, the
  knee, pricing, device, curves, reliability, search space, what was profiled) are typed field by field:
  a key plan() adds to one needs its field here, or the answer drops it (tests/test_recommendation_contract.py
  round-trips plan()'s answers to catch that).
- The fit report (`models`) is detail: each term's named fields are typed, and anything more the fitting
  reports is kept as it came (`extra="allow"`), so a fit can add detail without a change here.
- Every number says where it came from: a SourcedValue's `source` (measured, fitted, predicted, assumed,
  spec, catalog-assumed) is required wherever plan() gives one, with `rel_err` for predicted values.

Fields are declared in plan()'s key order and optional fields are the ones plan() leaves out in some
cases, so `model_validate(out).model_dump(mode="json", exclude_unset=True)` is `out` key for key: the
routes serve the recommendation through these models without changing its JSON.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from tula_service.measurement import Source, SourcedValue
from tula_service.spec.job_spec import Objective, OptimizerName, PricingKind

# A number kept as it was written: the profiler writes byte counts as integers and times as floats, and
# the recommendation passes them on unchanged (a `float` field would turn 1000 into 1000.0).
Number = Annotated[int | float, WithJsonSchema({"type": "number"})]


class _Detail(BaseModel):
    """A part of the fit report: its named fields typed, any other field it carries kept."""

    model_config = ConfigDict(extra="allow")


# --- the configurations ----------------------------------------------------------------------------


class Candidate(BaseModel):
    """One configuration of the sweep: per-device batch b, devices n, accumulation steps a (B = b n a)."""

    device_batch: int = Field(description="samples per device per micro-step")
    devices: int
    placement: list[int] = Field(description="the GPUs used on each node, e.g. [4, 4]")
    placement_kind: Literal["packed", "even", "spread"] = Field(
        description="packed: the fewest nodes, filled in turn; spread: one GPU per node where the nodes allow; "
        "even: the GPUs dealt out evenly over a power-of-two number of nodes between the two"
    )
    accumulation: int = Field(description="micro-steps per optimizer step")
    global_batch: int = Field(description="device_batch * devices * accumulation, in batch_unit.unit")
    memory_bytes: SourcedValue = Field(description="per device: measured at a profiled batch, else predicted")
    iter_time_s: SourcedValue = Field(description="one micro-step: measured for a profiled batch on one device, else predicted")
    step_time_s: SourcedValue = Field(description="one optimizer step, (a - 1) T_micro + T_iter: measured where a step was measured on this placement and batch")
    epochs: SourcedValue = Field(description="epochs to the reference run's target at this global batch, E(B); interval and why where the LR is "
                                 "capped, calibrated_interval (80%, from the model's error measured across tasks) where the noise scale has one")
    epoch_time_s: SourcedValue
    total_time_s: SourcedValue = Field(description="epochs * epoch_time_s; rel_err is the step time's, calibrated_interval the epochs'")
    cost_usd: SourcedValue
    pareto: bool = Field(description="on the (time, cost) Pareto front")
    extrapolated: list[Literal["devices", "nodes", "gpus_per_node"]] = Field(
        description="what of the placement lies beyond every multi-device measurement (more devices than any measured step "
        "or all-reduce world size, more nodes, more GPUs on a node than a measured step): its step time is extrapolated"
    )
    global_batch_tokens: int | None = Field(None, description="language models only: global_batch * tokens_per_sample")


class RunnerUp(BaseModel):
    """A next-best candidate for the objective, with its time and cost relative to the chosen one."""

    device_batch: int
    devices: int
    placement: list[int] = Field(description="the GPUs used on each node")
    accumulation: int
    global_batch: int
    total_time_s: float
    cost_usd: float
    time_delta_pct: float | None = Field(description="100 (total_time_s / chosen's - 1)")
    cost_delta_pct: float | None = Field(description="100 (cost_usd / chosen's - 1); null where the chosen's cost is 0 (a price so small it underflows)")
    source: Source = Field(description="where total_time_s and cost_usd come from (one prediction gives both)")
    rel_err: float | None = Field(None, description="their relative error (leave-one-out of the step-time model)")


class Constraint(BaseModel):
    """Objective deadline or budget: whether the chosen candidate meets the limit, and by how much it misses."""

    kind: Literal["deadline", "budget"]
    limit: float = Field(description="hours (deadline) or USD (budget), from the spec")
    met: bool = Field(description="false: no candidate meets it, and the closest one (fastest or cheapest) is chosen")
    message: str


KneeMethod = Literal["kneedle", "max_distance_fallback", "no_bend_fastest", "fastest_of_few"]  # explained in plan.knee


class Knee(BaseModel):
    """How the knee of the Pareto front was found (objective knee only; tula_service.plan.knee)."""

    global_batch: int
    method: KneeMethod = Field(description="how the knee was found (method_explained says it in words)")
    method_explained: str
    sensitivity: float = Field(description="Kneedle's S")
    curve: str = Field(description="the curve the knee is of")
    candidate: int = Field(description="index in candidates of the chosen configuration at the knee")


class BatchUnit(BaseModel):
    unit: Literal["samples", "sequences"] = Field(description="what a batch counts: sequences for language models")
    tokens_per_sample: int | None


# --- how to train at it ------------------------------------------------------------------------------


class Multipliers(BaseModel):
    """The learning-rate multiplier of each rule at k = global batch / reference batch."""

    linear: float = Field(description="k (Goyal et al. 2017)")
    sqrt: float = Field(description="sqrt(k)")
    adascale: float | None = Field(None, description="the AdaScale gain (square root for the adaptive optimizers: Adam, AdamW, RMSprop, NAdam, RAdam, Adamax), when the noise scale was measured")


class LearningRate(BaseModel):
    value: float = Field(description="reference_lr times the multiplier, capped at training.max_lr")
    reference_lr: float
    source: Source
    capped_from: float | None = Field(None, description="the rule's LR when it is above training.max_lr")
    why: str | None = None


class ExplainedSource(BaseModel):
    """A statement of the advice without a number: where it came from and why."""

    source: Literal["spec", "measured", "assumed"]
    why: str


class OptimizerSetting(BaseModel):
    value: bool | float | list[float] = Field(description="as torch.optim takes it (betas as [beta1, beta2])")
    source: Literal["spec", "assumed"] = Field(description="spec, or assumed: PyTorch's default (SGD's momentum: 0.9)")


class LrRule(BaseModel):
    batch_ratio_k: float = Field(description="global batch / training.reference_batch")
    optimizer: OptimizerName
    multipliers: Multipliers
    recommended: Literal["linear", "sqrt", "adascale"]
    multiplier: SourcedValue = Field(description="the recommended rule's multiplier")
    why: str
    momentum: SourcedValue | None = Field(None, description="SGD only: the heavy-ball momentum the advice is for (training.momentum: spec, or the assumed 0.9)")
    optimizer_settings: dict[str, OptimizerSetting] | None = Field(
        None, description="the optimizer's settings the advice, the profiling points and the pilot are for, as torch.optim "
        "names them (training.momentum, nesterov, betas, eps, alpha, centered, amsgrad, weight_decay), each with its source")
    lr: LearningRate | None = Field(None, description="only with training.reference_lr")
    stability: ExplainedSource | None = Field(None, description="when the rule raises the LR: whether the raised LR is known to train (spec: capped at training.max_lr; measured: capped at the measured stability headroom) or assumed")


class Warmup(BaseModel):
    epochs: float
    steps: int
    schedule: str | None = Field(None, description="only when there is a warm-up")
    why: str


class ScheduleStage(BaseModel):
    from_progress: float = Field(description="share of the noise-free steps to the target done when the stage starts")
    from_epoch: float = Field(description="predicted epochs done when the stage starts")
    global_batch: int
    device_batch: int
    devices: int
    accumulation: int
    lr_multiplier: float | None = Field(description="of training.reference_lr (the LR rule at this stage's batch, or the plan's LR for optimal_for_lr); null without a noise scale")
    noise_scale: float | None = Field(description="B_noise predicted at the stage's start")


class Schedule(BaseModel):
    stages: list[ScheduleStage]
    total_time_s: SourcedValue
    epochs: SourcedValue
    steps: SourcedValue | None
    how: str


class BatchSchedule(BaseModel):
    """Batch-size schedules over the run to the target (tula_service.plan.schedule, docs/schedule.md)."""

    recommended: Literal["constant", "optimal_for_lr", "time_optimal", "noise_tracking", "staged_doubling"]
    why: str
    predicted_gain: float = Field(description="the recommended schedule's predicted time saved against the constant batch, as a fraction")
    noise_profile: dict[str, Any] | None = Field(description="the noise scale's shape over the run the schedules are built on")
    schedules: dict[str, Schedule]
    caveats: list[str]


class ExplainedValue(BaseModel):
    """A number of the advice, where it came from and why."""

    value: float
    source: Source
    evidence: str | None = Field(None, description="what the measured values were taken along")
    why: str


class Ags(BaseModel):
    """Adaptive gradient scaling (Tula): scale the update by s on iterations whose gradient variability is below delta."""

    delta: ExplainedValue
    s: ExplainedValue
    rule: str


class TrainingAdvice(BaseModel):
    lr_rule: LrRule
    warmup: Warmup
    batch_schedule: BatchSchedule
    ags: Ags


# --- the inputs it was planned for -----------------------------------------------------------------


class Pricing(BaseModel):
    kind: PricingKind
    price: SourcedValue = Field(description="USD per GPU-hour, node-hour or GiB-hour: spec or catalog-assumed")
    fixed_overhead_usd: SourcedValue


class Device(BaseModel):
    gpu_type: str | None
    memory_gib: SourcedValue = Field(description="per device: spec or catalog-assumed")


class EdgeNote(BaseModel):
    """The pick sits at the edge of the search (tula_service.plan.recommend.chosen_at_edge)."""

    global_batch: int
    next_smaller_global_batch: int
    improvement: float = Field(description="how much the objective improves from the next smaller device batch to the pick (a share)")
    batch_over_reference: float = Field(description="the pick's global batch over training.reference_batch: how far its epochs are extrapolated")
    why: str


class SearchSpace(BaseModel):
    device_batches: list[int] = Field(description="per-device batches swept (within the profiled range, below any OOM)")
    max_device_batch: SourcedValue = Field(description="the largest whose predicted memory fits the device")
    memory_margin: SourcedValue = Field(description="fraction of the device memory kept free")
    devices: list[int]
    accumulation_steps: list[int]
    chosen_at_edge: EdgeNote | None = Field(
        None, description="set when the range, not the models, set the pick: the chosen device batch is the largest swept on "
        "its placement and accumulation, and the objective (min_time, min_cost) still improves up to it; null otherwise, "
        "and in a recommendation stored before it was given")  # fmt: skip


class MemoryLimit(BaseModel):
    """Where the profiling device ran out of memory."""

    largest_ok_batch: int
    smallest_oom_batch: int
    source: Source


class FailedPoint(BaseModel):
    kind: str
    batch_size: int | None
    error: str | None
    attempts: int
    attempt_errors: list[str]


class PointSummary(BaseModel):
    """A profiled batch as measured (of a re-timed batch, the quieter measurement)."""

    batch_size: int
    iter_time_median_s: Number
    iter_time_p10_s: Number | None
    iter_time_p90_s: Number | None
    iter_time_cv: Number | None
    iter_time_robust_cv: Number | None
    samples: int | None = Field(description="timed iterations")
    peak_bytes: Number
    activation_bytes: Number | None
    noise_scale: Number | None
    variability_median: Number | None
    options: dict[str, Any] | None = Field(description="the options the point ran with (dtype, channels_last, ...)")
    host_contended: bool | None
    source: Source


class Profiled(BaseModel):
    ok_batches: list[int]
    oom_batches: list[int]
    memory_limit: MemoryLimit | None
    failed: list[FailedPoint]
    points: list[PointSummary]


# --- what the models say -----------------------------------------------------------------------------


class ErrorSummary(BaseModel):
    """Relative errors of a fit's predictions, per point left out (or in sample); null with too few points."""

    median_rel_err: float | None
    max_rel_err: float | None
    points: int


class MemoryFit(_Detail):
    """M(b) fitted to the profiled points; null parameters (source assumed) when only steps were given."""

    formula: str
    static_bytes: float | None
    act_bytes_per_sample: float | None
    r2: float | None
    residual_std_bytes: float | None
    max_batch_rule: str
    leave_one_out: ErrorSummary
    source: Source


class ComputeShapeFit(_Detail):
    formula: str
    params: dict[str, float]
    eligible: bool = Field(description="fewer parameters than distinct batches: it predicts, not interpolates")
    leave_one_out: ErrorSummary


class ComputeSelection(_Detail):
    chosen: str
    why: str
    candidates: dict[str, ComputeShapeFit]


class ComputeFit(_Detail):
    name: str
    formula: str
    params: dict[str, float]
    selection: ComputeSelection
    leave_one_out: ErrorSummary
    source: Source


class MeasuredLink(_Detail):
    """The all-reduce benchmark's fit, or why it could not be fitted (`error`)."""

    latency_s: float | None = None
    bandwidth_gbps: float | None = Field(None, description="null when latency-bound: bandwidth unresolved")
    source: Source | None = None
    in_sample: ErrorSummary | None = None
    leave_one_out: ErrorSummary | None = None
    backend: str | None = None
    device: str | None = None
    note: str | None = None
    error: str | None = None


class LinkFit(_Detail):
    name: str | None
    bandwidth_gbps: SourcedValue
    latency_s: SourcedValue


class NetworkFit(_Detail):
    formula: str
    gradient_bytes: SourcedValue
    measured_link: MeasuredLink | None = Field(None, description="only when the all-reduce benchmark ran")
    note: str | None = Field(None, description="why a measured link is reported and not used")
    intra_node: LinkFit
    inter_node: LinkFit | None = Field(description="null on one node")


class OverlapFit(_Detail):
    formula: str
    g: SourcedValue


class StepTimeFit(_Detail):
    """How a step's seconds on several devices are predicted (tula_service.fit.step_time)."""

    model: Literal["analytic", "placement"] = Field(description="analytic: links and overlap; placement: fitted to measured steps")
    formula: str
    multi_device_steps: int = Field(description="measured steps on two or more devices the model was fitted to")


class NoiseEvidence(_Detail):
    source: str = Field(description="other_runs | reference_run | pilot | initialization")
    noise_scale: float | None
    interval: list[float] | None
    stderr: float | None
    detail: dict[str, Any]
    warnings: list[str]
    weak: bool
    ratio_to_used: float | None


class EvidenceReport(_Detail):
    used: str | None
    order: list[str] | None = Field(None, description="the evidence, best first")
    candidates: list[NoiseEvidence]


class CalibratedInterval(BaseModel):
    """How far the noise scale read may be from the one the epochs need, measured across tasks (tula_service.fit.epochs_calibration)."""

    value: list[float] = Field(description="[low, high] B_noise, in samples: the read times factors, joined with the statistical interval")
    factors: list[float] = Field(description="the quantiles of (best-fitting B_noise / B_noise read) over the calibration tasks")
    quantiles: list[float]
    source: Source
    calibration: str = Field(description="the factors used: reference_run, initialization, or prefix@<share of the run to the target>: the factors of records that stop short of it (a pilot, a cut-short reference run)")
    why: str


class NoiseScale(_Detail):
    value: float = Field(description="B_noise, in samples")
    interval: list[float] | None = Field(description="the statistical interval of the reading (how well its records pin it down)")
    stderr: float | None
    source: Source
    evidence: str
    calibrated_interval: CalibratedInterval | None = Field(
        None, description="the interval the model's error measured across tasks gives (80%); the candidates' epochs, time and cost carry the matching calibrated_interval; null where none applies (other_runs)")


class NextRun(BaseModel):
    """The run to measure next where the epochs rest on gradient statistics or on nothing (efficiency_evidence.next_run)."""

    batch: int = Field(description="global batch of the run: its epochs to the same target, given as training.other_runs, settle the epochs model")
    predicted_epochs: float = Field(description="the epochs predicted at that batch now")
    predicted_epochs_interval: list[float] | None = Field(None, description="their calibrated 80% interval, where the noise scale has one")
    why: str


class AssumedEfficiency(_Detail):
    """No informative noise-scale measurement: epochs constant up to the reference batch, steps beyond it."""

    formula: str
    noise_scale: None
    source: Literal["assumed"]
    evidence: EvidenceReport
    warnings: list[str]
    note: str
    next_run: NextRun | None = None


class FittedEfficiency(_Detail):
    """E(B) = E_min (1 + B / B_noise) with B_noise from the best evidence (tula_service.fit.efficiency_evidence)."""

    formula: str
    noise_scale: NoiseScale
    evidence: EvidenceReport
    max_step_gain: ExplainedValue | None
    lr_headroom: ExplainedValue | None = Field(None, description="measured stability headroom that caps the advised LR (with training.max_lr, the lower cap wins); none: not measured, or the epochs come from training.other_runs")
    min_epochs: SourcedValue
    assumes_lr: str | None = Field(None, description="the LR protocol the epochs are predicted for: the advised rule, or the measured runs' LRs")
    source: Literal["fitted"]
    warnings: list[str]
    weak: bool
    note: str
    next_run: NextRun | None = Field(None, description="the run to measure next; null where the epochs come from measured runs (training.other_runs)")


class FitReport(_Detail):
    """Each model's formula, parameters, fit quality and inputs, each input labelled."""

    memory: MemoryFit
    compute: ComputeFit
    network: NetworkFit
    overlap: OverlapFit
    step_time: StepTimeFit
    efficiency: Annotated[FittedEfficiency | AssumedEfficiency, Field(discriminator="source")]


class IterTimeCurve(BaseModel):
    device_batch: list[float]
    iter_time_s: list[float]
    samples_per_s: list[float]
    devices: int
    model: str
    formula: str
    source: Source
    rel_err: float | None


class MemoryCurve(BaseModel):
    device_batch: list[float]
    memory_bytes: list[float]
    memory_upper_bytes: list[float] = Field(description="the 95% prediction interval's upper end")
    formula: str
    source: Source
    rel_err: float | None


class EpochsCurve(BaseModel):
    global_batch: list[float]
    epochs: list[float]
    formula: str
    source: Source
    calibrated_low: list[float] | None = Field(None, description="the low end of the epochs' calibrated interval at each batch (tula_service.fit.epochs_calibration); absent without one")
    calibrated_high: list[float] | None = Field(None, description="its high end")


class Curves(BaseModel):
    """The fitted models evaluated for drawing, by the objects the sweep uses (parallel lists)."""

    iter_time: IterTimeCurve
    memory: MemoryCurve | None = Field(description="null when no memory was measured (steps only)")
    epochs: EpochsCurve


class ReliabilityThresholds(BaseModel):
    point_cv: float
    leave_one_out_rel_err: float
    source: Source


class Reliability(BaseModel):
    """Whether the profile's timings can be trusted (tula_service.dispatch.reliability)."""

    verdict: Literal["reliable", "unreliable"]
    message: str
    reasons: list[str]
    retimed_batches: list[int]
    thresholds: ReliabilityThresholds


# --- the recommendation ------------------------------------------------------------------------------


class Recommendation(BaseModel):
    """The chosen configuration for the objective, how to train at it, and everything it rests on."""

    objective: Objective = Field(description="what the chosen configuration is best at (the spec's objective)")
    constraint: Constraint | None = Field(description="objective deadline or budget only: met, or missed by how much")
    training_advice: TrainingAdvice = Field(description="learning rate, warm-up, batch schedule and AGS at the chosen configuration")
    runner_ups: list[RunnerUp] = Field(description="the next candidates in the objective's order")
    batch_unit: BatchUnit = Field(description="what a batch counts: samples, or sequences of a language model")
    chosen: Candidate = Field(description="the recommended configuration (one of candidates)")
    knee: Knee | None = Field(description="objective knee only: how the knee was found")
    candidates: list[Candidate] = Field(description="every configuration swept that fits the device memory")
    pareto_front: list[int] = Field(description="indices in candidates on the (time, cost) Pareto front")
    pricing: Pricing = Field(description="the price the costs are computed with")
    device: Device = Field(description="the device planned for")
    models: FitReport = Field(description="the fitted models: formulas, parameters, fit quality, labelled inputs")
    curves: Curves = Field(description="the fitted models evaluated for drawing")
    reliability: Reliability = Field(description="whether the profile's timings can be trusted")
    search_space: SearchSpace = Field(description="the configurations the sweep considered")
    profiled: Profiled = Field(description="what was measured: the batches that ran, ran out of memory or failed")


# The routes' answers put their own fields first; a base listed last comes first in field order.
class _OfJob(BaseModel):
    job_id: str


class _WhatIfOfJob(_OfJob):
    what_if: dict[str, Any] = Field(description="the what-if's fields as given (the request body): what it changed")


class StoredKnee(Knee):
    candidate: int | None = Field(None, description="index in candidates of the chosen configuration at the knee; "
                                  "absent from a recommendation stored before it was served")  # fmt: skip


class JobRecommendation(Recommendation, _OfJob):
    """A done job's stored recommendation. One stored before the curves were served has neither `curves` nor
    `knee.candidate`; POST /v1/jobs/{job_id}/plan with {} plans its measurements again with both."""

    knee: StoredKnee | None = Field(description="objective knee only: how the knee was found")
    curves: Curves | None = Field(None, description="absent from a recommendation stored before the curves were served")


class WhatIfPlan(Recommendation, _WhatIfOfJob):
    """A done job's measurements planned again with the what-if applied."""


class StatelessPlan(Recommendation):
    """POST /v1/plan: the recommendation of the measurements given, planned and not stored."""

    measurements: dict[str, int] = Field(description="how many measurements of each kind were planned from")
