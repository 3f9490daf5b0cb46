"""A job's starting weights: a fine-tuning job starts from its checkpoint, not from the seeded random init.

The gradient statistics of a run depend on where it starts: at a random init |G|^2 is large and the noise scale
small, and it grows 10-1000x as the loss falls (McCandlish et al. 2018). A pilot that trained a fine-tuning job's
model from a random init would read a noise scale of another training run. So a job may name
`initial_weights`: a file written by `torch.save(model.state_dict(), path)` for the model the spec builds
(the same keys and shapes). Profiling points, step points and the pilot load it after building the model.

The file is read by the worker, under the operator's data roots (models.data_roots: checked at submit without
file-system access, and here after resolving symlinks), with `torch.load(weights_only=True)`: tensors only, no
pickled code runs. A state dict saved from a DistributedDataParallel wrapper (every key prefixed "module.") is
taken without the prefix. Anything else that does not fit (missing or unexpected keys, another shape) is a
ValueError naming the file and the keys: the point fails with that reason, as data.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from models.data_roots import resolve_confined

DDP_PREFIX = "module."
LISTED_KEYS = 5  # at most this many keys named per kind of mismatch


def _listed(keys: list[str]) -> str:
    shown = ", ".join(keys[:LISTED_KEYS])
    return shown + (f" and {len(keys) - LISTED_KEYS} more" if len(keys) > LISTED_KEYS else "")


def _without_ddp_prefix(state: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """`state` with "module." stripped from every key when all carry it and the model's keys do not."""
    if state and all(key.startswith(DDP_PREFIX) for key in state) and not any(key.startswith(DDP_PREFIX) for key in expected):
        return {key[len(DDP_PREFIX):]: value for key, value in state.items()}
    return state


def state_dict_problem(state: object, expected: Mapping[str, torch.Tensor]) -> str | None:
    """Why `state` cannot be loaded into a model whose state dict is `expected` (strictly: the same keys, each the
    same shape), or None."""
    if not isinstance(state, Mapping) or not all(isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in state.items()):
        return "it is not a state dict (a mapping of names to tensors, as torch.save(model.state_dict(), path) writes)"
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    reshaped = [f"{key} {tuple(state[key].shape)} for {tuple(expected[key].shape)}" for key in expected
                if key in state and state[key].shape != expected[key].shape]  # fmt: skip
    problems = ([f"missing {_listed(missing)}"] if missing else []) + ([f"unexpected {_listed(unexpected)}"] if unexpected else []) \
        + ([f"another shape: {_listed(reshaped)}"] if reshaped else [])  # fmt: skip
    return "; ".join(problems) + " (is it the state dict of the model this spec builds, with these model_options?)" if problems else None


def load_initial_weights(model: torch.nn.Module, path: str, data_roots: list[str]) -> None:
    """Load the state dict at `path` (under `data_roots`) into `model`, strictly (module docstring).

    Raises PermissionError or FileNotFoundError (models.data_roots.resolve_confined), or ValueError when the file
    is not a state dict of this model."""
    real = resolve_confined(path, data_roots)
    try:
        state = torch.load(real, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any unreadable file is the same user error
        raise ValueError(f"initial_weights '{path}' does not load with torch.load(weights_only=True): "
                         f"{type(error).__name__}: {str(error)[:200]}") from None  # fmt: skip
    expected = model.state_dict()
    if isinstance(state, Mapping):
        state = _without_ddp_prefix(state, expected)
    problem = state_dict_problem(state, expected)
    if problem:
        raise ValueError(f"initial_weights '{path}' does not fit the model: {problem}")
    model.load_state_dict(state, strict=True)
