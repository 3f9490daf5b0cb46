"""User code for the tests, importable as "tests.user_models_fixture:NAME" (docs/user_models.md): models and
datasets that keep the contract of models.user_contract, and some that break it in one way each."""

import time

import torch
from torch import nn


def tiny_classifier(*, in_channels: int, image_size: int, num_classes: int, hidden: int = 8) -> nn.Module:
    """Flatten -> linear(hidden) -> ReLU -> linear(classes); records the arguments it was built with."""
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(in_channels * image_size * image_size, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
    )
    model.built_with = {"in_channels": in_channels, "image_size": image_size, "num_classes": num_classes, "hidden": hidden}
    return model


def overflowing_classifier(*, in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    """tiny_classifier with its logits scaled by 1e38: the loss and every gradient overflow, as an fp16 step or a
    diverging model's do; the point is still timed and sized."""
    model = tiny_classifier(in_channels=in_channels, image_size=image_size, num_classes=num_classes)
    return nn.Sequential(model, _Scale(1e38))


class _Scale(nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def not_a_model(**shape):
    return "a string"


def needs_width(*, width: int) -> nn.Module:
    """Breaks the contract: it does not take the dataset's shape (in_channels, image_size, num_classes)."""
    return nn.Linear(width, 2)


def one_logit_too_many(*, in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    """Breaks the contract: its output is (batch, num_classes + 1)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size * image_size, num_classes + 1))


class Blobs:
    """A batch source: num_classes Gaussian blobs of images, the class mean a fixed random image."""

    input_kind = "image"

    def __init__(self, *, num_samples: int, image_size: int = 8, num_classes: int = 3, seed: int = 0):
        self.image_size, self.num_classes, self.num_samples = image_size, num_classes, num_samples
        self.means = torch.randn(num_classes, 1, image_size, image_size, generator=torch.Generator().manual_seed(seed))

    @property
    def shape(self) -> dict[str, int]:
        return {"in_channels": 1, "image_size": self.image_size, "num_classes": self.num_classes}

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, self.num_classes, (batch_size,), generator=generator)
        noise = torch.randn(batch_size, 1, self.image_size, self.image_size, generator=generator)
        return self.means[labels] + 0.5 * noise, labels


def blob_images(*, num_samples: int, image_size: int = 8, num_classes: int = 3, seed: int = 0) -> Blobs:
    return Blobs(num_samples=num_samples, image_size=image_size, num_classes=num_classes, seed=seed)


def signal_pairs(*, num_samples: int, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """A (inputs, targets) pair: `num_samples` float signals of `length`, labelled by the sign of their mean."""
    signals = torch.randn(num_samples, length, generator=torch.Generator().manual_seed(1))
    return signals, (signals.mean(dim=1) > 0).long()


def token_pairs(*, num_samples: int, seq_len: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """A (inputs, targets) pair of token ids: the sequences count up modulo 50, targets shifted by one."""
    starts = torch.randint(0, 50, (num_samples, 1), generator=torch.Generator().manual_seed(2))
    windows = (starts + torch.arange(seq_len + 1)) % 50
    return windows[:, :-1], windows[:, 1:]


class _WrongWidth(Blobs):
    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = super().batch(batch_size, generator)
        return images[..., :-1], labels  # one column short of the image_size its shape states


def wrong_batch_shape(*, num_samples: int, image_size: int = 8) -> Blobs:
    """Breaks the contract: its batches are (B, 1, image_size, image_size - 1)."""
    return _WrongWidth(num_samples=num_samples, image_size=image_size)


def needs_radius(*, num_samples: int, radius: float) -> Blobs:
    """Keeps the contract when the spec gives dataset.options.radius."""
    return Blobs(num_samples=num_samples)


def slow_dataset(*, num_samples: int) -> Blobs:
    """Takes a minute to build: longer than the submit-time check waits."""
    time.sleep(60)
    return Blobs(num_samples=num_samples)


def sleepy_dataset(*, num_samples: int) -> Blobs:
    """Takes 3 s to build: the submit-time check is busy that long."""
    time.sleep(3)
    return Blobs(num_samples=num_samples)


def regression_signals(*, num_samples: int, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression pair: float signals of `length` and a float target (N,) per signal, a fixed linear function of it
    plus noise (served as (N, 1): one output)."""
    generator = torch.Generator().manual_seed(3)
    signals = torch.randn(num_samples, length, generator=generator)
    weights = torch.randn(length, generator=generator)
    return signals, signals @ weights + 0.1 * torch.randn(num_samples, generator=generator)


def multi_label_signals(*, num_samples: int, length: int = 12, labels: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """A multi-label pair: float signals and (N, labels) targets in {0, 1} (the sign of a fixed projection each)."""
    generator = torch.Generator().manual_seed(4)
    signals = torch.randn(num_samples, length, generator=generator)
    return signals, (signals @ torch.randn(length, labels, generator=generator) > 0).float()


def huber_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A user loss: Huber (smooth L1 with delta 1), the mean over the batch."""
    return torch.nn.functional.huber_loss(outputs, targets)


def summed_squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Breaks the contract: the squared error summed over the batch, not its mean."""
    return ((outputs - targets) ** 2).sum()


def per_sample_squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Breaks the contract: one loss per sample (reduction='none'), not the batch's mean."""
    return ((outputs - targets) ** 2).mean(dim=1)
