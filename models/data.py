"""Datasets by catalog name (torch side). Generated on the fly; nothing is downloaded.

`synthetic_images`: x ~ N(0, 1) of shape (channels, size, size); the label is the argmax of a fixed
random linear "teacher" applied to the 4x4 average-pooled image, so the task is learnable and the
gradient has a real signal component (the noise scale is finite), not pure label noise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.registry import DATASETS, unknown_name_message


class SyntheticImages:
    def __init__(self, *, channels: int, image_size: int, num_classes: int, seed: int = 0):
        self.channels = channels
        self.image_size = image_size
        self.num_classes = num_classes
        teacher_gen = torch.Generator().manual_seed(10_000 + seed)
        self._teacher = torch.randn(num_classes, channels * 16, generator=teacher_gen)

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.randn(
            batch_size, self.channels, self.image_size, self.image_size, generator=generator
        )
        pooled = F.adaptive_avg_pool2d(images, 4).flatten(1)
        labels = (pooled @ self._teacher.T).argmax(dim=1)
        return images, labels


def build_dataset(name: str, *, channels: int, image_size: int, num_classes: int, seed: int = 0):
    if name not in DATASETS:
        raise KeyError(unknown_name_message("dataset", name, DATASETS))
    return SyntheticImages(channels=channels, image_size=image_size, num_classes=num_classes, seed=seed)
