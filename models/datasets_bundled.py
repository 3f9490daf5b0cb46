"""Real data that ships inside a package: scikit-learn's digits and diabetes, and MNIST-1D from its own generator.

Batches draw sample indices uniformly with replacement from the given torch.Generator.
"""

from __future__ import annotations

import functools
import random

import numpy as np
import torch
import torch.nn.functional as F

from models.registry import DIABETES_SPLIT_SIZES, MNIST1D_MAX_SAMPLES

DIGITS_SIDE_PX = 8
DIGITS_MAX_PIXEL = 16.0  # load_digits gives pixel values 0..16
SPLIT_SEED = 0  # random_state of the train/test split (digits, diabetes)
SPLIT_TEST_FRACTION = 0.2
DIGITS_SCALINGS = ("unit", "standard", "raw")
DIGITS_SPLITS = ("train", "all")
MNIST1D_LENGTH = 40
MNIST1D_CLASSES = 10
MNIST1D_DEFAULT_SAMPLES = 5000  # the reference data set's size, when num_samples is not given
MNIST1D_SEED = 42  # the reference data set's generator seed


def split_index(total: int, split: str) -> torch.Tensor:
    """Indices of a split of `total` samples: "train", the train part of scikit-learn's `train_test_split(...,
    test_size=0.2, random_state=0)` (shuffled, not stratified), in its order, as a user's script splits them; "all":
    0..total-1."""
    from sklearn.model_selection import train_test_split

    if split == "all":
        return torch.arange(total)
    train_index, _ = train_test_split(np.arange(total), test_size=SPLIT_TEST_FRACTION, random_state=SPLIT_SEED)
    return torch.from_numpy(train_index)


class Digits:
    """scikit-learn's `load_digits` (UCI optical digits, 1797 8x8 images with pixels 0..16, 10 classes) as a
    training run sees them.

    split "train" (default): the 1437 images of `split_index` (the held-out 360 are never served);
    "all": the 1797. scaling "unit" (default): X / 16, pixels in [0, 1]; "standard": (X - mean) / std with
    the scalar mean and std of the split's pixels; "raw": X as load_digits gives it. Resized (bilinear,
    antialiased) to image_size."""

    input_kind = "image"
    num_classes = 10

    def __init__(self, *, image_size: int = DIGITS_SIDE_PX, scaling: str = "unit", split: str = "train"):
        from sklearn.datasets import load_digits

        if scaling not in DIGITS_SCALINGS:
            raise ValueError(f"digits scaling '{scaling}' is not one of {', '.join(DIGITS_SCALINGS)}")
        if split not in DIGITS_SPLITS:
            raise ValueError(f"digits split '{split}' is not one of {', '.join(DIGITS_SPLITS)}")
        digits = load_digits()
        index = split_index(len(digits.target), split)
        images = torch.from_numpy(digits.images).float().unsqueeze(1)[index]
        if scaling == "unit":
            images = images / DIGITS_MAX_PIXEL
        elif scaling == "standard":
            images = (images - images.mean()) / images.std()
        self.images = images
        self.labels = torch.from_numpy(digits.target).long()[index]
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
def generate_mnist1d(num_samples: int, seed: int = MNIST1D_SEED, **generator_args: float) -> tuple[np.ndarray, np.ndarray]:
    """(signals (n, 40) float32, labels (n,) int64) from `mnist1d.data.make_dataset` with its default
    arguments but `num_samples`, `seed`, `generator_args` (e.g. corr_noise_scale) and no train/test split. Only the
    generator is called: never `get_dataset`, which may download. The global numpy/random state it reseeds is restored."""
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    for name, value in generator_args.items():
        if not hasattr(args, name):
            raise TypeError(f"mnist1d's generator has no argument '{name}'")
        setattr(args, name, value)
    args.num_samples, args.train_split, args.seed = num_samples, 1.0, seed
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        generated = make_dataset(args)
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)
    return generated["x"].astype(np.float32), generated["y"].astype(np.int64)


class Diabetes:
    """scikit-learn's `load_diabetes` (Efron et al. 2004, "Least Angle Regression": 442 patients, 10 baseline
    measurements, a quantitative measure of disease progression one year later) as a regression run sees it.

    split "train" (default): the 353 patients of `split_index` (the held-out 89 are never served); "all": the 442.
    The measurements (load_diabetes(scaled=False)) and the target are standardized with the mean and std of the split
    (what StandardScaler fitted on the training data does): inputs float (B, 10), targets float (B, 1)."""

    input_kind = "signal1d"
    outputs = 1

    def __init__(self, *, split: str = "train"):
        from sklearn.datasets import load_diabetes

        if split not in DIABETES_SPLIT_SIZES:
            raise ValueError(f"diabetes split '{split}' is not one of {', '.join(DIABETES_SPLIT_SIZES)}")
        data = load_diabetes(scaled=False)
        index = split_index(len(data.target), split)
        features = torch.from_numpy(data.data).float()[index]
        target = torch.from_numpy(data.target).float()[index]
        self.inputs = (features - features.mean(dim=0)) / features.std(dim=0)
        self.targets = ((target - target.mean()) / target.std()).unsqueeze(1)

    @property
    def shape(self) -> dict[str, int]:
        return {"length": self.inputs.shape[1], "num_classes": self.outputs}

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.randint(0, len(self.targets), (batch_size,), generator=generator)
        return self.inputs[index], self.targets[index]


class MNIST1D:
    """MNIST-1D (Greydanus 2020): ten 1D digit templates, randomly padded, translated, scaled, sheared and
    noised into length-40 signals. num_samples of them (default 5000, the reference set's size; at most
    MNIST1D_MAX_SAMPLES) are generated once per process, rounded up to a multiple of 10 (the generator makes
    the same number per class); generating takes ~0.3 ms per sample on one idle core (50 000 in ~17 s)."""

    input_kind = "signal1d"

    def __init__(self, *, num_samples: int | None = None):
        wanted = num_samples or MNIST1D_DEFAULT_SAMPLES
        if wanted > MNIST1D_MAX_SAMPLES:
            raise ValueError(
                f"mnist1d generates at most {MNIST1D_MAX_SAMPLES} samples (asked for {wanted}): each profiling "
                "point generates them again, at ~0.3 ms per sample"
            )
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
