"""The contract user code follows: "package.module:factory" models and datasets (docs/user_models.md).

Both are imported by name, only from modules the server allowlists (TULA_ALLOWED_MODEL_MODULES). The
profiling worker (`python -m profiler.run_point`) and the submit-time check (`python -m models.user_contract`)
run with the server's Python, in its working directory, with its environment: a module is importable when
it is installed in that environment, on PYTHONPATH, or a package under the working directory (`-m` puts the
working directory first on sys.path). A Ray worker imports it the same way on its own machine.

Model factory: called as `factory(**shape, **model_options)` and returns a torch.nn.Module. `shape` is the
dataset's (registry.SHAPE_KEYS): image -> in_channels, image_size, num_classes; signal1d -> length,
num_classes; tokens -> vocab_size, seq_len. `model(inputs)` gives logits (batch, num_classes), or
(batch, seq_len, vocab_size) for tokens, for the catalog losses (models.losses: cross-entropy by default; mse, l1 and
bce_with_logits give num_classes outputs against float targets); with a user loss it may give anything that loss takes.

Loss function ("package.module:function", the spec's `loss`): called as function(outputs, targets) with what the
model returns and the dataset's targets; returns the batch's mean loss, a scalar tensor with a gradient. The mean,
not the sum: the check compares the loss of a batch of 2 with the mean of its two halves' losses (the noise
estimator averages micro-batch losses, and a summed loss would scale the gradient with the batch).

Dataset factory: called with keyword arguments: every dataset field the spec gives (channels, image_size,
num_classes, seq_len, vocab_size, path, scaling, split) and every entry of dataset.options, plus num_samples
and seed when its signature names them (or takes **kwargs). It returns either
- a batch source: an object with `input_kind` ("image" | "signal1d" | "tokens"), `shape` (a dict of that
  kind's SHAPE_KEYS, positive ints) and `batch(batch_size, generator) -> (inputs, targets)`: CPU tensors, a
  deterministic function of the torch.Generator's state (like models.data's datasets); or
- a pair of tensors (inputs, targets) holding the whole data set, wrapped in a TensorPairSource.

A batch of B samples (`batch_problem` checks it):
- image:    inputs float (B, in_channels, image_size, image_size), targets int64 (B,) in [0, num_classes)
- signal1d: inputs float (B, length), targets int64 (B,) in [0, num_classes)
- tokens:   inputs int64 (B, seq_len) and next-token targets int64 (B, seq_len), both in [0, vocab_size)
With loss mse, l1 or bce_with_logits (image and signal1d data): targets float (B, num_classes), num_classes being
the model's outputs (bce_with_logits: in [0, 1]). With a user loss: any targets tensor of B samples (dim 0).
A tensor pair's float targets (N,) are served as (N, 1); float targets (N, k) give num_classes = k.

`python -m models.user_contract --check JSON | --check-file FILE [--out FILE]` builds a profiling request's dataset and model on
a batch of CHECK_BATCH samples, runs forward, loss and backward, and writes what breaks the contract as JSON
(`check`); tula_service.spec.user_code_check runs it when a spec names user code or a loss other than cross-entropy.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch

from models.registry import (
    DATASET_SPEC_FIELDS,
    DATASETS,
    LOSSES,
    MODELS,
    SHAPE_KEYS,
    image_size_problem,
    is_user_ref,
    not_allowlisted_message,
    resolved_loss,
    user_model_allowed,
)

CHECK_BATCH = 2
MEAN_LOSS_RTOL = 1e-4  # a batch's loss against the mean of its halves' losses: float32 rounding, not a sum (2x)
CHECK_CATALOG_SAMPLES = 10  # a catalog dataset's shape does not depend on num_samples: mnist1d generates 10
Loc = tuple[str, ...]  # the spec field a problem is about, e.g. ("dataset", "name"), ("model_options", "hidden")


class ContractError(ValueError):
    """User code that breaks the contract, with the spec field the problem is about."""

    def __init__(self, loc: Loc, message: str):
        super().__init__(message)
        self.loc = loc
        self.message = message


def import_user_factory(ref: str, allowed_prefixes: list[str], kind: str) -> Callable[..., Any]:
    """The callable of a "package.module:factory" reference of a user `kind` ("model", "dataset" or "loss"),
    imported only when its module is allowlisted."""
    module_name, _, factory_name = ref.partition(":")
    if not user_model_allowed(ref, allowed_prefixes):
        raise PermissionError(not_allowlisted_message(kind, ref))
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            f"cannot import user {kind} module '{module_name}' ({error}); it is imported with the working directory "
            f"({os.getcwd()}) and PYTHONPATH on sys.path, or from the installed packages"
        ) from error
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ValueError(f"module '{module_name}' has no callable '{factory_name}' (from {kind} '{ref}')")
    return factory


def call_arguments(factory: Callable[..., Any], given: dict[str, Any], if_named: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The keyword arguments `factory` is called with (all of `given`, plus the entries of `if_named` that its
    signature names, or all of them when it takes **kwargs) and its problems as [(argument, why)]: a given
    argument it does not take, a parameter without a default that nothing fills."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): the call itself will tell
        return {**if_named, **given}, []
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    by_keyword = [name for name, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    listed = ", ".join(by_keyword) or "none"
    problems = [
        (name, f"takes no keyword argument '{name}' (its keyword parameters: {listed})")
        for name in given
        if not takes_any and name not in by_keyword
    ]
    arguments = {**{name: value for name, value in if_named.items() if takes_any or name in by_keyword}, **given}
    for name, parameter in parameters.items():
        unfilled = parameter.default is parameter.empty and name not in arguments
        if unfilled and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            how = "positional-only, but it is called with keyword arguments" if parameter.kind is parameter.POSITIONAL_ONLY else "no default"
            problems.append((name, f"needs '{name}' ({how}), which it is not given"))
    return arguments, problems


def model_call_problems(ref: str, factory: Callable[..., Any], input_kind: str, options: dict[str, Any]) -> list[ContractError]:
    """What is wrong with calling a user model factory as factory(**shape, **model_options)."""
    shape_keys = SHAPE_KEYS[input_kind]
    _, problems = call_arguments(factory, {**{key: 1 for key in shape_keys}, **options}, {})
    refused_shape = [argument for argument, _ in problems if argument in shape_keys]
    errors = [
        ContractError(("model",), (
            f"model factory '{ref}' must take the {input_kind} dataset's shape as keyword arguments "
            f"{', '.join(shape_keys)}; it does not take {', '.join(refused_shape)}"
        ))
    ] if refused_shape else []
    for argument, why in problems:
        if argument not in shape_keys:
            hint = "" if argument in options else "; give it in model_options"
            errors.append(ContractError(("model_options", argument), f"model factory '{ref}' {why}{hint}"))
    return errors


def dataset_call(ref: str, factory: Callable[..., Any], fields: dict[str, Any], options: dict[str, Any],
                 num_samples: int | None, seed: int) -> tuple[dict[str, Any], list[ContractError]]:
    """The keyword arguments of a user dataset factory (the spec's fields and options; num_samples and seed
    when named) and what is wrong with them, each error at its spec field."""
    arguments, problems = call_arguments(factory, {**fields, **options}, {"num_samples": num_samples, "seed": seed})
    errors = []
    for argument, why in problems:
        if argument in fields or argument in DATASET_SPEC_FIELDS:
            loc, hint = ("dataset", argument), "" if argument in fields else f"; give it as dataset.{argument}"
        elif argument in ("num_samples", "seed"):
            loc, hint = ("dataset", "name"), ""
        else:
            loc, hint = ("dataset", "options", argument), "" if argument in options else "; give it in dataset.options"
        errors.append(ContractError(loc, f"dataset factory '{ref}' {why}{hint}"))
    return arguments, errors


class TensorPairSource:
    """A whole data set returned as tensors (inputs, targets); batches are drawn uniformly with replacement.

    Kind and shape come from the tensors: integer inputs (N, T) with targets (N, T) are tokens (vocab_size =
    largest id + 1, seq_len = T); float inputs (N, C, S, S) are images and float (N, L) signals, with int64
    targets (N,) and num_classes = largest label + 1 (return a batch source to state more classes), or float
    targets (regression, multi-label: num_classes = the outputs, k of (N, k), 1 of (N,), served as (N, 1))."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, *, ref: str = "a user dataset"):
        if len(inputs) != len(targets) or len(inputs) == 0:
            raise ContractError(("dataset", "name"), f"dataset '{ref}' returned {len(inputs)} inputs and {len(targets)} targets: "
                                "the pair must hold the same number (> 0) of samples")
        if targets.is_floating_point() and targets.dim() == 1:
            targets = targets.unsqueeze(1)  # one output per sample, as a model of num_classes = 1 gives it
        self.inputs, self.targets = inputs, targets
        if targets.is_floating_point() and targets.dim() == 2:
            outputs = targets.shape[1]  # the model's outputs (num_classes) for a float loss
        elif targets.dim() == 1 and not targets.is_floating_point():
            outputs = int(targets.max()) + 1  # class labels
        else:
            outputs = None
        if not inputs.is_floating_point() and inputs.dim() == 2 and targets.shape == inputs.shape:
            vocab_size = int(max(inputs.max(), targets.max())) + 1
            self.input_kind, self.shape = "tokens", {"vocab_size": vocab_size, "seq_len": inputs.shape[1]}
        elif inputs.is_floating_point() and inputs.dim() == 4 and inputs.shape[2] == inputs.shape[3] and outputs is not None:
            self.input_kind = "image"
            self.shape = {"in_channels": inputs.shape[1], "image_size": inputs.shape[2], "num_classes": outputs}
        elif inputs.is_floating_point() and inputs.dim() == 2 and outputs is not None:
            self.input_kind, self.shape = "signal1d", {"length": inputs.shape[1], "num_classes": outputs}
        else:
            raise ContractError(("dataset", "name"), (
                f"dataset '{ref}' returned inputs {inputs.dtype} {list(inputs.shape)} and targets {targets.dtype} "
                f"{list(targets.shape)}: a pair is float (N, C, S, S) images or float (N, L) signals with int64 labels (N,) "
                "or float targets (N,) or (N, k), or int64 tokens (N, T) with next-token targets (N, T)"
            ))

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.randint(0, len(self.targets), (batch_size,), generator=generator)
        return self.inputs[index], self.targets[index]


def loss_targets(loss: str | None) -> str:
    """What a loss takes as targets: "labels" (cross-entropy: int64 class indices or next tokens), "float" (mse, l1,
    bce_with_logits: the outputs' shape) or "any" (a user loss: a tensor of B samples)."""
    if loss is None:
        return "labels"
    return "any" if is_user_ref(loss) else "labels" if LOSSES[loss].targets == "labels" else "float"


def batch_problem(input_kind: str, shape: dict[str, int], inputs: object, targets: object, batch_size: int,
                  loss: str | None = None) -> str | None:  # fmt: skip
    """What is wrong with a batch of `batch_size` samples from a dataset of this kind and shape, for this loss
    (None: cross-entropy), or None."""
    if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        return f"gave ({type(inputs).__name__}, {type(targets).__name__}); it must give a pair of tensors (inputs, targets)"
    wants = loss_targets(loss)
    if input_kind == "image":
        expected_inputs = (batch_size, shape["in_channels"], shape["image_size"], shape["image_size"])
        expected_targets, classes, what = (batch_size,), shape["num_classes"], "num_classes"
    elif input_kind == "signal1d":
        expected_inputs, expected_targets = (batch_size, shape["length"]), (batch_size,)
        classes, what = shape["num_classes"], "num_classes"
    else:
        if wants == "float":
            return f"is token data, which loss '{loss}' does not take: next tokens are class indices (cross_entropy, or a user loss)"
        expected_inputs = expected_targets = (batch_size, shape["seq_len"])
        classes, what = shape["vocab_size"], "vocab_size"
    if wants == "float":
        expected_targets = (batch_size, shape["num_classes"])
    if wants == "labels" and targets.is_floating_point():
        return (f"gave targets of dtype {targets.dtype}; class indices and next tokens are int64 (torch.long), "
                "and float targets need the spec's loss (mse, l1 or bce_with_logits, or a user loss)")
    if wants == "float" and not targets.is_floating_point():
        return (f"gave targets of dtype {targets.dtype}; loss '{loss}' takes float targets of the model output's shape "
                "(class indices are cross_entropy's)")
    checked = (("inputs", inputs, expected_inputs),) if wants == "any" else (("inputs", inputs, expected_inputs), ("targets", targets, expected_targets))
    for name, tensor, expected in checked:
        if tuple(tensor.shape) != expected:
            why = f" (loss '{loss}': float targets of the model output's shape (batch, num_classes))" if name == "targets" and wants == "float" else ""
            return f"gave {name} of shape {list(tensor.shape)} where its shape {shape} means {list(expected)}{why}"
    if input_kind == "tokens" and inputs.dtype != torch.int64:
        return f"gave token inputs of dtype {inputs.dtype}; token ids are int64 (torch.long)"
    if input_kind != "tokens" and not inputs.is_floating_point():
        return f"gave {input_kind} inputs of dtype {inputs.dtype}; they must be floating point"
    if wants == "any":
        if targets.dim() == 0 or targets.shape[0] != batch_size:
            return f"gave targets of shape {list(targets.shape)}: a batch of {batch_size} samples has them along dim 0"
        return None
    if wants == "float":
        if not bool(torch.isfinite(targets).all()):
            return "gave targets that are not all finite"
        if LOSSES[loss].targets == "probabilities" and (float(targets.min()) < 0 or float(targets.max()) > 1):
            return f"gave targets in [{float(targets.min()):g}, {float(targets.max()):g}]; loss '{loss}' takes targets in [0, 1]"
        return None
    if targets.dtype != torch.int64:
        return f"gave targets of dtype {targets.dtype}; class indices and next tokens are int64 (torch.long)"
    for name, tensor in (("targets", targets), *((("inputs", inputs),) if input_kind == "tokens" else ())):
        if int(tensor.min()) < 0 or int(tensor.max()) >= classes:
            return f"gave {name} in [{int(tensor.min())}, {int(tensor.max())}], outside [0, {what} = {classes})"
    return None


def as_batch_source(made: object, ref: str, loss: str | None = None) -> Any:
    """A dataset factory's result as a batch source, once its kind, shape and a batch of CHECK_BATCH pass (for the
    spec's loss: its targets)."""
    if isinstance(made, (tuple, list)) and len(made) == 2 and all(isinstance(t, torch.Tensor) for t in made):
        source: Any = TensorPairSource(made[0], made[1], ref=ref)
    elif all(hasattr(made, attribute) for attribute in ("input_kind", "shape", "batch")):
        source = made
    else:
        raise ContractError(("dataset", "name"), (
            f"dataset factory '{ref}' returned {type(made).__name__}: return an object with input_kind, shape and "
            "batch(batch_size, generator), or a pair of tensors (inputs, targets)"
        ))
    kind, shape = source.input_kind, source.shape
    if kind not in SHAPE_KEYS:
        raise ContractError(("dataset", "name"), f"dataset '{ref}' has input_kind {kind!r}; known: {', '.join(SHAPE_KEYS)}")
    wanted = SHAPE_KEYS[kind]
    if not isinstance(shape, dict) or not all(isinstance(shape.get(k), int) and shape[k] >= 1 for k in wanted):
        raise ContractError(("dataset", "name"), f"dataset '{ref}' has shape {shape!r}; a {kind} dataset's shape is a dict of "
                            f"positive ints {', '.join(wanted)}")
    result = source.batch(CHECK_BATCH, torch.Generator().manual_seed(0))
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise ContractError(("dataset", "name"), f"dataset '{ref}': batch({CHECK_BATCH}, generator) gave {type(result).__name__}, "
                            "not a pair (inputs, targets)")
    problem = batch_problem(kind, shape, result[0], result[1], CHECK_BATCH, loss)
    if problem:
        raise ContractError(("dataset", "name"), f"dataset '{ref}': batch({CHECK_BATCH}, generator) {problem}")
    return source


def build_user_dataset(ref: str, *, allowed_prefixes: list[str], num_samples: int | None = None, seed: int = 0,
                       options: dict[str, Any] | None = None, loss: str | None = None, **fields: Any) -> Any:
    """A user dataset ("package.module:factory") built as the contract says, its first batch checked (for `loss`)."""
    factory = import_user_factory(ref, allowed_prefixes, "dataset")
    arguments, errors = dataset_call(ref, factory, fields, dict(options or {}), num_samples, seed)
    if errors:
        raise errors[0]
    return as_batch_source(factory(**arguments), ref, loss)


def _raised(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _checked_dataset(name: str, dataset: dict[str, Any], seed: int, allowed: list[str], roots: list[str], notes: list[str],
                     loss: str | None = None) -> Any:  # fmt: skip
    """The dataset of a check request, or None when it cannot be built on this machine (a note says why).
    Raises ContractError, or an ExceptionGroup of them for several signature problems."""
    from models.data import build_dataset

    if not is_user_ref(name):
        try:
            return build_dataset(name, seed=seed, data_roots=roots, **{**dataset, "num_samples": CHECK_CATALOG_SAMPLES})
        except Exception as error:  # noqa: BLE001 - e.g. a path that exists on the workers only
            notes.append(f"dataset '{name}' was not built here ({_raised(error)}): the model's signature was checked, not its output")
            return None
    try:
        factory = import_user_factory(name, allowed, "dataset")
    except Exception as error:  # noqa: BLE001 - importing user code: whatever it raises is the answer
        raise ContractError(("dataset", "name"), _raised(error)) from None
    fields = {key: value for key, value in dataset.items() if key not in ("num_samples", "options")}
    arguments, errors = dataset_call(name, factory, fields, dict(dataset.get("options") or {}), dataset.get("num_samples"), seed)
    if errors:
        raise ExceptionGroup(f"dataset factory '{name}'", errors)
    path = fields.get("path")
    if isinstance(path, str) and not Path(path).expanduser().exists():
        notes.append(f"dataset.path '{path}' is not on this machine: the dataset factory's signature was checked, not its batches")
        return None
    try:
        return as_batch_source(factory(**arguments), name, loss)
    except ContractError:
        raise
    except (Exception, SystemExit) as error:  # noqa: BLE001
        raise ContractError(("dataset", "name"), f"building dataset '{name}' raised {_raised(error)}") from None


def _checked_model(name: str, options: dict[str, Any], dataset_name: str, input_kind: str | None, source: Any,
                   seed: int, allowed: list[str], notes: list[str], loss: str | None = None) -> dict[str, Any] | None:
    """Build the model for the dataset's shape, run forward, the loss and backward on CHECK_BATCH samples."""
    from models.zoo import build_model

    if is_user_ref(name):
        try:
            factory = import_user_factory(name, allowed, "model")
        except Exception as error:  # noqa: BLE001
            raise ContractError(("model",), _raised(error)) from None
        errors = model_call_problems(name, factory, input_kind, options) if input_kind is not None else []
        if errors:
            raise ExceptionGroup(f"model factory '{name}'", errors)
    elif input_kind is not None and MODELS[name].input_kind != input_kind:
        raise ContractError(("model",), f"model '{name}' takes {MODELS[name].input_kind} inputs but dataset '{dataset_name}' gives {input_kind}")
    elif source is not None and input_kind == "image":
        problem = image_size_problem(name, source.shape["image_size"])
        if problem:
            raise ContractError(("model",), problem)
    if source is None:  # the dataset's note says why; a user model's signature was checked above
        return None
    try:
        inputs, targets = source.batch(CHECK_BATCH, torch.Generator().manual_seed(seed))
    except (Exception, SystemExit) as error:  # noqa: BLE001 - a user dataset that gave one batch but not this one
        raise ContractError(("dataset", "name"), f"dataset '{dataset_name}': batch({CHECK_BATCH}, generator) raised {_raised(error)}") from None
    what = f"model '{name}' on a batch of {CHECK_BATCH} from dataset '{dataset_name}' (inputs {inputs.dtype} {list(inputs.shape)})"
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = build_model(name, options=options, allowed_model_modules=allowed, **source.shape)
        model.train()
        logits = model(inputs)
    except (Exception, SystemExit) as error:  # noqa: BLE001
        raise ContractError(("model",), f"building and running {what} raised {_raised(error)}") from None
    expected = [CHECK_BATCH, source.shape["seq_len"], source.shape["vocab_size"]] if input_kind == "tokens" else [CHECK_BATCH, source.shape["num_classes"]]
    if loss_targets(loss) != "any" and (not isinstance(logits, torch.Tensor) or list(logits.shape) != expected):
        got = list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        rule = "(batch, seq_len, vocab_size)" if input_kind == "tokens" else "(batch, num_classes)"
        raise ContractError(("model",), f"{what} gave {got}; on {input_kind} data a model gives {rule} = {expected}")
    loss_fn = _checked_loss_function(loss, input_kind, allowed)
    value = _checked_loss_value(loss, loss_fn, logits, targets, what, notes)
    try:
        value.backward()
    except Exception as error:  # noqa: BLE001
        raise ContractError(("model",), f"the loss of {what} has no gradient ({_raised(error)})") from None
    if not any(p.grad is not None for p in model.parameters()):
        raise ContractError(("model",), f"no parameter of model '{name}' gets a gradient from the loss: there is nothing to train")
    shape = list(logits.shape) if isinstance(logits, torch.Tensor) else None
    return {"output_shape": shape, "parameters": sum(p.numel() for p in model.parameters())}


def _checked_loss_function(loss: str | None, input_kind: str, allowed: list[str]) -> Callable[..., Any]:
    """The loss's function (models.losses); a user loss that cannot be imported is a ContractError at `loss`."""
    from models.losses import loss_function

    try:
        return loss_function(loss, input_kind, allowed)
    except Exception as error:  # noqa: BLE001 - importing user code: whatever it raises is the answer
        raise ContractError(("loss",), _raised(error)) from None


def _checked_loss_value(loss: str | None, loss_fn: Callable[..., Any], outputs: Any, targets: torch.Tensor, what: str,
                        notes: list[str]) -> torch.Tensor:  # fmt: skip
    """The batch's loss, checked to be a finite scalar with a gradient and (for a user loss) the mean over the batch's
    samples: loss(batch) against the mean of loss(each half), on the same outputs (a model's batch norm does not enter)."""
    where, name = (("loss",), f"loss '{loss}'") if is_user_ref(loss or "") else (("model",), "the loss")
    try:
        value = loss_fn(outputs, targets)
    except Exception as error:  # noqa: BLE001
        raise ContractError(where, f"{name} of {what} raised {_raised(error)}") from None
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        got = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ContractError(where, f"{name} of {what} gave {got}; a loss gives the batch's mean, a scalar tensor")
    if not value.requires_grad:
        raise ContractError(where, f"{name} of {what} has no gradient (it was computed outside autograd, or detached)")
    if not bool(torch.isfinite(value)):
        raise ContractError(where, f"{name} of {what} is {float(value)} at the initial weights")
    if not is_user_ref(loss or ""):
        return value
    if not isinstance(outputs, torch.Tensor) or outputs.dim() == 0 or outputs.shape[0] != CHECK_BATCH:
        notes.append(f"loss '{loss}': the model's outputs are not one tensor of {CHECK_BATCH} samples, so its mean over the "
                     "batch was not checked (a loss summed over the batch reads the noise scale wrong)")
        return value
    with torch.no_grad():
        halves = [float(loss_fn(outputs[i : i + 1].detach(), targets[i : i + 1])) for i in range(CHECK_BATCH)]
    mean = sum(halves) / CHECK_BATCH
    whole = float(value.detach())
    if abs(whole - mean) > MEAN_LOSS_RTOL * max(abs(mean), abs(whole), 1e-12):
        raise ContractError(where, (
            f"{name} gave {whole:.6g} on a batch of {CHECK_BATCH}, where the mean of its samples' losses is {mean:.6g}: "
            "it must be the mean over the batch's samples (reduction='mean'), not their sum; the noise estimator "
            "averages the losses of micro-batches"
        ))
    return value


def check(request: dict[str, Any]) -> dict[str, Any]:
    """Check a profiling request's user code (keys as models.workload: model, model_options, dataset, loss, seed,
    allowed_model_modules). Returns {"errors": [{"loc", "message"}], "notes": [what was not checked],
    "dataset": {"input_kind", "shape"} | None, "model": {"output_shape", "parameters"} | None}."""
    torch.set_num_threads(1)
    seed, allowed = int(request.get("seed", 0)), list(request.get("allowed_model_modules") or [])
    dataset = dict(request["dataset"])
    dataset_name = dataset.pop("name")
    errors: list[ContractError] = []
    notes: list[str] = []
    source = model_report = None
    loss = resolved_loss(request.get("loss"), dataset_name)
    try:
        source = _checked_dataset(dataset_name, dataset, seed, allowed, list(request.get("data_roots") or []), notes, loss)
    except* ContractError as group:
        errors.extend(group.exceptions)
    input_kind = source.input_kind if source is not None else (DATASETS[dataset_name].input_kind if dataset_name in DATASETS else None)
    if not errors:
        try:
            model_report = _checked_model(
                request["model"], dict(request.get("model_options") or {}), dataset_name, input_kind, source, seed, allowed, notes, loss
            )
        except* ContractError as group:
            errors.extend(group.exceptions)
    return {
        "errors": [{"loc": list(error.loc), "message": error.message} for error in errors],
        "notes": notes,
        "dataset": {"input_kind": source.input_kind, "shape": dict(source.shape)} if source is not None else None,
        "model": model_report,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.user_contract", description=__doc__.split("\n")[0])
    request = parser.add_mutually_exclusive_group(required=True)
    request.add_argument("--check", metavar="JSON", help="a profiling request: model, model_options, dataset, loss, seed, allowed_model_modules, data_roots")
    request.add_argument("--check-file", metavar="FILE", help="the same request, read from a file")
    parser.add_argument("--out", help="write the result (JSON) here instead of stdout (user code may print)")
    args = parser.parse_args(argv)
    text = json.dumps(check(json.loads(args.check if args.check is not None else Path(args.check_file).read_text())))
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
