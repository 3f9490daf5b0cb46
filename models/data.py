"""Datasets by catalog name (torch side). Generated, bundled in a package, or read from a worker path;
nothing is downloaded. Or a user dataset "package.module:factory" (models.user_contract). Every dataset
is a `BatchSource`."""

from __future__ import annotations

from typing import Protocol

import torch

from models.data_roots import resolve_confined
from models.datasets_bundled import Diabetes, Digits, MNIST1D
from models.datasets_files import ImageFolderSource, TokenFile
from models.datasets_synthetic import SyntheticImages, SyntheticTokens
from models.registry import DATASETS, is_user_ref, unknown_name_message
from models.user_contract import build_user_dataset


class BatchSource(Protocol):
    input_kind: str  # "image" | "signal1d" | "tokens"

    @property
    def shape(self) -> dict[str, int]:
        """What a model factory needs to fit this data (see `models.zoo`)."""

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) on the CPU, a deterministic function of the generator's state."""


def dataset_fields(name: str, given: dict[str, object]) -> dict[str, object]:
    """The dataset's fields with the catalog defaults filled in; unknown or missing-required fields are errors."""
    info = DATASETS[name]
    unknown = sorted(set(given) - set(info.fields))
    if unknown:
        accepted = ", ".join(sorted(info.fields)) or "none"
        raise ValueError(f"fields {unknown} do not apply to dataset '{name}' (it takes: {accepted})")
    missing = [field for field in info.required if given.get(field) is None]
    if missing:
        raise ValueError(f"dataset '{name}' needs the field(s) {', '.join(missing)}")
    filled = {field: default for field, default in info.fields.items() if default is not None}
    return {**filled, **{field: value for field, value in given.items() if value is not None}}


def build_dataset(
    name: str,
    *,
    seed: int = 0,
    num_samples: int | None = None,
    allowed_modules: list[str] | None = None,
    data_roots: list[str] | None = None,
    loss: str | None = None,
    **fields: object,
) -> BatchSource:
    """A dataset by catalog name, e.g. `build_dataset("synthetic_images", channels=3, image_size=32, num_classes=10)`,
    or by "package.module:factory" when that module is under one of `allowed_modules`.

    `seed` fixes generated structure (teachers, Markov chains); `num_samples` is how many samples mnist1d
    generates; a user factory receives both when its signature names them. With `data_roots` (the
    profiling worker always gives them), a file dataset's path must resolve under one of them
    (`models.data_roots`); None is a direct call on one's own machine, not confined. `loss` (the spec's): the
    targets a user dataset's first batch is checked for (models.user_contract.batch_problem).
    """
    if data_roots is not None and fields.get("path") is not None:
        fields["path"] = str(resolve_confined(str(fields["path"]), data_roots))
    if is_user_ref(name):
        return build_user_dataset(name, allowed_prefixes=list(allowed_modules or []), num_samples=num_samples, seed=seed, loss=loss, **fields)
    if name not in DATASETS:
        raise KeyError(unknown_name_message("dataset", name, DATASETS))
    fields = dataset_fields(name, fields)
    if name == "synthetic_images":
        return SyntheticImages(**fields, seed=seed)
    if name == "synthetic_tokens":
        return SyntheticTokens(**fields, seed=seed)
    if name == "digits":
        return Digits(**fields)
    if name == "diabetes":
        return Diabetes(**fields)
    if name == "mnist1d":
        return MNIST1D(num_samples=num_samples)
    if name == "image_folder":
        return ImageFolderSource(**fields)
    if name == "token_file":
        return TokenFile(**fields)
    raise KeyError(f"dataset '{name}' is in the catalog but has no builder on this worker")
