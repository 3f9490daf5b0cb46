"""A multi-device training step: the measured rows behind the placement-aware step-time model.

`measure_step(request)` runs one data-parallel training step of the job's model in
`world_size = sum(request["placement"])` processes on this host (`profiler.comm.run_on_ranks`: one
NCCL rank per CUDA device, spawned, or gloo CPU ranks, forked, as request["device"] picks), each
with `request["batch_size"]` samples of its own, and returns a
`tula_service.measurement.StepMeasurement` record (kind "step").

Each rank builds the workload as a compute point does (`models.workload.build_workload`, stepped by
`profiler.measure.Trainer`) with the model wrapped in DistributedDataParallel, and alternates

    (a) a synchronized step: data to device, forward, backward (DDP all-reduces the gradients in
        buckets while backward runs), optimizer step;
    (b) a local step: the same under `model.no_sync()`, so backward all-reduces nothing.

Every timed step starts at a barrier (outside the clock), so an iteration's time runs from a common
start to its slowest rank's end: the max over ranks. Then

    step_time_s       = median over iterations of (a)
    local_step_time_s = median over iterations of (b)
    sync_time_s       = max(0, step_time_s - local_step_time_s), strictly below step_time_s

sync_time_s is the all-reduce's exposed part, the seconds the step waits on it, not its full
duration: DDP overlaps the all-reduce of each bucket with the backward of the layers before it
(Li et al. 2020, "PyTorch Distributed", section 3.2.3). The local step's optimizer step lets the
ranks' weights drift apart, which changes no timing.

Iterations: `warmup_iters` (default 3, at least 1: DDP rebuilds its buckets after the first
iteration) warm-up pairs of (a) and (b), then `timed_iters` (default 10) timed pairs, fewer (never
below MIN_TIMED_ITERS) when the warm-up pairs' pace says `time_cap_s` (default 30 s, counted from
the call) would run out. The ranks agree on that count before timing, since every rank must run the
same number of all-reduces. The launch's own timeout is the cap plus LAUNCH_ALLOWANCE_S (starting
ranks, building the model).

Failures are data: a rank out of memory gives status "oom" with its error; any other rank failure
raises (`profiler.run_point` writes it as a "failed" record). Cross-node placements run through the
Ray executor, not here.
"""

from __future__ import annotations

import math
import platform
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from models.workload import build_workload
from profiler.comm import RankFailure, resolve_backend, run_on_ranks, start_method
from profiler.measure import Trainer, apply_threads, is_out_of_memory, pick_device
from profiler.memory import apply_memory_limit

SCHEMA_VERSION = 1
DEFAULT_WARMUP_ITERS = 3
DEFAULT_TIMED_ITERS = 10
MIN_TIMED_ITERS = 3
DEFAULT_TIME_CAP_S = 30.0
LAUNCH_ALLOWANCE_S = 120.0  # beyond the cap: starting (spawning) ranks and building the model
ERROR_CHARS = 500
SYNC_TIME_NOTE = (
    "sync_time_s = synchronized step - no_sync step (medians): the all-reduce's exposed part, "
    "not its full duration, since DDP overlaps it with backward"
)


def measure_step(request: dict[str, Any]) -> dict[str, Any]:
    """Measure one data-parallel step on request["placement"] (one node); see the module docstring.
    Request keys: placement, batch_size, backend, device, warmup_iters, timed_iters, time_cap_s,
    threads, memory_limit_bytes, seed, and the workload's (model, model_options, dataset,
    allowed_model_modules, data_roots) and the Trainer's (optimizer, lr, dtype, channels_last)."""
    started = time.monotonic()
    placement = [int(devices) for devices in request["placement"]]
    if len(placement) != 1 or placement[0] < 1:
        raise ValueError(
            f"placement {placement} is not one node: the profiler measures steps on this host only "
            "(e.g. [2]); cross-node steps run through the Ray executor, not here"
        )
    world_size, device_batch = placement[0], int(request["batch_size"])
    backend = _backend(request, world_size)
    warmup_iters, wanted_iters, time_cap_s = timed_iterations(request)
    base = record_base(placement, device_batch, backend, f"{start_method(backend)}ed_processes")
    try:
        deadline_s = started + time_cap_s  # time.monotonic is one clock for every process of this host
        args = (request, warmup_iters, wanted_iters, deadline_s)
        ranks = run_on_ranks(rank_step, world_size, backend, args, time_cap_s + LAUNCH_ALLOWANCE_S)
    except RankFailure as error:
        if not is_out_of_memory(error):
            raise RankFailure(last_line(error)) from error  # the rank's own error first; its traceback as the cause
        return {**base, "status": "oom", "error": last_line(error), "elapsed_s": time.monotonic() - started}
    return finished_record(base, ranks[0], request, time.monotonic() - started)


def timed_iterations(request: dict[str, Any]) -> tuple[int, int, float]:
    """(warm-up pairs, timed pairs wanted, time cap in seconds) of a step request (module docstring)."""
    warmup_iters = max(1, int(request.get("warmup_iters", DEFAULT_WARMUP_ITERS)))
    wanted_iters = int(request.get("timed_iters", DEFAULT_TIMED_ITERS))
    if wanted_iters < 1:
        raise ValueError(f"timed_iters must be at least 1, got {wanted_iters}")
    return warmup_iters, wanted_iters, float(request.get("time_cap_s", DEFAULT_TIME_CAP_S))


def record_base(placement: list[int], device_batch: int, backend: str, launcher: str) -> dict[str, Any]:
    """The fields every step record has, ok or out of memory."""
    return {"schema_version": SCHEMA_VERSION, "kind": "step", "placement": placement, "device_batch": device_batch,
            "origin": "profiler", "backend": backend, "world_size": sum(placement), "launcher": launcher}  # fmt: skip


def finished_record(base: dict[str, Any], timing: dict[str, Any], request: dict[str, Any], elapsed_s: float) -> dict[str, Any]:
    """An "ok" step record from rank 0's timings (every rank returns the same: the max over ranks)."""
    warmup_iters, wanted_iters, time_cap_s = timed_iterations(request)
    stopped_by = "time_cap" if timing["timed_iters"] < wanted_iters else "timed_iters"
    return {**base, "status": "ok", **_summary(timing), "warmup_iters": warmup_iters, "stopped_by": stopped_by,
            "time_cap_s": time_cap_s, "elapsed_s": elapsed_s}  # fmt: skip


def _backend(request: dict[str, Any], world_size: int) -> str:
    """request["backend"] "gloo" or "nccl" as given; "auto" (the default) follows the request's device as
    a compute point picks it (`pick_device`), so the step runs where the compute points ran: NCCL with one
    rank per CUDA device, or gloo with CPU ranks (not comm's rule, gloo on a host with one CUDA device)."""
    backend = request.get("backend", "auto")
    if backend == "auto":
        backend = "nccl" if pick_device(request.get("device", "auto")).type == "cuda" else "gloo"
    backend = resolve_backend(backend)
    if backend == "nccl" and world_size > torch.cuda.device_count():
        devices = torch.cuda.device_count()
        raise ValueError(f"placement [{world_size}] needs {world_size} CUDA devices; this host has {devices}")
    return backend


def last_line(error: RankFailure) -> str:
    """'rank N failed: <the exception line>' from a RankFailure's message and traceback."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{lines[0]} {lines[-1].strip()}"[:ERROR_CHARS] if len(lines) > 1 else str(error)[:ERROR_CHARS]


def _summary(timing: dict[str, Any]) -> dict[str, Any]:
    step_time_s = float(np.median(timing["iter_times_s"]["sync"]))
    local_step_time_s = float(np.median(timing["iter_times_s"]["local"]))
    sync_time_s = min(max(0.0, step_time_s - local_step_time_s), math.nextafter(step_time_s, 0.0))
    return {"step_time_s": step_time_s, "sync_time_s": sync_time_s, "local_step_time_s": local_step_time_s,
            "sync_time_note": SYNC_TIME_NOTE, **timing}  # fmt: skip


def rank_step(
    rank: int, world_size: int, device: torch.device, request: dict[str, Any], warmup_iters: int, wanted_iters: int,
    deadline_s: float,
) -> dict[str, Any]:
    """One rank's part, in a process group already formed (by `run_on_ranks`, or a Ray actor of
    `profiler.ray_group`); every rank returns the same timings (max over ranks). `deadline_s` is on this
    process's time.monotonic clock."""
    threads = apply_threads(request)
    seed = int(request.get("seed", 0))
    torch.manual_seed(seed + rank)
    workload = build_workload(request)  # the same seeded weights on every rank; DDP broadcasts rank 0's anyway
    trainer = Trainer(workload, request, device)
    trainer.model = DistributedDataParallel(trainer.model, device_ids=[device.index] if device.type == "cuda" else None)
    memory_limit = apply_memory_limit(request.get("memory_limit_bytes"), device)
    batch_size = int(request["batch_size"])
    data_gen = torch.Generator().manual_seed(seed + batch_size + rank)  # rank 0 draws a compute point's batches
    host_batches = [workload.data.batch(batch_size, data_gen) for _ in range(2)]

    def step(index: int, synchronized: bool) -> float:
        """Seconds of one step, started at a barrier, after the device has finished it."""
        inputs, targets = host_batches[index % 2]
        dist.barrier()
        _synchronize(device)
        started = time.perf_counter()
        inputs, targets = trainer.to_device(inputs, targets)
        trainer.optimizer.zero_grad(set_to_none=True)
        if synchronized:
            trainer.backward(trainer.loss(inputs, targets))
        else:
            with trainer.model.no_sync():
                trainer.backward(trainer.loss(inputs, targets))
        trainer.step()
        _synchronize(device)
        return time.perf_counter() - started

    pair_times_s = []
    for index in range(warmup_iters):
        pair_started = time.perf_counter()
        step(index, True)
        step(index, False)
        pair_times_s.append(time.perf_counter() - pair_started)
    timed_iters = _agreed_timed_iters(wanted_iters, float(np.median(pair_times_s)), deadline_s, device)
    pairs_s = [(step(index, True), step(index, False)) for index in range(timed_iters)]
    slowest_s = torch.tensor(pairs_s, dtype=torch.float64, device=device)  # timing is over: gather now
    dist.all_reduce(slowest_s, op=dist.ReduceOp.MAX)
    sync_s, local_s = slowest_s.T.cpu().tolist()
    return {
        "iter_times_s": {"sync": sync_s, "local": local_s},
        "timed_iters": timed_iters,
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "threads": threads,
        "memory_limit": memory_limit,
        "torch_version": torch.__version__,
    }


def _agreed_timed_iters(wanted: int, pair_time_s: float, deadline_s: float, device: torch.device) -> int:
    """`wanted` pairs, or as many as fit before the deadline at the warm-up's pace (at least
    MIN_TIMED_ITERS); the fewest any rank allows, so every rank runs the same all-reduces."""
    fitting = math.floor(max(0.0, deadline_s - time.monotonic()) / max(pair_time_s, 1e-9))
    count = torch.tensor([min(wanted, max(MIN_TIMED_ITERS, fitting))], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    return int(count.item())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
