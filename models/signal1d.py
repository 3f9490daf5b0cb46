"""Classifiers for 1D signals of shape (batch, length), the MNIST-1D baselines (Greydanus 2020, sec. 3: an MLP, a
CNN and a GRU), multinomial logistic regression (a linear model: a convex loss), and a transformer encoder over
patches of the signal (the vision transformer's recipe, Dosovitskiy et al. 2021, in one dimension).

Every factory takes `length` and `num_classes` (the shape a dataset gives) plus its own options.
"""

from __future__ import annotations

import torch
from torch import nn


class Linear1d(nn.Module):
    """Multinomial logistic regression: length -> classes, one affine map whose softmax cross-entropy is convex in
    the weights (the setting in which McCandlish et al. 2018, sec. 2, derive the noise scale from a quadratic loss)."""

    def __init__(self, length: int, num_classes: int):
        super().__init__()
        self.linear = nn.Linear(length, num_classes)

    def forward(self, signals: torch.Tensor) -> torch.Tensor:
        return self.linear(signals)


class MLP1d(nn.Module):
    """length -> hidden -> hidden -> classes with ReLU (the paper's MLP baseline has hidden = 100, no dropout), and
    `dropout` after each hidden ReLU (Srivastava et al. 2014: each unit zeroed with that probability in training, the
    rest scaled by 1 / (1 - p); nothing in eval mode)."""

    def __init__(self, length: int, num_classes: int, hidden: int = 100, dropout: float = 0.0):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(length, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, signals: torch.Tensor) -> torch.Tensor:
        return self.layers(signals)


def _strided_length(length: int, kernel: int, stride: int = 2, padding: int = 1) -> int:
    """Output length of a Conv1d: floor((L + 2p - k) / s) + 1."""
    return (length + 2 * padding - kernel) // stride + 1


class CNN1d(nn.Module):
    """Three stride-2 Conv1d layers (kernels 5, 3, 3) with ReLU, then a linear head over the flattened
    feature map (the paper's CNN baseline has 25 channels: 40 -> 19 -> 10 -> 5 positions)."""

    def __init__(self, length: int, num_classes: int, channels: int = 25):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, channels, kernel_size=5, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv1d(channels, channels, kernel_size=3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv1d(channels, channels, kernel_size=3, stride=2, padding=1),
            nn.ReLU(),
        )
        positions = _strided_length(_strided_length(_strided_length(length, 5), 3), 3)
        if positions < 1:
            raise ValueError(f"cnn1d needs signals of length >= 4 (got {length})")
        self.head = nn.Linear(channels * positions, num_classes)

    def forward(self, signals: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(signals.unsqueeze(1)), 1))


class GRU1d(nn.Module):
    """A recurrent classifier: the signal read one value per time step by a GRU (Cho et al. 2014) of `hidden` units
    and `layers` layers, its last hidden state mapped to the classes (the paper's GRU baseline reads MNIST-1D this
    way). The recurrence runs `length` sequential steps, so its step time grows with the signal, not only with the batch."""

    def __init__(self, length: int, num_classes: int, hidden: int = 32, layers: int = 1):
        super().__init__()
        if length < 1:
            raise ValueError(f"gru1d needs signals of length >= 1 (got {length})")
        self.gru = nn.GRU(input_size=1, hidden_size=hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, signals: torch.Tensor) -> torch.Tensor:
        _, last = self.gru(signals.unsqueeze(-1))  # last: (layers, batch, hidden)
        return self.head(last[-1])


class Transformer1d(nn.Module):
    """A transformer encoder over the signal cut into patches (Dosovitskiy et al. 2021, sec. 3.1, in one dimension):
    the signal, zero-padded to a multiple of `patch`, as ceil(length / patch) tokens of `patch` values, each mapped
    to `width` by one linear layer, plus a learned position embedding; `layers` pre-LayerNorm encoder layers (`heads`
    attention heads, a 4 x width ReLU feed-forward, no dropout); the tokens' mean, a LayerNorm and a linear head to the
    classes (mean pooling in place of a class token)."""

    def __init__(self, length: int, num_classes: int, patch: int = 4, width: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        if length < 1 or patch < 1:
            raise ValueError(f"transformer1d needs length >= 1 and patch >= 1 (got {length}, {patch})")
        if width % heads:
            raise ValueError(f"transformer1d: width ({width}) must be a multiple of heads ({heads})")
        self.patch, self.tokens = patch, -(-length // patch)
        self.embed = nn.Linear(patch, width)
        self.position = nn.Parameter(torch.zeros(1, self.tokens, width))
        nn.init.normal_(self.position, std=0.02)
        layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, signals: torch.Tensor) -> torch.Tensor:
        padding = self.tokens * self.patch - signals.shape[1]
        if padding:
            signals = nn.functional.pad(signals, (0, padding))
        tokens = self.embed(signals.reshape(signals.shape[0], self.tokens, self.patch)) + self.position
        return self.head(self.norm(self.encoder(tokens).mean(dim=1)))
