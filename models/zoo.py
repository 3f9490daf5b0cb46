"""Model factories by catalog name (torch side; random init, nothing downloaded)."""

from __future__ import annotations

import torch
from torch import nn

from models.registry import MODELS, unknown_name_message


class SmallCNN(nn.Module):
    """conv(32) -> pool -> conv(64) -> pool -> linear: a CIFAR-sized workload that profiles in seconds."""

    def __init__(self, in_channels: int, image_size: int, num_classes: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        side = image_size // 4
        self.head = nn.Linear(64 * side * side, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(images), 1))


def _resnet18(in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    from torchvision.models import resnet18

    model = resnet18(weights=None, num_classes=num_classes)
    if in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


_FACTORIES = {
    "small_cnn": SmallCNN,
    "resnet18": _resnet18,
}


def build_model(name: str, *, in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    if name not in _FACTORIES:
        raise KeyError(unknown_name_message("model", name, MODELS))
    return _FACTORIES[name](in_channels, image_size, num_classes)
