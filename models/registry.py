"""The workload catalog as plain data: names, descriptions and defaults.

This module never imports torch, so the server can validate job specs against the catalog
without the worker extras installed. The torch factories live in `models.zoo` and `models.data`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    name: str
    description: str
    input_kind: str  # what the model consumes; "image" = (channels, size, size) tensors


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    description: str
    input_kind: str


MODELS: dict[str, ModelInfo] = {
    info.name: info
    for info in (
        ModelInfo(
            "small_cnn",
            "Two conv blocks and a linear head for small (e.g. 32x32) images; ~0.3M parameters.",
            "image",
        ),
        ModelInfo(
            "resnet18",
            "torchvision ResNet-18, random init (no weights downloaded), any input size >= 32.",
            "image",
        ),
    )
}

DATASETS: dict[str, DatasetInfo] = {
    info.name: info
    for info in (
        DatasetInfo(
            "synthetic_images",
            "Gaussian images with labels from a fixed random teacher (learnable, generated, no download);"
            " shape from the spec: channels, image_size, num_classes.",
            "image",
        ),
    )
}


def unknown_name_message(kind: str, name: str, known: dict[str, object]) -> str:
    """The error a user can act on: what was asked for and what exists."""
    return f"{kind} '{name}' is not in the catalog; known: {', '.join(sorted(known))}"
