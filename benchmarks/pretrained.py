"""Starting weights of the fine-tuning tasks (benchmarks/efficiency_tasks.py, Task.pretrained), made here, offline.

Most training a user runs starts from weights trained before, and the gradient statistics of a fine-tuning run are
not those of a run from a random init: the loss starts low, |G|^2 small. A pretraining recipe trains a model of the
zoo on a source task and saves its state dict as a user's `torch.save(model.state_dict(), path)` would; every seed
of the fine-tuning task starts from that file (loaded by the service's own loader, models.initial_weights), and
the jobs the benchmarks submit name it as `initial_weights`.

The file lives under var/datasets/pretrained/ (a data root of the benchmarks' server) and is made on first use:
deterministic (one torch thread, seeded init and batch order), written to a temporary name and renamed, so that
parallel workers that make it at once write the same bytes in turn.

- `mnist1d_mlp_classes0to4`: the MNIST-1D MLP (mlp1d, hidden 100) trained with Adam (lr 1e-3, batch 64) for 20
  epochs on the samples of classes 0-4 of an independent draw of the MNIST-1D generator (seed 1, not the tasks'
  42: no sample of the fine-tuning data or its test split is seen). Its output units for classes 5-9 were never
  pushed up: fine-tuning on all ten classes learns them on features learnt for the other five. The start's loss on
  the task's data is above a random init's (classes 5-9 are confidently wrong), its accuracy 0.37.
- `mnist1d_mlp_milder_distortion`: the same MLP and training on all ten classes of an independent draw (seed 1) with
  milder distortions than the task's (scale_coeff 0.2 and shear_scale 0.4 for the generator's 0.4 and 0.75): the same
  labels, another distribution, as a model pretrained on cleaner data is fine-tuned on the user's. On the task's data
  it starts at a test accuracy of 0.63 and a loss of 1.0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from offline_data import REPO, data_shape

PRETRAINED_DIR = REPO / "var" / "datasets" / "pretrained"


@dataclass(frozen=True)
class Pretraining:
    dataset: str  # "mnist1d" (the generator, drawn with `generator_seed`)
    model: str  # a models.zoo name, built for data_shape(dataset)
    samples: int  # drawn from the generator; those of `classes` are trained on
    classes: tuple[int, ...]
    generator_seed: int
    batch: int
    lr: float  # Adam, PyTorch's other defaults
    epochs: int
    init_seed: int = 0
    generator_args: tuple[tuple[str, float], ...] = ()  # mnist1d generator arguments other than its defaults


PRETRAININGS: dict[str, Pretraining] = {
    "mnist1d_mlp_classes0to4": Pretraining("mnist1d", "mlp1d", 7000, (0, 1, 2, 3, 4), generator_seed=1, batch=64, lr=1e-3, epochs=20),
    "mnist1d_mlp_milder_distortion": Pretraining("mnist1d", "mlp1d", 7000, tuple(range(10)), generator_seed=1, batch=64, lr=1e-3,
                                                 epochs=20, generator_args=(("scale_coeff", 0.2), ("shear_scale", 0.4))),
}


def source_data(recipe: Pretraining) -> tuple[torch.Tensor, torch.Tensor]:
    """The source task's inputs and labels (only mnist1d so far)."""
    from models.datasets_bundled import generate_mnist1d

    if recipe.dataset != "mnist1d":
        raise KeyError(f"no pretraining source '{recipe.dataset}': only mnist1d")
    signals, labels = generate_mnist1d(recipe.samples, seed=recipe.generator_seed, **dict(recipe.generator_args))
    inputs, targets = torch.from_numpy(signals), torch.from_numpy(labels)
    kept = torch.isin(targets, torch.tensor(recipe.classes))
    return inputs[kept], targets[kept]


def pretrain(recipe: Pretraining) -> dict[str, torch.Tensor]:
    """The recipe's model trained on its source data: its state dict."""
    from models.zoo import build_model

    inputs, targets = source_data(recipe)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe.init_seed)
            model = build_model(recipe.model, options=None, **data_shape(recipe.dataset))
            optimizer = torch.optim.Adam(model.parameters(), lr=recipe.lr)
            order = torch.Generator().manual_seed(recipe.init_seed)
            for _ in range(recipe.epochs):
                for rows in torch.randperm(len(targets), generator=order).split(recipe.batch):
                    optimizer.zero_grad()
                    torch.nn.functional.cross_entropy(model(inputs[rows]), targets[rows]).backward()
                    optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def pretrained_weights(name: str) -> Path:
    """The path of recipe `name`'s state dict, made first if it is not there yet."""
    path = PRETRAINED_DIR / f"{name}.pt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        torch.save(pretrain(PRETRAININGS[name]), partial)
        partial.replace(path)
    return path
