"""The one entry point the profiler calls: a profiling request -> model, data and loss.

Request keys: `model` (catalog name or allowlisted "package.module:factory"), `model_options` (dict),
`initial_weights` (a state dict file under `data_roots` the model starts from, models.initial_weights; default
none: the seeded random init), `dataset` (dict: `name`, a catalog name or allowlisted "package.module:factory", `num_samples` and the
dataset's own fields), `loss` (models.losses: a catalog name or an allowlisted "package.module:function";
default the catalog dataset's, cross-entropy but for float targets), `seed` (default 0), `allowed_model_modules` (module prefixes user models, datasets
and losses may come from; default none). User code follows models.user_contract.

Same seed => the same initial weights; the batch sequence is a function of the generator passed to
`data.batch` (and, for generated data, of the seed). The global torch RNG is left as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from models.data import BatchSource, build_dataset
from models.initial_weights import load_initial_weights
from models.losses import loss_function
from models.registry import DATASETS, MODELS, compatible, image_size_problem, is_user_ref, loss_problem, resolved_loss
from models.zoo import build_model


@dataclass
class Workload:
    model: torch.nn.Module  # seeded random init, or the request's initial_weights; on CPU
    data: BatchSource  # .batch(batch_size, generator) -> (inputs, targets), CPU tensors
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]  # (model(inputs), targets) -> scalar mean loss (models.losses)
    input_kind: str  # "image" | "signal1d" | "tokens"
    tokens_per_sample: int | None  # sequence length for token workloads, else None


def _catalog_model_fits(model_name: str, dataset_name: str, data: BatchSource) -> None:
    """A catalog model on a user dataset: the kinds must match (known only once the dataset is built)."""
    kind = MODELS[model_name].input_kind
    if kind != data.input_kind:
        raise ValueError(f"model '{model_name}' takes {kind} inputs but dataset '{dataset_name}' gives {data.input_kind}")
    problem = image_size_problem(model_name, data.shape["image_size"]) if kind == "image" else None
    if problem:
        raise ValueError(problem)


def build_workload(request: dict[str, Any]) -> Workload:
    """Build the request's dataset, then its model sized for that data, with weights seeded by `seed`."""
    seed = int(request.get("seed", 0))
    allowed_modules = list(request.get("allowed_model_modules") or [])
    dataset = dict(request["dataset"])
    dataset_name, model_name = dataset.pop("name"), request["model"]
    if not compatible(model_name, dataset_name):
        raise ValueError(
            f"model '{model_name}' takes {MODELS[model_name].input_kind} inputs but dataset "
            f"'{dataset_name}' gives {DATASETS[dataset_name].input_kind}"
        )
    loss = resolved_loss(request.get("loss"), dataset_name)
    problem = loss_problem(loss, dataset_name)
    if problem:
        raise ValueError(problem)
    data_roots = list(request.get("data_roots") or [])  # file datasets only under these (models.data_roots)
    data = build_dataset(dataset_name, seed=seed, allowed_modules=allowed_modules, data_roots=data_roots, loss=loss,
                         **dataset)  # fmt: skip
    if is_user_ref(dataset_name) and model_name in MODELS:
        _catalog_model_fits(model_name, dataset_name, data)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(
            model_name, options=request.get("model_options") or {}, allowed_model_modules=allowed_modules, **data.shape
        )
    if request.get("initial_weights"):  # a fine-tuning job starts from its checkpoint (models.initial_weights)
        load_initial_weights(model, request["initial_weights"], data_roots)
    is_tokens = data.input_kind == "tokens"
    loss_fn = loss_function(loss, data.input_kind, allowed_modules)
    return Workload(
        model=model,
        data=data,
        loss_fn=loss_fn,
        input_kind=data.input_kind,
        tokens_per_sample=data.shape["seq_len"] if is_tokens else None,
    )
