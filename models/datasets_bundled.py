"""Real data that ships inside a package: scikit-learn's digits, and MNIST-1D from its own generator.

Batches draw sample indices uniformly with replacement from the given torch.Generator.
"""

from __future__ import annotations

import functools
import random

import numpy as np
import torch
import torch.nn.functional as F

DIGITS_SIDE_PX = 8
MNIST1D_LENGTH = 40
MNIST1D_CLASSES = 10
MNIST1D_MAX_GENERATED = 5000  # the reference data set's size; ~1 s to generate on one core
MNIST1D_SEED = 42  # the reference data set's generator seed


class Digits:
    """scikit-learn's `load_digits` (UCI optical digits, 1797 8x8 images with pixels 0..16, 10 classes),
    standardized with the data set's pixel mean and std, resized (bilinear, antialiased) to image_size."""

    input_kind = "image"
    num_classes = 10

    def __init__(self, *, image_size: int = DIGITS_SIDE_PX):
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.from_numpy(digits.images).float().unsqueeze(1)
        self.images = (images - images.mean()) / images.std()
        self.labels = torch.from_numpy(digits.target).long()
        self.image_size = image_size

    @property
    def shape(self) -> dict[str, int]:
        return {"in_channels": 1, "image_size": self.image_size, "num_classes": self.num_classes}

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.randint(0, len(self.labels), (batch_size,), generator=generator)
        images = self.images[index]
        if self.image_size != DIGITS_SIDE_PX:
            images = F.interpolate(images, size=(self.image_size,) * 2, mode="bilinear", antialias=True, align_corners=False)
        return images, self.labels[index]


@functools.lru_cache(maxsize=4)
def generate_mnist1d(num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(signals (n, 40) float32, labels (n,) int64) from `mnist1d.data.make_dataset` with its default
    arguments but `num_samples` and no train/test split. Only the generator is called: never
    `get_dataset`, which may download. The global numpy/random state it reseeds is restored."""
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.train_split, args.seed = num_samples, 1.0, MNIST1D_SEED
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        generated = make_dataset(args)
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)
    return generated["x"].astype(np.float32), generated["y"].astype(np.int64)


class MNIST1D:
    """MNIST-1D (Greydanus 2020): ten 1D digit templates, randomly padded, translated, scaled, sheared and
    noised into length-40 signals. min(num_samples, 5000) samples are generated once per process, rounded
    up to a multiple of 10 (the generator makes the same number per class)."""

    input_kind = "signal1d"

    def __init__(self, *, num_samples: int | None = None):
        wanted = min(num_samples or MNIST1D_MAX_GENERATED, MNIST1D_MAX_GENERATED)
        per_class = -(-wanted // MNIST1D_CLASSES)
        signals, labels = generate_mnist1d(per_class * MNIST1D_CLASSES)
        self.signals = torch.from_numpy(signals)
        self.labels = torch.from_numpy(labels)

    @property
    def shape(self) -> dict[str, int]:
        return {"length": MNIST1D_LENGTH, "num_classes": MNIST1D_CLASSES}

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.randint(0, len(self.labels), (batch_size,), generator=generator)
        return self.signals[index], self.labels[index]
