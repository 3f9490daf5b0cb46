"""Image classifiers: our small CIFAR-sized models and torchvision's catalog (random init, nothing downloaded).

Every factory takes `in_channels`, `image_size` and `num_classes` (the shape a dataset gives).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from models.registry import image_size_problem, vit_patch_size


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


def resnet18_cifar(in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    """ResNet-18 with the CIFAR stem of He et al. 2016 (sec. 4.2): 3x3 stride-1 first conv, no max-pool."""
    from torchvision.models import resnet18

    model = resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # torchvision's ResNet init
    model.maxpool = nn.Identity()
    return model


class BasicBlock(nn.Module):
    """Two 3x3 convs with batch norm and an identity shortcut, or a 1x1 conv + BN projection where the block
    changes the width or the stride (He et al. 2016, "Deep Residual Learning", Fig. 2 and option B)."""

    def __init__(self, in_channels: int, channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, channels, kernel_size=1, stride=stride, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


RESNET_CIFAR_WIDTHS = (16, 32, 64)  # channels of the three stages; stages 2 and 3 halve the side


class ResNetCifar(nn.Module):
    """The CIFAR ResNet of He et al. 2016 (sec. 4.2): a 3x3 conv of 16 channels, three stages of `blocks`
    basic blocks at 16, 32 and 64 channels (stride 2 into stages 2 and 3), global average pool, linear head:
    6 blocks + 2 layers deep (blocks=1: ResNet-8, 78k parameters; 3: ResNet-20, 0.27M). Batch norm after every
    conv, so a step's statistics depend on the batch (or the micro-batch) a forward pass sees."""

    def __init__(self, in_channels: int, image_size: int, num_classes: int, blocks: int = 1):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, RESNET_CIFAR_WIDTHS[0], kernel_size=3, padding=1, bias=False),
                                  nn.BatchNorm2d(RESNET_CIFAR_WIDTHS[0]), nn.ReLU())  # fmt: skip
        layers: list[nn.Module] = []
        channels = RESNET_CIFAR_WIDTHS[0]
        for stage, width in enumerate(RESNET_CIFAR_WIDTHS):
            for block in range(blocks):
                layers.append(BasicBlock(channels, width, stride=2 if stage and not block else 1))
                channels = width
        self.stages = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.stages(self.stem(images))), 1))


VGG11_CHANNELS = (64, "pool", 128, "pool", 256, 256, "pool", 512, 512, "pool", 512, 512, "pool")  # config "A"


class VGG11Cifar(nn.Module):
    """VGG-11 (Simonyan & Zisserman 2015, config A) with batch norm; global average pool and one linear layer
    replace the 4096-wide classifier, the usual CIFAR variant (needs image_size >= 32: five 2x pools)."""

    def __init__(self, in_channels: int, image_size: int, num_classes: int):
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for item in VGG11_CHANNELS:
            if item == "pool":
                layers.append(nn.MaxPool2d(2))
                continue
            layers += [nn.Conv2d(channels, item, kernel_size=3, padding=1), nn.BatchNorm2d(item), nn.ReLU(inplace=True)]
            channels = item
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.features(images)), 1))


def adapt_first_conv(model: nn.Module, in_channels: int) -> nn.Module:
    """Give the model's first Conv2d `in_channels` inputs, keeping its initialization's scale.

    The new kernel tiles the old one along the input-channel axis and scales it by sqrt(3 / in_channels),
    so for independent unit-variance inputs the output variance stays that of the 3-channel init
    (fan-in scaling, He et al. 2015), whatever init the architecture chose.
    """
    name, conv = next((n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d))
    if conv.in_channels == in_channels:
        return model
    if conv.groups != 1:
        raise ValueError(f"cannot change the input channels of grouped first conv '{name}'")
    replacement = nn.Conv2d(
        in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
        bias=conv.bias is not None, padding_mode=conv.padding_mode,
    )  # fmt: skip
    repeats = math.ceil(in_channels / conv.in_channels)
    with torch.no_grad():
        tiled = conv.weight.repeat(1, repeats, 1, 1)[:, :in_channels]
        replacement.weight.copy_(tiled * math.sqrt(conv.in_channels / in_channels))
        if conv.bias is not None:
            replacement.bias.copy_(conv.bias)
    parent_name, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attribute, replacement)
    return model


def torchvision_classifier(name: str, in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    """A torchvision classification model by name, `weights=None`, sized for the dataset."""
    import torchvision

    problem = image_size_problem(name, image_size)
    if problem:
        raise ValueError(problem)
    config: dict[str, object] = {"num_classes": num_classes}
    if vit_patch_size(name):
        config["image_size"] = image_size  # ViT's position embedding is sized for a fixed number of patches
    if name in ("googlenet", "inception_v3"):
        config.update(aux_logits=False, init_weights=True)  # a plain logits tensor in training mode too
    model = torchvision.models.get_model(name, weights=None, **config)
    return adapt_first_conv(model, in_channels)
