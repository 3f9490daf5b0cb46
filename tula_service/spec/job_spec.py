"""The job spec: what a user asks Tula to optimize (pydantic v2; also accepted as YAML/JSON by the CLI)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, ValidationError, ValidationInfo, field_validator, model_validator

from models.data_roots import check_submitted_path
from models.registry import (
    DATASET_SPEC_FIELDS,
    DATASETS,
    LOSSES,
    MODELS,
    compatible,
    image_size_problem,
    is_user_model_ref,
    is_user_ref,
    loss_problem,
    not_allowlisted_message,
    resolved_model_options,
    unknown_name_message,
    user_model_allowed,
)
from tula_service.catalogs import CATALOG_SOURCE, load_gpus, load_interconnects
from tula_service.fit.links import catalog_link_defaults
from tula_service.settings import environment
from tula_service.spec.spec_limits import (
    MAX_BATCH, MAX_GPUS_PER_NODE, MAX_GRADIENT_STATISTIC, MAX_NODES, MAX_NUM_SAMPLES, max_batch_sizes, max_devices, reject_bool,
    reject_bool_number,
)
from tula_service.spec.user_code_check import USER_CODE_NOTE_MAX_CHARS, check_user_code, field_errors, validating_client_submission

# Counts are integers >= 1; a JSON `true` is refused rather than read as 1 (tula_service.spec.spec_limits).
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(reject_bool)]
BatchSize = Annotated[int, Field(ge=1, le=MAX_BATCH), BeforeValidator(reject_bool)]
Count = Annotated[int, BeforeValidator(reject_bool)]
MeasuredNumber = Annotated[float, BeforeValidator(reject_bool_number)]  # a statistic a run recorded: never a boolean
# |G|^2 or tr(Sigma) as a run recorded it: finite, never a boolean, within +-MAX_GRADIENT_STATISTIC
GradientStatistic = Annotated[float, BeforeValidator(reject_bool_number), Field(ge=-MAX_GRADIENT_STATISTIC, le=MAX_GRADIENT_STATISTIC)]


def allowed_model_modules() -> list[str]:
    """Module prefixes whose `module:factory` user models may be imported (it is code execution)."""
    return environment().allowed_model_modules


def in_catalog(kind: str, name: str, catalog: dict[str, object]) -> str:
    if name not in catalog:
        raise ValueError(unknown_name_message(kind, name, catalog))
    return name


class _Strict(BaseModel):
    """Unknown fields refused, and no boolean read as a number: pydantic's lax float reads JSON `true`
    as 1.0, so every float field of a spec model refuses a boolean, naming the field."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_numbers(cls, data: object) -> object:
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                value = data.get(field.alias or name)
                if isinstance(value, bool) and field.annotation in _FLOAT_ANNOTATIONS:
                    raise ValueError(f"{field.alias or name}: give a number, not a boolean")
        return data


_FLOAT_ANNOTATIONS = (float, float | None)


# Where a value of the validated spec came from: given in the spec, or filled from the GPU catalog
# (`cluster.gpu_type`). A what-if re-derives the catalog ones when it changes what they came from.
ValueSource = Literal["spec", "catalog-assumed"]
VALUE_SOURCES = ("spec", "catalog-assumed", None)

# Choices of the spec that the CLI and the benchmarks offer too (typing.get_args lists them).
Objective = Literal["knee", "min_time", "min_cost", "deadline", "budget"]
PricingKind = Literal["gpu_hour", "node_hour", "memory_gb_hour"]
Precision = Literal["fp32", "bf16", "fp16"]

# SGD's momentum where the spec gives none: what profiling points and pilots have always trained with, and the
# most common choice (PyTorch examples, the CPU tasks of benchmarks/efficiency_tasks.py).
DEFAULT_SGD_MOMENTUM = 0.9
# RMSprop's where the spec gives none: PyTorch's default (torch.optim.RMSprop momentum=0).
DEFAULT_RMSPROP_MOMENTUM = 0.0
# Adam's and AdamW's (beta1, beta2) where the spec gives none: PyTorch's defaults (torch.optim.Adam, AdamW).
DEFAULT_ADAM_BETAS = (0.9, 0.999)
# NAdam's momentum_decay psi where the spec gives none: PyTorch's default. Its Nesterov coefficient ramps up as
# mu_t = beta1 (1 - 0.5 x 0.96^(t psi)) (Dozat 2016), half of beta1 at the first step.
DEFAULT_NADAM_MOMENTUM_DECAY = 4e-3
# torch.optim's settings the spec takes beside the LR (their PyTorch names), the optimizers each is for, and the value
# each trains with where the spec leaves it out: PyTorch's default (torch.optim.SGD, Adam, AdamW, RMSprop, NAdam, RAdam,
# Adamax, Adagrad, Adafactor), except SGD's momentum (DEFAULT_SGD_MOMENTUM). Profiling points and the pilot train with all of them; the
# pilot reports each with its source.
OPTIMIZER_SETTING_DEFAULTS: dict[str, dict[str, Any]] = {
    "momentum": {"sgd": DEFAULT_SGD_MOMENTUM, "rmsprop": DEFAULT_RMSPROP_MOMENTUM},
    "nesterov": {"sgd": False},
    "dampening": {"sgd": 0.0},
    "betas": {"adam": DEFAULT_ADAM_BETAS, "adamw": DEFAULT_ADAM_BETAS, "nadam": DEFAULT_ADAM_BETAS, "radam": DEFAULT_ADAM_BETAS,
              "adamax": DEFAULT_ADAM_BETAS},
    "eps": {"adam": 1e-8, "adamw": 1e-8, "rmsprop": 1e-8, "nadam": 1e-8, "radam": 1e-8, "adamax": 1e-8, "adagrad": 1e-10},
    "alpha": {"rmsprop": 0.99},
    "centered": {"rmsprop": False},
    "amsgrad": {"adam": False, "adamw": False},
    "momentum_decay": {"nadam": DEFAULT_NADAM_MOMENTUM_DECAY},
    "decoupled_weight_decay": {"nadam": False, "radam": False},
    "weight_decay": {"sgd": 0.0, "adam": 0.0, "adamw": 0.01, "rmsprop": 0.0, "nadam": 0.0, "radam": 0.0, "adamax": 0.0, "adagrad": 0.0,
                     "adafactor": 0.0},
}
# as messages and the advice name them; the keys are the spec's `training.optimizer` choices
OPTIMIZER_NAMES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "rmsprop": "RMSprop", "nadam": "NAdam", "radam": "RAdam",
                   "adamax": "Adamax", "adagrad": "Adagrad", "adafactor": "Adafactor"}
OptimizerName = Literal["sgd", "adam", "adamw", "rmsprop", "nadam", "radam", "adamax", "adagrad", "adafactor"]


def setting_optimizers(setting: str) -> tuple[str, ...]:
    """The optimizers a setting of OPTIMIZER_SETTING_DEFAULTS is for, e.g. ("sgd", "rmsprop") for momentum."""
    return tuple(OPTIMIZER_SETTING_DEFAULTS[setting])


def optimizer_setting_names(optimizer: str) -> tuple[str, ...]:
    """The settings of OPTIMIZER_SETTING_DEFAULTS an optimizer takes, e.g. momentum, nesterov, weight_decay for sgd."""
    return tuple(name for name, defaults in OPTIMIZER_SETTING_DEFAULTS.items() if optimizer in defaults)

Beta = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False), BeforeValidator(reject_bool_number)]  # one of Adam's betas, in [0, 1)


DATASET_FIELDS = DATASET_SPEC_FIELDS


def _field_error(field: str, message: str, error_type: str = "dataset_field") -> ValidationError:
    """A dataset error at its own field (`dataset.<field>` in a 422), not at the dataset as a whole."""
    return field_errors([((field,), message)], error_type)


# Validation context of a spec the server already accepted (JobSpec.stored): the decisions taken at its
# submission (user code allowlisted and checked, file paths under a data root) hold; they are not taken
# again against today's allowlist and data roots, so narrowing those fails no stored job's parse. A worker
# still refuses a module that is no longer allowlisted, or a path outside today's roots: the point fails
# with that reason, as data.
STORED = "stored"
# Validation context of a spec checked by a client before it sends it (the CLI): the spec's own rules are
# checked, the server's policy is not, because the client cannot know it. The allowlist, the data roots and the
# bounds an operator sets (TULA_MAX_DEVICES, TULA_MAX_BATCH_SIZES) are the server's environment, not the
# client's, and the user code's contract is checked by importing a module that may exist only where the server
# runs. The server checks all of them at submission, and its 422 names the field.
CLIENT_SIDE = "client_side"


def _stored(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get(STORED))


def _client_side(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get(CLIENT_SIDE))


def _server_decided(info: ValidationInfo) -> bool:
    """Whether the server's policy (allowlist, data roots) is not this validation's to apply: decided at the
    spec's submission (STORED), or left to the server (CLIENT_SIDE)."""
    return _stored(info) or _client_side(info)


def _under_a_data_root(path: str | None, info: ValidationInfo) -> str | None:
    """A file the worker reads (dataset.path, initial_weights): only under the operator's data roots (models.data_roots)."""
    problem = None if path is None or _server_decided(info) else check_submitted_path(path, environment().data_roots)
    if problem:
        raise ValueError(problem)
    return path


def _known_or_allowed_dataset(name: str, info: ValidationInfo) -> str:
    if not is_user_ref(name):
        return in_catalog("dataset", name, DATASETS)
    if not _server_decided(info) and not user_model_allowed(name, allowed_model_modules()):
        raise ValueError(not_allowlisted_message("dataset", name))
    return name


class DatasetSpec(_Strict):
    """A catalog dataset, or an allowlisted user dataset "package.module:factory" whose factory receives the
    fields given (docs/user_models.md); which fields apply to a catalog dataset depends on it (see the catalog)."""

    name: str = Field(description="dataset catalog name, or 'package.module:factory' when allowlisted")
    num_samples: PositiveInt | None = Field(None, le=MAX_NUM_SAMPLES, description="training-set size D: samples per epoch")
    channels: int | None = Field(None, ge=1, le=16)
    image_size: int | None = Field(None, ge=4, le=1024, description="square image side in pixels")
    num_classes: int | None = Field(None, ge=2, le=100_000)
    seq_len: int | None = Field(None, ge=2, le=65_536, description="tokens per sequence")
    vocab_size: int | None = Field(None, ge=2, le=1_000_000)
    path: str | None = Field(None, max_length=4096, description="data on the worker's file system")
    scaling: Literal["unit", "standard", "raw"] | None = Field(
        None, description="digits: the pixel scaling of your run: unit (X/16, in [0, 1]), standard (mean/std of the split), raw (0..16)"
    )
    split: Literal["train", "all"] | None = Field(
        None, description="digits, diabetes: train (train_test_split(test_size=0.2, random_state=0): 1437 images, 353 patients) "
        "or all (1797, 442)"
    )
    options: dict[str, int | float | str | bool] | None = Field(
        None, description="a user dataset's own keyword arguments, passed to its factory as given"
    )

    _known_dataset = field_validator("name")(_known_or_allowed_dataset)

    _path_under_a_data_root = field_validator("path")(_under_a_data_root)

    @model_validator(mode="after")
    def _fields_fit_the_dataset(self) -> DatasetSpec:
        needs_num_samples = f"dataset '{self.name}' needs 'num_samples' (samples per epoch)"
        if is_user_ref(self.name):  # its factory says which fields it takes: checked with the user code
            if self.num_samples is None:
                raise _field_error("num_samples", needs_num_samples, "dataset_field_missing")
            return self
        info = DATASETS[self.name]
        if self.options is not None:
            raise _field_error("options", f"options apply to user datasets (package.module:factory), not to '{self.name}'")
        for field in DATASET_FIELDS:
            given = getattr(self, field)
            if given is not None and field not in info.fields:
                accepted = ", ".join(sorted(info.fields)) or "none"
                raise _field_error(field, f"field '{field}' does not apply to dataset '{self.name}' (it takes: {accepted})")
            if given is None and field in info.required:
                raise _field_error(field, f"dataset '{self.name}' needs the field '{field}'", "dataset_field_missing")
            if given is None and info.fields.get(field) is not None:
                setattr(self, field, info.fields[field])
        if self.num_samples is None:
            if info.fixed_num_samples is None:
                raise _field_error("num_samples", needs_num_samples, "dataset_field_missing")
            self.num_samples = info.split_sizes.get(self.split, info.fixed_num_samples)
        if info.max_num_samples is not None and self.num_samples > info.max_num_samples:
            raise _field_error("num_samples", (
                f"dataset '{self.name}' generates at most {info.max_num_samples} samples (got {self.num_samples}); "
                "ask for fewer, or give the data as a user dataset"
            ))
        return self


def powers_of_two_between(low: int, high: int) -> list[int]:
    """Powers of two in [low, high], plus both ends, sorted."""
    values, batch = {low, high}, 1
    while batch <= high:
        if batch >= low:
            values.add(batch)
        batch *= 2
    return sorted(values)


def _whole(value: object) -> object:
    """A whole float (8.0, as JSON and YAML may write an integer) as its int, as a listed batch size is read;
    anything else (a bool among them) as it is."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None if isinstance(value, bool) else value


def _expand_batch_range(value: object) -> object:
    """Accept `{min, max}` as shorthand for the powers of two between them."""
    if not isinstance(value, dict):
        return value
    if set(value) != {"min", "max"}:
        raise ValueError("a batch range is {min, max}; or give a list of batch sizes")
    low, high = (_whole(value[end]) for end in ("min", "max"))
    if not all(isinstance(v, int) and v >= 1 for v in (low, high)):
        raise ValueError("batch range min and max must be integers >= 1")
    if low > high:
        raise ValueError(f"batch range min ({low}) must be <= max ({high})")
    if high > MAX_BATCH:
        raise ValueError(f"batch range max ({high}) is above the largest batch Tula profiles ({MAX_BATCH})")
    return powers_of_two_between(low, high)


class ClusterSpec(_Strict):
    """The devices to plan for. With `gpu_type` (a GPU catalog name), device_memory_gib defaults to
    that GPU's memory, and intra_node_link to its link when neither intra_node_link nor
    interconnect_gbps is given; values given in the spec always win. The `*_source` fields record
    which values were given ("spec") and which were filled from the catalog ("catalog-assumed")."""

    nodes: PositiveInt = 1
    gpus_per_node: PositiveInt = 1
    gpu_type: str | None = Field(
        None, description="GPU catalog name (GET /v1/catalog/gpus), e.g. h100_sxm: the default device memory, "
        "intra-node link and gpu_hour price; the profiled device's speed is used as measured"
    )
    device_memory_gib: float | None = Field(
        None, gt=0, validate_default=True, description="memory per device in GiB; default: the gpu_type's"
    )
    interconnect_gbps: float | None = Field(
        None, gt=0, description="all-reduce bandwidth in Gbit/s for links the spec does not name (latency assumed)"
    )
    intra_node_link: str | None = Field(None, description="interconnect catalog name, e.g. nvlink4, pcie4_x16")
    inter_node_link: str | None = Field(None, description="interconnect catalog name, e.g. infiniband_ndr")
    device_memory_source: ValueSource = Field(
        "spec", description="set by the server: 'catalog-assumed' when device_memory_gib came from gpu_type (ignored in a submission)"
    )
    intra_node_link_source: ValueSource | None = Field(
        None, description="set by the server: 'spec', 'catalog-assumed' (from gpu_type), or null without a named link "
        "(ignored in a submission)"
    )

    @model_validator(mode="before")
    @classmethod
    def _gpu_defaults(cls, data: object) -> object:
        if not isinstance(data, dict) or not isinstance(data.get("gpu_type"), str):
            return data
        entry = load_gpus().get(data["gpu_type"])
        if entry is None:  # the gpu_type validator names the known GPUs
            return data
        data = dict(data)
        if data.get("device_memory_gib") is None:
            data.update(device_memory_gib=entry.memory_gib, device_memory_source=CATALOG_SOURCE)
        data.update(catalog_link_defaults(data))  # tula_service.fit.links decides when the GPU's link applies
        return data

    @field_validator("gpu_type")
    @classmethod
    def _known_gpu(cls, name: str | None) -> str | None:
        return None if name is None else in_catalog("GPU type", name, load_gpus())

    @field_validator("device_memory_gib")
    @classmethod
    def _memory_given(cls, memory_gib: float | None, info: ValidationInfo) -> float | None:
        if memory_gib is None and "gpu_type" in info.data:  # a known gpu_type has filled it; a bad one has its error
            raise ValueError(
                "give device_memory_gib (GiB per device) or a gpu_type from the GPU catalog, which sets it; "
                f"known GPU types: {', '.join(sorted(load_gpus()))}"
            )
        return memory_gib

    @field_validator("intra_node_link", "inter_node_link")
    @classmethod
    def _known_link(cls, name: str | None) -> str | None:
        return None if name is None else in_catalog("interconnect", name, load_interconnects())

    @model_validator(mode="after")
    def _sources_agree(self) -> ClusterSpec:
        if self.intra_node_link is None:
            self.intra_node_link_source = None
        elif self.intra_node_link_source is None:
            self.intra_node_link_source = "spec"
        if self.gpu_type is None and CATALOG_SOURCE in (self.device_memory_source, self.intra_node_link_source):
            raise ValueError("a 'catalog-assumed' source needs the gpu_type it was taken from")
        return self

    @property
    def total_devices(self) -> int:
        return self.nodes * self.gpus_per_node


class PricingSpec(_Strict):
    kind: PricingKind
    price: float | None = Field(
        None, gt=0, validate_default=True, description="USD per GPU-hour, per node-hour, or per GiB-hour of device "
        "memory used; kind gpu_hour with cluster.gpu_type defaults to the GPU catalog's price"
    )
    fixed_overhead_usd: float = Field(0.0, ge=0, description="per-job cost on top (e.g. start-up, storage)")
    price_source: ValueSource = Field(
        "spec", description="set by the server: 'catalog-assumed' when price is the catalog's for cluster.gpu_type (ignored in a submission)"
    )

    @field_validator("price")
    @classmethod
    def _price_given(cls, price: float | None) -> float | None:
        if price is None:  # JobSpec fills the catalog price before this runs, where there is one
            raise ValueError(
                "give price; only kind gpu_hour with a cluster.gpu_type has a default (the GPU catalog's price)"
            )
        return price

    @model_validator(mode="after")
    def _catalog_price_is_per_gpu_hour(self) -> PricingSpec:
        if self.price_source == CATALOG_SOURCE and self.kind != "gpu_hour":
            raise ValueError("a 'catalog-assumed' price is per GPU-hour: it needs kind gpu_hour")
        return self


class GradientStatsRecord(_Strict):
    """Gradient statistics taken along a training run (the pilot point, or the user's reference run through
    `profiler.reference_logger`): the unbiased two-batch estimates of |G|^2 and tr(Sigma) (McCandlish et al.
    2018, App. A.1), averaged over a window of steps, numerator and denominator separately. B_simple =
    trace_sigma / grad_sqr. A noisy window may give a slightly negative estimate: it is data, not an error."""

    samples: Count = Field(ge=0, description="training samples the run had seen (all devices) at the end of the record's window: where "
                           "its statistics were taken, unless statistics_samples says where")
    batch: BatchSize = Field(description="global batch of those steps")
    grad_sqr: GradientStatistic = Field(allow_inf_nan=False, description="|G|^2, the squared norm of the true gradient")
    trace_sigma: GradientStatistic = Field(allow_inf_nan=False, description="tr(Sigma) per sample: B_simple = trace_sigma / grad_sqr")
    loss: MeasuredNumber | None = Field(None, allow_inf_nan=False, description="training loss, mean over the window")
    metric: MeasuredNumber | None = Field(None, allow_inf_nan=False, description="the run's evaluation metric at this record")
    step: Count | None = Field(None, ge=0)
    window_steps: PositiveInt | None = Field(None, description="optimizer steps the record averages")
    variability: MeasuredNumber | None = Field(
        None, ge=0, le=MAX_GRADIENT_STATISTIC, allow_inf_nan=False,
        description="median over the window of | |g_t| - |g_t-1| | / |g_t-1| (AGS); bounded as |G|^2 is, so that the AGS delta "
        "scaled to another batch stays finite",
    )
    precond_grad_sqr: GradientStatistic | None = Field(None, allow_inf_nan=False, description="adaptive optimizers (Adam, AdamW, RMSprop, NAdam, RAdam, Adamax): |P G|^2, P = 1/(sqrt(v)+eps), v the optimizer's second moment")
    precond_trace_sigma: GradientStatistic | None = Field(None, allow_inf_nan=False, description="adaptive optimizers: tr(P Sigma P) per sample")
    stability_headroom: MeasuredNumber | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="the factor by which the LR could grow before the top Hessian direction is unstable, (2 + 2 beta) / (eta "
        "lambda_max) (Adam: / (1 - beta1), preconditioned), measured at this record (profiler.sharpness)",
    )  # fmt: skip
    stability_lr: MeasuredNumber | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="the optimizer's LR when stability_headroom was measured: with training.reference_lr the service reads "
        "the headroom relative to it, stability_headroom x stability_lr / reference_lr (a warm-up, a decay or a changed LR "
        "moves eta, not the largest stable LR)",
    )  # fmt: skip
    statistics_samples: Count | None = Field(
        None, ge=0,
        description="where within the window the statistics were taken: the mean, over the steps they average, of the samples "
        "seen after each (profiler.reference_logger). With sparse sampling a window's statistics may come "
        "from its first steps, in the first window from the initial weights: the service places the noise scale here "
        "(absent: at samples)",
    )  # fmt: skip


MAX_GRADIENT_STATS_RECORDS = 2_000  # ~600 kB of JSON, inside the 1 MiB request cap; `tula submit` merges longer files


class ReferenceRunSpec(_Strict):
    """Evidence from the user's own reference run (at training.reference_batch, on their cluster and data)."""

    gradient_stats: list[GradientStatsRecord] = Field(
        default_factory=list, max_length=MAX_GRADIENT_STATS_RECORDS,
        description="records written by profiler.reference_logger (JSONL: `tula submit --reference-stats FILE`)",
    )


class RunResult(_Strict):
    """Another run of the user's: epochs to the same target at another global batch."""

    batch: BatchSize = Field(description="global batch of that run")
    epochs: float = Field(gt=0, allow_inf_nan=False, description="epochs it needed to reach the same target")


class TrainingSpec(_Strict):
    reference_batch: BatchSize = Field(description="global batch of the user's reference run")
    reference_epochs: float = Field(gt=0, description="epochs the reference run needs to reach its target")
    reference_lr: float | None = Field(None, gt=0, description="learning rate of the reference run")
    max_lr: float | None = Field(
        None, gt=0, description="the largest learning rate this model trains stably with (e.g. the edge of an LR "
        "sweep); needs reference_lr. It caps the LR advice and the speed-up per step a larger batch can buy"
    )
    optimizer: OptimizerName = Field(
        "sgd", description="the reference run's optimizer, as PyTorch names it (torch.optim.SGD, Adam, AdamW, RMSprop, NAdam, "
        "RAdam, Adamax, Adagrad, Adafactor), with its settings below (each only for the optimizers that have it; PyTorch's default where left "
        f"out, but SGD's momentum, {DEFAULT_SGD_MOMENTUM:g}): sgd: momentum, nesterov, dampening, weight_decay; adam and "
        "adamw: betas, eps, amsgrad, weight_decay; rmsprop: momentum, alpha, eps, centered, weight_decay; nadam: betas, eps, "
        "momentum_decay, decoupled_weight_decay, weight_decay; radam: betas, eps, decoupled_weight_decay, weight_decay; "
        "adamax: betas, eps, weight_decay; adagrad: eps, weight_decay (its lr_decay and initial_accumulator_value at "
        "PyTorch's 0); adafactor: weight_decay (its beta2_decay -0.8, eps (None, 1e-3) and clipping threshold d 1 at "
        "PyTorch's defaults; its lr caps the relative step min(lr, 1 / sqrt(t)), PyTorch's default 0.01)")
    momentum: float | None = Field(
        None, ge=0, lt=1, allow_inf_nan=False,
        description="the optimizer's momentum, for sgd (heavy ball: torch.optim.SGD momentum; 0 for plain SGD; default "
        f"{DEFAULT_SGD_MOMENTUM:g}, assumed) and rmsprop (torch.optim.RMSprop momentum, on the preconditioned step; default "
        f"{DEFAULT_RMSPROP_MOMENTUM:g}, PyTorch's, assumed); profiling points and the pilot train with it. Not for adam or "
        "adamw (their `betas`)",
    )
    nesterov: StrictBool | None = Field(
        None, description="sgd only: Nesterov momentum (torch.optim.SGD nesterov; needs momentum > 0); default false. The "
        "stability threshold is then (2 + 2 beta) / ((1 + 2 beta) eta), not the heavy ball's (2 + 2 beta) / eta",
    )
    dampening: float | None = Field(
        None, ge=0, le=1, allow_inf_nan=False,
        description="sgd only: torch.optim.SGD dampening d, the momentum buffer takes (1 - d) of each gradient (not with "
        "nesterov, which torch refuses); default 0. The stability threshold is then (2 + 2 beta) / ((1 - d) eta)",
    )
    betas: tuple[Beta, Beta] | None = Field(
        None,
        description="Adam's, AdamW's, NAdam's, RAdam's and Adamax's (beta1, beta2) (torch.optim.Adam betas; e.g. [0.9, "
        f"0.95], as large language models are often trained), each in [0, 1); profiling points and the pilot train with "
        f"them, and beta1 sets the stability threshold. Default {list(DEFAULT_ADAM_BETAS)}, PyTorch's (assumed). Only with "
        "optimizer adam, adamw, nadam, radam or adamax",
    )
    eps: float | None = Field(
        None, gt=0, le=1, allow_inf_nan=False,
        description="adam, adamw, rmsprop, nadam, radam, adamax and adagrad: the term added to sqrt(v) in the preconditioner "
        "1 / (sqrt(v) + eps) (Adamax's: to |g| in its infinity norm; Adagrad's v: the sum of every past g^2); default 1e-8, "
        "Adagrad's 1e-10, PyTorch's (assumed)",
    )
    alpha: Beta | None = Field(None, description="rmsprop only: the smoothing constant of its mean square, in [0, 1); default 0.99, PyTorch's")
    centered: StrictBool | None = Field(
        None, description="rmsprop only: divide by the gradient's variance estimate, v = E[g^2] - E[g]^2 (Graves 2013); default false")
    amsgrad: StrictBool | None = Field(None, description="adam and adamw only: the AMSGrad variant (the largest v so far); default false")
    momentum_decay: float | None = Field(
        None, ge=0, le=100, allow_inf_nan=False,
        description="nadam only: psi in NAdam's momentum schedule mu_t = beta1 (1 - 0.5 x 0.96^(t psi)) (torch.optim.NAdam "
        f"momentum_decay); default {DEFAULT_NADAM_MOMENTUM_DECAY:g}, PyTorch's (assumed). It sets how fast the Nesterov "
        "coefficient, and with it the stability threshold, ramps up",
    )
    decoupled_weight_decay: StrictBool | None = Field(
        None, description="nadam and radam only: weight_decay decoupled from the gradient, as AdamW's (the weights shrink by lr x "
        "weight_decay a step); default false, PyTorch's: an L2 term added to the gradient",
    )
    weight_decay: float | None = Field(
        None, ge=0, le=10, allow_inf_nan=False,
        description="torch.optim's weight_decay, for every optimizer: an L2 term added to the gradient for sgd, adam, "
        "rmsprop, adamax, adagrad, and nadam and radam unless decoupled_weight_decay; decoupled (the weights shrink by lr x weight_decay a "
        "step) for adamw and adafactor. Default PyTorch's: 0, adamw 0.01 (assumed). Profiling points and the pilot train with it; the "
        "gradient statistics are of the loss alone",
    )
    reference_run: ReferenceRunSpec | None = Field(
        None, description="gradient statistics along the reference run: the best evidence for the noise scale"
    )
    other_runs: list[RunResult] = Field(
        default_factory=list, max_length=64,
        description="epochs to the same target at other batches: with them E_min and B_noise are fitted directly",
    )

    @model_validator(mode="after")
    def _other_runs_differ(self) -> TrainingSpec:
        batches = [run.batch for run in self.other_runs]
        if len(set(batches)) != len(batches) or self.reference_batch in batches:
            raise ValueError("other_runs: one run per batch, none at reference_batch (that one is reference_epochs)")
        return self

    @model_validator(mode="after")
    def _settings_are_the_optimizers(self) -> TrainingSpec:
        """Each optimizer setting only with an optimizer that has it (OPTIMIZER_SETTING_DEFAULTS), a 422 at its field."""
        problems = []
        for name in OPTIMIZER_SETTING_DEFAULTS:
            if getattr(self, name) is None or self.optimizer in setting_optimizers(name):
                continue
            owners = [f"{OPTIMIZER_NAMES[owner]}'s" for owner in setting_optimizers(name)]
            owners = ", ".join(owners[:-1]) + " and " + owners[-1] if len(owners) > 1 else owners[0]
            own = ", ".join(optimizer_setting_names(self.optimizer))
            problems.append(((name,), f"{name} is {owners}; optimizer {self.optimizer} has none: leave {name} out "
                             f"({self.optimizer} takes {own})"))
        if self.nesterov and self.optimizer == "sgd" and self.optimizer_settings()["momentum"]["value"] == 0:
            problems.append((("nesterov",), "Nesterov momentum needs momentum > 0 (torch.optim.SGD refuses it at momentum 0)"))
        if self.nesterov and self.optimizer == "sgd" and self.dampening:
            problems.append((("dampening",), "Nesterov momentum needs dampening 0 (torch.optim.SGD refuses both): leave dampening out"))
        if problems:
            raise field_errors(problems, "training_field")
        return self

    def optimizer_settings(self) -> dict[str, dict[str, Any]]:
        """The optimizer's settings (OPTIMIZER_SETTING_DEFAULTS), each {"value", "source"}: spec, or assumed (its
        default), what profiling points and the pilot train with; betas as a list."""
        settings = {}
        for name in optimizer_setting_names(self.optimizer):
            given = getattr(self, name)
            value = OPTIMIZER_SETTING_DEFAULTS[name][self.optimizer] if given is None else given
            settings[name] = {"value": list(value) if isinstance(value, tuple) else value, "source": "assumed" if given is None else "spec"}
        return settings

    def sgd_momentum(self) -> dict[str, Any] | None:
        """SGD's momentum with its source (spec or assumed), None for other optimizers: what SGD's LR advice and its
        caveats are for."""
        return self.optimizer_settings()["momentum"] if self.optimizer == "sgd" else None

    @model_validator(mode="after")
    def _max_lr_above_reference(self) -> TrainingSpec:
        if self.max_lr is None:
            return self
        if self.reference_lr is None:
            raise ValueError("max_lr needs reference_lr: the cap is the ratio max_lr / reference_lr")
        if self.max_lr < self.reference_lr:
            raise ValueError(f"max_lr ({self.max_lr:g}) is below reference_lr ({self.reference_lr:g}): the reference run trained stably at its LR")
        return self


class ProfilingSpec(_Strict):
    warmup_iters: int = Field(3, ge=0, le=1000, description="least warm-up iterations (more until time settles)")
    timed_iters: int = Field(10, ge=2, le=100_000, description="least timed iterations")
    target_cv: float = Field(0.03, gt=0, le=1, description="stop sampling once std/mean of iteration time is below")
    target_median_rse: float = Field(0.01, gt=0, le=1, description="or once the median iteration time's relative "
                                     "standard error (sqrt(pi/2) * 1.4826 MAD / (median sqrt(n))) is below")
    time_cap_s: float = Field(5.0, gt=0, le=3600, description="the point's time budget: warm-up, timing, gradient "
                              "statistics and memory passes share it (the least iteration counts may overrun it)")
    grad_microbatches: int = Field(4, ge=2, le=64, description="k: the batch is split in k for the noise scale")
    grad_iters: int = Field(8, ge=0, le=1000, description="most iterations of gradient statistics per point "
                            "(fewer once |G|^2 and tr(Sigma) have settled, or the budget is spent)")
    dtype: Precision = Field("fp32", description="autocast precision")
    channels_last: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    memory_limit_gib: float | None = Field(None, gt=0, description="emulate a device with this much memory")
    search_max_batch: bool = Field(True, description="after an out-of-memory, search the largest batch that fits")
    max_search_probes: int = Field(4, ge=1, le=32)
    measure_comm: bool | None = Field(None, description="all-reduce benchmark; default: when the cluster has > 1 device")
    seed: int = 0
    timeout_s: float = Field(600, gt=0, le=86_400, description="per attempt of a point; then the worker is killed")
    max_attempts: int = Field(
        3, ge=1, le=10, description="starts of a point whose worker dies (signal, timeout) before it is marked failed"
    )
    pilot: bool = Field(
        False, description="a pilot point: train the model at training.reference_batch with the spec's optimizer and "
        "reference_lr, recording gradient statistics along the way (the noise scale grows as the loss falls)"
    )
    pilot_steps: int = Field(300, ge=10, le=100_000, description="the pilot's most optimizer steps")
    pilot_seconds: float = Field(30.0, gt=0, le=3600, description="the pilot's most seconds of training")
    pilot_record_every: int = Field(10, ge=1, le=10_000, description="pilot steps per gradient-statistics record")
    threads: int | None = Field(
        None, ge=1, le=1024, description="torch threads of a CPU point (match the training loop's, e.g. 1)"
    )
    step_placements: list[Annotated[list[Annotated[int, Field(ge=1, le=MAX_GPUS_PER_NODE)]], Field(min_length=1, max_length=MAX_NODES)]] = Field(
        default_factory=list, max_length=8,
        description="placements (GPUs used on each node, e.g. [2] or [2, 2]) of a data-parallel training step to "
        "measure, one point each at a profiled batch, of 2 or more devices: on one node DDP over a worker's GPUs "
        "(gloo ranks on CPU), across nodes Ray actors (the Ray executor); the planner fits the placement model to them",
    )  # fmt: skip

    @field_validator("step_placements")
    @classmethod
    def _distinct_multi_device_placements(cls, placements: list[list[int]]) -> list[list[int]]:
        if any(sum(placement) < 2 for placement in placements):
            raise ValueError("a step placement uses 2 or more devices ([1] is what a compute point measures)")
        return [list(p) for p in sorted({tuple(p) for p in placements})]


# Fields the server sets while validating (where a value came from); a client's are ignored, not trusted.
SERVER_SET_FIELDS = {"cluster": ("device_memory_source", "intra_node_link_source"), "pricing": ("price_source",)}


def _without_server_fields(data: object) -> object:
    """A submitted spec without the server-set `*_source` fields: the server derives them again. A value
    that is not a source at all stays, so that it is a 422 as the schema says."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for part, fields in SERVER_SET_FIELDS.items():
        if isinstance(data.get(part), dict):
            data[part] = {k: v for k, v in data[part].items() if not (k in fields and v in VALUE_SOURCES)}
    return data


class JobSpec(_Strict):
    name: str | None = Field(None, max_length=200)
    model: str = Field(description="model catalog name, or 'package.module:factory' when allowlisted")
    model_options: dict[str, int | float | str | bool] = Field(default_factory=dict)
    initial_weights: str | None = Field(
        None, max_length=4096, description="fine-tuning: a file on the worker's file system, under a data root, written by "
        "torch.save(model.state_dict(), path) for the model this spec builds; profiling points and the pilot start from it "
        "instead of a random init (the pilot's gradient statistics are those of your run's start). Loaded with "
        "torch.load(weights_only=True), strictly (the same keys and shapes; a DDP wrapper's 'module.' prefix is dropped)",
    )  # fmt: skip
    dataset: DatasetSpec
    loss: str | None = Field(
        None, max_length=300, description="the training loss (GET /v1/catalog/losses): cross_entropy, the default (next-token "
        "on token data; mse on diabetes); mse, l1 or bce_with_logits, whose float targets (the model output's shape) diabetes "
        "(not bce_with_logits) or a user dataset gives; or "
        "'package.module:function' when allowlisted, called as function(outputs, targets) -> the batch's mean loss",
    )  # fmt: skip
    batch_sizes: list[BatchSize] = Field(
        description="per-device batch sizes to profile: a list, or {min, max} for the powers of two between"
    )
    cluster: ClusterSpec
    pricing: PricingSpec
    objective: Objective = "knee"
    deadline_h: float | None = Field(None, gt=0, description="objective deadline: the cheapest plan finishing within")
    budget_usd: float | None = Field(None, gt=0, description="objective budget: the fastest plan costing at most")
    training: TrainingSpec
    profiling: ProfilingSpec = ProfilingSpec()
    user_code_check: str | None = Field(
        None, max_length=USER_CODE_NOTE_MAX_CHARS, description="set by the server for a user (package.module:factory) model or dataset: "
        "how it was checked at submission ('passed: ...', 'partly checked: ...', 'skipped: ...'); not checked again once set"
    )

    @model_validator(mode="before")
    @classmethod
    def _catalog_price(cls, data: object) -> object:
        """pricing.price defaults to the catalog price of cluster.gpu_type when billed per GPU-hour."""
        if validating_client_submission():
            data = _without_server_fields(data)
        if not isinstance(data, dict) or not isinstance(data.get("pricing"), dict):
            return data
        pricing, cluster = data["pricing"], data.get("cluster")
        if pricing.get("price") is not None or pricing.get("kind") != "gpu_hour":
            return data
        gpu_type = cluster.get("gpu_type") if isinstance(cluster, dict) else getattr(cluster, "gpu_type", None)
        entry = load_gpus().get(gpu_type) if isinstance(gpu_type, str) else None
        if entry is None:
            return data
        priced = {**pricing, "price": entry.default_price_usd_per_hour, "price_source": CATALOG_SOURCE}
        return {**data, "pricing": priced}

    @field_validator("model")
    @classmethod
    def _known_or_allowed_model(cls, name: str, info: ValidationInfo) -> str:
        if not is_user_model_ref(name):
            return in_catalog("model", name, MODELS)
        if not _server_decided(info) and not user_model_allowed(name, allowed_model_modules()):
            raise ValueError(not_allowlisted_message("model", name))
        return name

    _weights_under_a_data_root = field_validator("initial_weights")(_under_a_data_root)

    @field_validator("loss")
    @classmethod
    def _known_or_allowed_loss(cls, name: str | None, info: ValidationInfo) -> str | None:
        if name is None or not is_user_ref(name):
            return None if name is None else in_catalog("loss", name, LOSSES)
        if not _server_decided(info) and not user_model_allowed(name, allowed_model_modules()):
            raise ValueError(not_allowlisted_message("loss", name))
        return name

    @model_validator(mode="after")
    def _loss_fits_dataset(self) -> JobSpec:
        problem = loss_problem(self.loss, self.dataset.name)
        if problem:
            raise field_errors([(("loss",), problem)], "loss_dataset")
        return self

    @model_validator(mode="after")
    def _catalog_price_has_a_gpu(self) -> JobSpec:
        if self.pricing.price_source == CATALOG_SOURCE and self.cluster.gpu_type is None:
            raise ValueError("a 'catalog-assumed' pricing.price needs the cluster.gpu_type it was taken from")
        return self

    @model_validator(mode="after")
    def _constraint_given(self) -> JobSpec:
        if self.objective == "deadline" and self.deadline_h is None:
            raise ValueError("objective 'deadline' needs deadline_h (hours)")
        if self.objective == "budget" and self.budget_usd is None:
            raise ValueError("objective 'budget' needs budget_usd")
        return self

    @model_validator(mode="after")
    def _step_placements_fit_the_cluster(self) -> JobSpec:
        cluster = self.cluster
        for index, placement in enumerate(self.profiling.step_placements):
            if len(placement) > cluster.nodes or max(placement) > cluster.gpus_per_node:
                raise field_errors([(("profiling", "step_placements", index), (
                    f"placement {placement} does not fit the cluster's {cluster.nodes} nodes of {cluster.gpus_per_node} GPUs"
                ))], "step_placement")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _model_fits_dataset(self) -> JobSpec:
        if is_user_model_ref(self.model):
            return self
        try:
            resolved_model_options(self.model, self.model_options)
        except ValueError as error:
            raise field_errors([(("model_options",), str(error))], "model_option") from None
        if not compatible(self.model, self.dataset.name):
            raise ValueError(
                f"model '{self.model}' takes {MODELS[self.model].input_kind} inputs but dataset "
                f"'{self.dataset.name}' gives {DATASETS[self.dataset.name].input_kind}"
            )
        problem = image_size_problem(self.model, self.dataset.image_size) if self.dataset.image_size else None
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _sizes_within_bounds(self, info: ValidationInfo) -> JobSpec:
        """The bounds of tula_service.spec.spec_limits that need two fields: devices (the server's bound, not a
        client's to apply: CLIENT_SIDE), and batches against D."""
        problems: list[tuple[tuple[str | int, ...], str]] = []
        devices, limit = self.cluster.total_devices, max_devices()
        if devices > limit and not _client_side(info):
            problems.append((("cluster",), (
                f"{self.cluster.nodes} nodes x {self.cluster.gpus_per_node} GPUs = {devices} devices: more than the "
                f"{limit} this server plans for (the operator can raise it with TULA_MAX_DEVICES)"
            )))
        samples = self.dataset.num_samples
        if samples is not None:
            largest = max(self.batch_sizes)
            if largest > samples:
                problems.append((("batch_sizes",), f"batch {largest} is larger than the dataset ({samples} samples per epoch)"))
            if self.training.reference_batch > samples:
                problems.append((("training", "reference_batch"), (
                    f"reference batch {self.training.reference_batch} is larger than the dataset ({samples} samples per epoch)"
                )))
            for index, run in enumerate(self.training.other_runs):
                if run.batch > samples:
                    problems.append((("training", "other_runs", index, "batch"),
                                     f"batch {run.batch} is larger than the dataset ({samples} samples per epoch)"))
        if problems:
            raise field_errors(problems, "out_of_bounds")
        return self

    @model_validator(mode="after")
    def _user_code_meets_the_contract(self, info: ValidationInfo) -> JobSpec:
        if _server_decided(info):  # checked at submission (user_code_check says how), or the server's to check
            return self
        return check_user_code(self, allowed_model_modules())  # a child process; catalog-only specs skip it

    @classmethod
    def stored(cls, data: dict[str, object]) -> JobSpec:
        """A spec the server accepted before, parsed again (see STORED): its shape and the rules between
        its fields are checked, the allowlist and data-root decisions of its submission are kept."""
        return cls.model_validate(data, context={STORED: True})

    @classmethod
    def checked_by_client(cls, data: dict[str, object]) -> JobSpec:
        """A spec a client is about to send, checked without the server's policy (see CLIENT_SIDE): a mistake in
        the spec itself is named before anything is sent, and what only the server can decide is left to it."""
        return cls.model_validate(data, context={CLIENT_SIDE: True})

    def measures_communication(self) -> bool:
        if self.profiling.measure_comm is None:
            return self.cluster.total_devices > 1
        return self.profiling.measure_comm

    @field_validator("batch_sizes", mode="before")
    @classmethod
    def _range_shorthand(cls, value: object) -> object:
        return _expand_batch_range(value)

    @field_validator("batch_sizes")
    @classmethod
    def _enough_batches(cls, batch_sizes: list[int], info: ValidationInfo) -> list[int]:
        if len(set(batch_sizes)) < 2:
            raise ValueError("profile at least 2 distinct batch sizes: the memory and time models are lines")
        limit = max_batch_sizes()
        if len(set(batch_sizes)) > limit and not _client_side(info):  # the server's bound (CLIENT_SIDE)
            raise ValueError(
                f"{len(set(batch_sizes))} batch sizes: a job profiles at most {limit} (each is a profiling point); "
                "a few per power of two is enough, and the server operator can raise the limit with TULA_MAX_BATCH_SIZES"
            )
        return sorted(set(batch_sizes))

