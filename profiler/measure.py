"""One profiling point: a model at one per-device batch size, measured in this process.

The caller (the server's executor) runs this in a child process (`python -m profiler.run_point`),
so a crash or an out-of-memory here costs one point, never the server.

What is measured, per point:
- iteration time of forward + backward + optimizer step: warm-up iterations discarded, then
  `timed_iters` iterations; median, p10, p90 and coefficient of variation;
- peak memory, split into static bytes and activation bytes (see `profiler.memory`);
- squared gradient norms |g_b|^2 at the initial weights on `grad_draws` independent batches.
  Because E|g_b|^2 = |G|^2 + tr(Sigma)/b (McCandlish et al. 2018, App. A), the server can fit
  |G|^2 and tr(Sigma) across batch sizes and get the gradient noise scale B_simple = tr(Sigma)/|G|^2.
  Every point uses the same seed, so the initial weights are the same at every batch size.
"""

from __future__ import annotations

import platform
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from models.data import build_dataset
from models.zoo import build_model
from profiler.memory import SavedActivationCounter, static_bytes

SCHEMA_VERSION = 1


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def squared_grad_norm(model: nn.Module) -> float:
    return float(sum(p.grad.detach().float().pow(2).sum() for p in model.parameters() if p.grad is not None))


def _summary(values_s: list[float]) -> dict[str, float]:
    arr = np.asarray(values_s, dtype=float)
    mean = float(arr.mean())
    return {
        "median_s": float(np.median(arr)),
        "p10_s": float(np.percentile(arr, 10)),
        "p90_s": float(np.percentile(arr, 90)),
        "mean_s": mean,
        "cv": float(arr.std(ddof=1) / mean) if arr.size > 1 and mean > 0 else 0.0,
        "count": int(arr.size),
    }


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    text = str(error).lower()
    return "out of memory" in text or "can't allocate" in text or "cannot allocate" in text


def profile_point(request: dict[str, Any]) -> dict[str, Any]:
    """Measure one batch size. `request` keys: model, dataset{name, channels, image_size, num_classes},
    batch_size, warmup_iters, timed_iters, grad_draws, device, seed, lr."""
    device = pick_device(request.get("device", "auto"))
    batch_size = int(request["batch_size"])
    base = {
        "schema_version": SCHEMA_VERSION,
        "batch_size": batch_size,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    try:
        return {**base, "status": "ok", **_measure(request, device, batch_size)}
    except Exception as error:  # noqa: BLE001 - an OOM is data; anything else is re-raised
        if not is_out_of_memory(error):
            raise
        return {**base, "status": "oom", "error": f"{type(error).__name__}: {str(error)[:500]}"}


def _measure(request: dict[str, Any], device: torch.device, batch_size: int) -> dict[str, Any]:
    seed = int(request.get("seed", 0))
    dataset_spec = request["dataset"]
    shape = dict(
        in_channels=int(dataset_spec["channels"]),
        image_size=int(dataset_spec["image_size"]),
        num_classes=int(dataset_spec["num_classes"]),
    )
    torch.manual_seed(seed)
    model = build_model(request["model"], **shape).to(device)
    dataset = build_dataset(
        dataset_spec["name"],
        channels=shape["in_channels"],
        image_size=shape["image_size"],
        num_classes=shape["num_classes"],
        seed=seed,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=float(request.get("lr", 0.01)), momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    data_gen = torch.Generator().manual_seed(seed + batch_size)

    # Gradient statistics at the initial weights (identical across batch sizes: same seed).
    grad_sq_norms = []
    for _ in range(int(request.get("grad_draws", 4))):
        images, labels = dataset.batch(batch_size, data_gen)
        model.zero_grad(set_to_none=True)
        loss_fn(model(images.to(device)), labels.to(device)).backward()
        grad_sq_norms.append(squared_grad_norm(model))

    # Two host batches, reused: generating data is not part of the training step being modelled.
    host_batches = [dataset.batch(batch_size, data_gen) for _ in range(2)]

    def step(i: int) -> None:
        images, labels = host_batches[i % 2]
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(images), labels).backward()
        optimizer.step()

    for i in range(int(request.get("warmup_iters", 3))):
        step(i)
    _synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    iter_times_s = []
    for i in range(int(request.get("timed_iters", 10))):
        start = time.perf_counter()
        step(i)
        _synchronize(device)
        iter_times_s.append(time.perf_counter() - start)

    static = static_bytes(model, optimizer)
    static_total = sum(static.values())
    counter = SavedActivationCounter(model)
    images, labels = host_batches[0]
    with counter.hooks():
        loss = loss_fn(model(images.to(device)), labels.to(device))
    del loss
    memory = {
        "static_bytes": static_total,
        "static_breakdown_bytes": static,
        "activation_bytes": counter.bytes,
    }
    if device.type == "cuda":
        memory["peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
        memory["peak_source"] = "torch.cuda.max_memory_allocated"
    else:
        memory["peak_bytes"] = static_total + counter.bytes
        memory["peak_source"] = "static + saved-for-backward activations"

    param_count = sum(p.numel() for p in model.parameters())
    return {
        "iter_time": {**_summary(iter_times_s), "samples_s": iter_times_s},
        "memory": memory,
        "gradient": {
            "grad_sq_norms_at_init": grad_sq_norms,
            "grad_sq_norm_mean": float(np.mean(grad_sq_norms)),
            "grad_sq_norm_sem": float(np.std(grad_sq_norms, ddof=1) / np.sqrt(len(grad_sq_norms)))
            if len(grad_sq_norms) > 1
            else None,
        },
        "model": {
            "parameter_count": int(param_count),
            "gradient_bytes": int(sum(p.numel() * p.element_size() for p in model.parameters())),
        },
    }
