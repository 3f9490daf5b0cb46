"""Models by catalog name or user reference (torch side; random init, nothing downloaded).

A factory is called as `factory(**model_options, **shape)`, where `shape` is what the dataset gives:
- image datasets:    in_channels, image_size, num_classes
- signal1d datasets: length, num_classes
- token datasets:    vocab_size, seq_len
User models ("package.module:factory", allowlisted) are called the same way and must return an nn.Module.
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable

from torch import nn

from models.gpt import GPT
from models.lstm import LSTMLanguageModel
from models.registry import (
    ALLOWED_MODULES_ENV,
    MODELS,
    TORCHVISION_CLASSIFIERS,
    is_user_model_ref,
    resolved_model_options,
    unknown_name_message,
    user_model_allowed,
)
from models.signal1d import CNN1d, GRU1d, Linear1d, MLP1d, Transformer1d
from models.vision import ResNetCifar, SmallCNN, VGG11Cifar, resnet18_cifar, torchvision_classifier

ModelFactory = Callable[..., nn.Module]

_FACTORIES: dict[str, ModelFactory] = {
    "small_cnn": SmallCNN,
    "resnet18_cifar": resnet18_cifar,
    "resnet_cifar": ResNetCifar,
    "vgg11_cifar": VGG11Cifar,
    "linear1d": Linear1d,
    "mlp1d": MLP1d,
    "cnn1d": CNN1d,
    "gru1d": GRU1d,
    "transformer1d": Transformer1d,
    "gpt": GPT,
    "lstm_lm": LSTMLanguageModel,
    **{name: functools.partial(torchvision_classifier, name) for name in TORCHVISION_CLASSIFIERS},
}


def load_user_factory(ref: str, allowed_prefixes: list[str]) -> ModelFactory:
    """Import the factory of a "package.module:factory" reference, if its module is allowlisted."""
    module_name, _, factory_name = ref.partition(":")
    if not user_model_allowed(ref, allowed_prefixes):
        raise PermissionError(
            f"user model module '{module_name}' is not allowlisted (importing it runs its code); the server "
            f"operator can allow it with {ALLOWED_MODULES_ENV}={module_name} (comma-separated module prefixes)"
        )
    module = importlib.import_module(module_name)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ValueError(f"module '{module_name}' has no callable '{factory_name}' (from model '{ref}')")
    return factory


def build_model(
    name: str, *, options: dict[str, object] | None = None, allowed_model_modules: list[str] | None = None, **shape: int
) -> nn.Module:
    """A random-init model for a dataset of the given shape (see the module docstring for the keys)."""
    if is_user_model_ref(name):
        model = load_user_factory(name, allowed_model_modules or [])(**(options or {}), **shape)
        if not isinstance(model, nn.Module):
            raise TypeError(f"user model factory '{name}' returned {type(model).__name__}, not a torch.nn.Module")
        return model
    if name not in _FACTORIES:
        raise KeyError(unknown_name_message("model", name, MODELS))
    return _FACTORIES[name](**resolved_model_options(name, options), **shape)
