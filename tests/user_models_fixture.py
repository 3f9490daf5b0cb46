"""A user model module for the tests: importable as "tests.user_models_fixture:tiny_classifier"."""

from torch import nn


def tiny_classifier(*, in_channels: int, image_size: int, num_classes: int, hidden: int = 8) -> nn.Module:
    """Flatten -> linear(hidden) -> ReLU -> linear(classes); records the arguments it was built with."""
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(in_channels * image_size * image_size, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
    )
    model.built_with = {"in_channels": in_channels, "image_size": image_size, "num_classes": num_classes, "hidden": hidden}
    return model


def not_a_model(**shape):
    return "a string"
