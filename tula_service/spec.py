"""The job spec: what a user asks Tula to optimize (pydantic v2; also accepted as YAML/JSON by the CLI)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator

from models.registry import DATASETS, MODELS, unknown_name_message


def in_catalog(kind: str, name: str, catalog: dict[str, object]) -> str:
    if name not in catalog:
        raise ValueError(unknown_name_message(kind, name, catalog))
    return name


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DatasetSpec(_Strict):
    name: str = Field(description="dataset catalog name")
    num_samples: PositiveInt = Field(description="training-set size D: samples per epoch")
    channels: int = Field(3, ge=1, le=16)
    image_size: int = Field(32, ge=8, le=1024, description="square image side in pixels")
    num_classes: int = Field(10, ge=2, le=100_000)

    _known_dataset = field_validator("name")(lambda name: in_catalog("dataset", name, DATASETS))


def powers_of_two_between(low: int, high: int) -> list[int]:
    """Powers of two in [low, high], plus both ends, sorted."""
    values, batch = {low, high}, 1
    while batch <= high:
        if batch >= low:
            values.add(batch)
        batch *= 2
    return sorted(values)


def _expand_batch_range(value: object) -> object:
    """Accept `{min, max}` as shorthand for the powers of two between them."""
    if not isinstance(value, dict):
        return value
    if set(value) != {"min", "max"}:
        raise ValueError("a batch range is {min, max}; or give a list of batch sizes")
    low, high = value["min"], value["max"]
    if not all(isinstance(v, int) and v >= 1 for v in (low, high)):
        raise ValueError("batch range min and max must be integers >= 1")
    if low > high:
        raise ValueError(f"batch range min ({low}) must be <= max ({high})")
    return powers_of_two_between(low, high)


class ClusterSpec(_Strict):
    nodes: PositiveInt = 1
    gpus_per_node: PositiveInt = 1
    device_memory_gib: float = Field(gt=0, description="memory per device in GiB")
    interconnect_gbps: float = Field(gt=0, description="all-reduce link bandwidth in Gbit/s")

    @property
    def total_devices(self) -> int:
        return self.nodes * self.gpus_per_node


class PricingSpec(_Strict):
    kind: Literal["gpu_hour", "memory_gb_hour"]
    price: float = Field(gt=0, description="USD per GPU-hour, or per GB-hour of device memory used")


class TrainingSpec(_Strict):
    reference_batch: PositiveInt = Field(description="global batch of the user's reference run")
    reference_epochs: float = Field(gt=0, description="epochs the reference run needs to reach its target")


class ProfilingSpec(_Strict):
    warmup_iters: int = Field(3, ge=0, le=100)
    timed_iters: int = Field(10, ge=2, le=1000)
    grad_draws: int = Field(4, ge=2, le=64, description="independent batches for |g_b|^2 at init")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    timeout_s: float = Field(600, gt=0, le=86_400, description="per point, then the point fails")


class JobSpec(_Strict):
    name: str | None = Field(None, max_length=200)
    model: str = Field(description="model catalog name")
    dataset: DatasetSpec
    batch_sizes: list[PositiveInt] = Field(
        description="per-device batch sizes to profile: a list, or {min, max} for the powers of two between"
    )
    cluster: ClusterSpec
    pricing: PricingSpec
    objective: Literal["knee", "min_time", "min_cost"] = "knee"
    training: TrainingSpec
    profiling: ProfilingSpec = ProfilingSpec()

    _known_model = field_validator("model")(lambda name: in_catalog("model", name, MODELS))

    @field_validator("batch_sizes", mode="before")
    @classmethod
    def _range_shorthand(cls, value: object) -> object:
        return _expand_batch_range(value)

    @field_validator("batch_sizes")
    @classmethod
    def _enough_batches(cls, batch_sizes: list[int]) -> list[int]:
        if len(set(batch_sizes)) < 2:
            raise ValueError("profile at least 2 distinct batch sizes: the memory and time models are lines")
        return sorted(set(batch_sizes))
