"""One profiling point: a workload at one per-device batch size, measured in this process.

The server's executor runs this in a child process (`python -m profiler.run_point`, or a child
forked from the warm worker `profiler.warm_worker`), so a crash or an out-of-memory costs one
point, never the server. Measured per point:

- iteration time of data-to-device + forward + backward + optimizer step, per phase and in all
  (`profiler.timing`: warm-up until settled, sampling until CV < target or its share of the time);
- memory split into static bytes (weights, gradients, optimizer state) and activation bytes, plus
  the CUDA allocator's peaks and the device's own view through NVML (`profiler.memory`);
- gradient noise scale and gradient variability with the two-batch estimator (`profiler.gradstats`),
  on iterations of their own before timing (from the seeded weights, so they are reproducible),
  so splitting a batch never distorts the timing;
- the precision (fp32, bf16 or fp16 autocast) and memory layout (channels-last) it ran with.

The point's time (`time_cap_s`) covers all of it, from building the model to the memory pass
(`profiler.timing.PointBudget`). Each pass is sized to what its estimate needs and takes a share of
what is left when it starts:

    gradient statistics  until the relative std. error of both |G|^2 and tr(Sigma) is under
                         GRAD_TARGET_RSE (at least GRAD_MIN_ITERS, at most grad_iters), or
                         GRAD_SHARE of the time left
    warm-up + timing     TIMING_SHARE of the time left (warm-up at most a quarter of it)
    memory               saved-activation counting passes until two agree (at most
                         MEMORY_MAX_PASSES), or the time left

`record["budget"]` says how long each pass took, how many iterations it ran and why it stopped.

Out-of-memory is data: the record says "oom" and the batch is infeasible on this device.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from typing import Any

import torch

from models.workload import Workload, build_workload
from profiler.gradstats import GradientNoiseEstimator
from profiler.memory import (
    SavedActivationCounter,
    apply_memory_limit,
    cuda_memory,
    nvml_memory,
    peak_rss_bytes,
    static_bytes,
)
from profiler.timing import PhaseClock, PointBudget, TimingPolicy, time_iterations

SCHEMA_VERSION = 2
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MIN_MICRO_BATCH = 2
DEFAULT_TIME_CAP_S = 5.0  # profiling.time_cap_s's default
GRAD_TARGET_RSE = 0.25  # the per-point |G|^2 and tr(Sigma) are pooled over points (perfmodel.efficiency)
GRAD_MIN_ITERS = 3  # the delta-method std. error needs three
GRAD_SHARE = 0.3
TIMING_SHARE = 0.9
MEMORY_MAX_PASSES = 3


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    text = str(error).lower()
    return any(marker in text for marker in ("out of memory", "can't allocate", "cannot allocate", "std::bad_alloc"))


def squared_grad_norm(model: torch.nn.Module, scale: float = 1.0) -> float:
    total = sum(p.grad.detach().float().pow(2).sum() for p in model.parameters() if p.grad is not None)
    return float(total) / scale**2


DEFAULT_SGD_MOMENTUM = 0.9  # tula_service.spec.job_spec.DEFAULT_SGD_MOMENTUM: a request without it is an older server's
DEFAULT_ADAM_BETAS = (0.9, 0.999)  # tula_service.spec.job_spec.DEFAULT_ADAM_BETAS (PyTorch's)
# The optimizer settings a request may carry, as torch.optim names them (tula_service.spec.job_spec.OPTIMIZER_SETTING_DEFAULTS)
OPTIMIZER_SETTING_NAMES = ("momentum", "nesterov", "betas", "eps", "alpha", "centered", "amsgrad", "weight_decay", "momentum_decay",
                           "decoupled_weight_decay", "dampening")
OPTIMIZER_CLASSES = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "rmsprop": torch.optim.RMSprop,
                     "nadam": torch.optim.NAdam, "radam": torch.optim.RAdam, "adamax": torch.optim.Adamax, "adagrad": torch.optim.Adagrad,
                     "adafactor": torch.optim.Adafactor}


def make_optimizer(name: str, params, lr: float, settings: dict[str, Any] | None = None) -> torch.optim.Optimizer:
    """The spec's optimizer (SGD, Adam, AdamW, RMSprop, NAdam, RAdam, Adamax, Adagrad or Adafactor) with its settings
    (request["optimizer_settings"]: momentum, nesterov, betas, eps, alpha, centered, amsgrad, weight_decay, momentum_decay
    (NAdam), decoupled_weight_decay (NAdam, RAdam), dampening (SGD), as torch.optim names them); PyTorch's default for
    each one not given, but SGD's momentum, DEFAULT_SGD_MOMENTUM (0 for plain SGD, no momentum buffer)."""
    if name not in OPTIMIZER_CLASSES:
        raise ValueError(f"optimizer '{name}' is not supported; known: {', '.join(sorted(OPTIMIZER_CLASSES))}")
    kwargs = {key: value for key, value in (settings or {}).items() if value is not None}
    if unknown := sorted(set(kwargs) - set(OPTIMIZER_SETTING_NAMES)):
        raise ValueError(f"optimizer settings {unknown} are not known; known: {', '.join(OPTIMIZER_SETTING_NAMES)}")
    if name == "sgd":
        kwargs.setdefault("momentum", DEFAULT_SGD_MOMENTUM)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(float(beta) for beta in kwargs["betas"])
    return OPTIMIZER_CLASSES[name](params, lr=lr, **kwargs)


def optimizer_settings_used(optimizer: torch.optim.Optimizer, sources: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """The settings an optimizer trains with (its first param group), each {"value", "source"}: the request's source
    (spec or assumed), "assumed" where the request gave none (PyTorch's default, or DEFAULT_SGD_MOMENTUM). SGD reports
    momentum, nesterov, weight_decay and dampening; Adamax betas, eps and weight_decay (its group holds no more of
    OPTIMIZER_SETTING_NAMES)."""
    group = optimizer.param_groups[0]
    return {name: {"value": list(group[name]) if isinstance(group[name], tuple) else group[name], "source": (sources or {}).get(name, "assumed")}
            for name in OPTIMIZER_SETTING_NAMES if name in group and not _fixed_by_class(optimizer, name)}  # fmt: skip


def _fixed_by_class(optimizer: torch.optim.Optimizer, name: str) -> bool:
    """A group entry the optimizer's class fixes rather than the spec: torch's Adam and AdamW carry
    decoupled_weight_decay (False, True) in their groups, a setting the spec has only for NAdam and RAdam; Adafactor's
    eps is its pair (eps1, eps2), PyTorch's, not the spec's eps (the others' term added to sqrt(v))."""
    if isinstance(optimizer, torch.optim.Adafactor):
        return name == "eps"
    return name == "decoupled_weight_decay" and isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


def apply_threads(request: dict[str, Any]) -> int:
    """torch's intra-op threads for this point: request["threads"] (profiling.threads) when given, so
    profiled steps match the user's training loop (e.g. one thread); else torch's default. Returns
    the threads in use."""
    if request.get("threads"):
        torch.set_num_threads(int(request["threads"]))
    return torch.get_num_threads()


def profile_point(request: dict[str, Any]) -> dict[str, Any]:
    """Measure one batch size; see `tula_service.dispatch.jobs.point_request` for the request's keys."""
    budget = PointBudget(float(request.get("time_cap_s", DEFAULT_TIME_CAP_S)))
    started = time.perf_counter()
    threads = apply_threads(request)
    device = pick_device(request.get("device", "auto"))
    load_before = os.getloadavg()[0]
    base = {
        "schema_version": SCHEMA_VERSION,
        "kind": "compute",
        "batch_size": int(request["batch_size"]),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch_version": torch.__version__,
        "threads": threads,
        "threads_source": "spec" if request.get("threads") else "torch default",
        "options": {
            "dtype": request.get("dtype", "fp32"),
            "channels_last": bool(request.get("channels_last", False)),
            "optimizer": request.get("optimizer", "sgd"),
            "optimizer_settings": request.get("optimizer_settings"),
        },
    }
    try:
        record = {**base, "status": "ok", **_measure(request, device, budget)}
    except Exception as error:  # noqa: BLE001 - an OOM is data; anything else is re-raised
        if not is_out_of_memory(error):
            raise
        record = {**base, "status": "oom", "error": f"{type(error).__name__}: {str(error)[:500]}"}
    record["elapsed_s"] = time.perf_counter() - started
    record["host_load"] = host_load(load_before)
    record["budget"] = {**budget.report(), "passes": passes_report(record)}
    return record


def passes_report(record: dict[str, Any]) -> dict[str, Any]:
    """Iterations each pass ran and why it stopped (empty for an out-of-memory point)."""
    if record.get("status") != "ok":
        return {}
    timing, memory, gradient = record["iter_time"], record["memory"], record.get("gradient")
    return {
        "gradient": {"iterations": gradient["iterations"], "stopped_by": gradient["stopped_by"]} if gradient else None,
        "warmup": {"iterations": timing["warmup_iters"], "stopped_by": timing["warmup_stopped_by"]},
        "timing": {"iterations": timing["count"], "stopped_by": timing["stopped_by"]},
        "memory": {"iterations": memory["passes"], "stopped_by": memory["stopped_by"]},
    }


def host_load(load_before: float) -> dict[str, Any]:
    """The 1-minute load average around the point, against the cores: CPU timings taken while other
    processes compete are slow and can still look steady (OpenMP threads wait on each other)."""
    cores = os.cpu_count() or 1
    load_after = os.getloadavg()[0]
    return {
        "load_1min_before": load_before,
        "load_1min_after": load_after,
        "cores": cores,
        "contended": max(load_before, load_after) > cores,
    }


class Trainer:
    """One training step of a workload with the requested precision, layout and optimizer."""

    def __init__(self, workload: Workload, request: dict[str, Any], device: torch.device):
        self.workload = workload
        self.device = device
        self.channels_last = bool(request.get("channels_last", False)) and workload.input_kind == "image"
        self.model = workload.model.to(device)
        if self.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.optimizer = make_optimizer(request.get("optimizer", "sgd"), self.model.parameters(), float(request.get("lr", 0.01)),
                                        request.get("optimizer_settings"))  # fmt: skip
        dtype = request.get("dtype", "fp32")
        self.autocast_dtype = AUTOCAST_DTYPES.get(dtype)
        self.scaler = torch.amp.GradScaler("cuda") if dtype == "fp16" and device.type == "cuda" else None

    def to_device(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = inputs.to(self.device, non_blocking=True)
        if self.channels_last and inputs.dim() == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return inputs, targets.to(self.device, non_blocking=True)

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            return self.workload.loss_fn(self.model(inputs), targets)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self) -> None:
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    @property
    def grad_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler else 1.0


def _timing_policy(request: dict[str, Any], time_cap_s: float) -> TimingPolicy:
    policy = TimingPolicy()
    policy.min_warmup_iters = int(request.get("warmup_iters", policy.min_warmup_iters))
    policy.min_iters = int(request.get("timed_iters", policy.min_iters))
    policy.target_cv = float(request.get("target_cv", policy.target_cv))
    policy.target_median_rse = float(request.get("target_median_rse", policy.target_median_rse))
    policy.time_cap_s = time_cap_s
    return policy


def _measure(request: dict[str, Any], device: torch.device, budget: PointBudget) -> dict[str, Any]:
    phase_started = time.perf_counter()
    batch_size = int(request["batch_size"])
    seed = int(request.get("seed", 0))
    torch.manual_seed(seed)
    workload = build_workload(request)
    trainer = Trainer(workload, request, device)
    rss_before_bytes = peak_rss_bytes()
    limit = apply_memory_limit(request.get("memory_limit_bytes"), device)
    data_gen = torch.Generator().manual_seed(seed + batch_size)

    budget.spent("setup", phase_started)

    # Gradient statistics first: they then start from the seeded weights whatever the timing does.
    phase_started = time.perf_counter()
    gradient = _gradient_statistics(trainer, workload, batch_size, data_gen, request, budget.share_s(GRAD_SHARE))
    budget.spent("gradient", phase_started)
    host_batches = [workload.data.batch(batch_size, data_gen) for _ in range(2)]
    iteration = {"index": 0}

    def timed_step(clock: PhaseClock) -> None:
        inputs, targets = host_batches[iteration["index"] % 2]
        iteration["index"] += 1
        clock.mark()
        inputs, targets = trainer.to_device(inputs, targets)
        clock.mark()
        loss = trainer.loss(inputs, targets)
        clock.mark()
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.backward(loss)
        clock.mark()
        trainer.step()
        clock.mark()

    phase_started = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    timing = time_iterations(timed_step, device, _timing_policy(request, budget.share_s(TIMING_SHARE)))
    budget.spent("timing", phase_started)
    phase_started = time.perf_counter()
    memory = _memory(trainer, host_batches[0], device, budget)
    budget.spent("memory", phase_started)
    memory["limit"] = limit
    if device.type == "cpu":  # the process's real peak, allocator slack and backward temporaries included
        memory["process_rss"] = {"peak_bytes": peak_rss_bytes(), "peak_before_training_bytes": rss_before_bytes}
    params = list(trainer.model.parameters())
    return {
        "iter_time": timing.summary(),
        "memory": memory,
        "gradient": gradient,
        "model": {
            "parameter_count": int(sum(p.numel() for p in params)),
            "gradient_bytes": int(sum(p.numel() * p.element_size() for p in params if p.requires_grad)),
            "input_kind": workload.input_kind,
            "tokens_per_sample": workload.tokens_per_sample,
        },
    }


def _saved_activation_bytes(trainer: Trainer, host_batch) -> int:
    """Bytes autograd saves for backward in one forward pass (the graph is dropped, not run)."""
    counter = SavedActivationCounter(trainer.model)
    inputs, targets = trainer.to_device(*host_batch)
    with counter.hooks():
        loss = trainer.loss(inputs, targets)
    del loss
    return counter.bytes


def _memory(trainer: Trainer, host_batch, device: torch.device, budget: PointBudget) -> dict[str, Any]:
    """Static bytes, and activation bytes from counting passes repeated until two agree (a model whose
    saved tensors change between passes, e.g. lazily built buffers, is counted again), within the
    point's time left (at least one pass); on CUDA the peak is the allocator's over the timed steps."""
    static = static_bytes(trainer.model, trainer.optimizer)
    static_total = sum(static.values())
    counts: list[int] = []
    stopped_by = "max_passes"
    while len(counts) < MEMORY_MAX_PASSES:
        pass_started = time.perf_counter()
        counts.append(_saved_activation_bytes(trainer, host_batch))
        if len(counts) >= 2 and counts[-1] == counts[-2]:
            stopped_by = "unchanged"
            break
        if budget.left_s() < time.perf_counter() - pass_started:
            stopped_by = "time_cap"
            break
    memory: dict[str, Any] = {
        "static_bytes": static_total,
        "static_breakdown_bytes": static,
        "activation_bytes": counts[-1],
        "passes": len(counts),
        "stopped_by": stopped_by,
        "cuda": cuda_memory(device),
        "nvml": nvml_memory(device),
    }
    if device.type == "cuda":
        memory["peak_bytes"] = memory["cuda"]["max_allocated_bytes"]
        memory["peak_source"] = "torch.cuda.max_memory_allocated over the timed iterations"
    else:
        memory["peak_bytes"] = static_total + counts[-1]
        memory["peak_source"] = "static + saved-for-backward activations (de-duplicated by storage)"
    return memory


def _gradient_statistics(
    trainer: Trainer, workload: Workload, batch_size: int, data_gen, request, seconds_s: float
) -> dict[str, Any] | None:
    """k micro-batch gradients and their mean (the full-batch gradient) per iteration, then a step;
    until the estimate has settled (GRAD_TARGET_RSE), `seconds_s` are spent or grad_iters are done,
    never fewer than GRAD_MIN_ITERS (or grad_iters when smaller).

    Micro-batches keep at least MIN_MICRO_BATCH samples (batch norm needs two values per channel),
    so small batches use fewer micro-batches; below 2 x MIN_MICRO_BATCH there is no estimate.
    """
    max_iters = int(request.get("grad_iters", 8))
    microbatches = min(int(request.get("grad_microbatches", 4)), batch_size // MIN_MICRO_BATCH)
    if microbatches < 2 or max_iters < 1:
        return None
    min_iters = min(GRAD_MIN_ITERS, max_iters)
    target_rse = float(request.get("grad_target_rse", GRAD_TARGET_RSE))
    started = time.perf_counter()
    stopped_by = "max_iters"
    micro_batch = batch_size // microbatches
    estimator = GradientNoiseEstimator()
    model = trainer.model
    for iteration in range(1, max_iters + 1):
        inputs, targets = trainer.to_device(*workload.data.batch(micro_batch * microbatches, data_gen))
        micro_sq_norms = []
        summed = None
        for index in range(microbatches):
            piece = slice(index * micro_batch, (index + 1) * micro_batch)
            trainer.optimizer.zero_grad(set_to_none=True)
            trainer.backward(trainer.loss(inputs[piece], targets[piece]))
            micro_sq_norms.append(squared_grad_norm(model, trainer.grad_scale))
            grads = [p.grad.detach().clone() if p.grad is not None else None for p in model.parameters()]
            summed = grads if summed is None else [a + b if a is not None else None for a, b in zip(summed, grads)]
        for param, total in zip(model.parameters(), summed):
            param.grad = None if total is None else total / microbatches
        full_sq_norm = squared_grad_norm(model, trainer.grad_scale)
        estimator.update(micro_sq_norms, full_sq_norm, micro_batch, micro_batch * microbatches)
        trainer.step()
        if iteration < min_iters:
            continue
        if estimator.settled(target_rse):
            stopped_by = "settled"
            break
        if time.perf_counter() - started >= seconds_s:
            stopped_by = "time_cap"
            break
    return {
        **estimator.summary(micro_batch, micro_batch * microbatches),
        "stopped_by": stopped_by,
        "target_rse": target_rse,
        "max_iterations": max_iters,
        "elapsed_s": time.perf_counter() - started,
    }
