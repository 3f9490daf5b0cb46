"""A job's life after submission: which task runs next, and fitting once the measurements are in."""

from __future__ import annotations

import logging

from tula_service import lifecycle
from tula_service.dispatch.maxbatch import next_probe
from tula_service.dispatch.reliability import points_to_retime
from tula_service.fit.fitting import fit_models
from tula_service.measurement import ComputeMeasurement, Measurement, parse_measurement
from tula_service.plan.recommend import NotEnoughMeasurements, plan, usable_measurements
from tula_service.settings import environment
from tula_service.spec.job_spec import JobSpec, allowed_model_modules
from tula_service.spec.points_wanted import steps_due
from tula_service.store.db import Job
from tula_service.store.job_store import Store
from tula_service.store.states import ACTIVE_JOB_STATES
from tula_service.units import GIB

log = logging.getLogger(__name__)

MIN_COMM_MAX_BYTES = 4 * 2**20  # below this, small models' all-reduces are latency-bound: bandwidth unresolved
# One batch size timed and sized ("retime": once more, when the first was noisy); "pilot" trains, "comm" all-reduces,
# "step" times a data-parallel step on several devices, "given" holds a supplied measurement (never run).
COMPUTE_POINT_KINDS = ("grid", "search", "retime")
DEFAULT_LR = 0.01  # the LR points train with when the spec gives no training.reference_lr


def point_request(spec: JobSpec, batch_size: int) -> dict:
    """The plain-JSON request a profiling child process receives for one compute point."""
    profiling = spec.profiling
    return {
        "model": spec.model,
        "model_options": spec.model_options,
        "initial_weights": spec.initial_weights,
        "dataset": spec.dataset.model_dump(mode="json", exclude_none=True),
        "loss": spec.loss,
        "allowed_model_modules": allowed_model_modules(),
        "data_roots": environment().data_roots,
        "batch_size": batch_size,
        "warmup_iters": profiling.warmup_iters,
        "timed_iters": profiling.timed_iters,
        "target_cv": profiling.target_cv,
        "target_median_rse": profiling.target_median_rse,
        "time_cap_s": profiling.time_cap_s,
        "grad_microbatches": profiling.grad_microbatches,
        "grad_iters": profiling.grad_iters,
        "dtype": profiling.dtype,
        "channels_last": profiling.channels_last,
        "optimizer": spec.training.optimizer,
        "optimizer_settings": {name: setting["value"] for name, setting in spec.training.optimizer_settings().items()},
        "lr": spec.training.reference_lr or DEFAULT_LR,
        "memory_limit_bytes": int(profiling.memory_limit_gib * GIB) if profiling.memory_limit_gib else None,
        "device": profiling.device,
        "seed": profiling.seed,
        "threads": profiling.threads,
    }


def pilot_request(spec: JobSpec) -> dict:
    """The request of the pilot point (`profiler.pilot.run_pilot`): training at the reference batch with
    the spec's optimizer and LR, within the pilot's step and time budget. The LR says whether it came
    from the spec or is the points' assumed default."""
    profiling, training = spec.profiling, spec.training
    return {
        **point_request(spec, training.reference_batch),
        "kind": "pilot",
        "lr_source": "spec" if training.reference_lr else "assumed",
        "optimizer_setting_sources": {name: setting["source"] for name, setting in training.optimizer_settings().items()},
        "pilot_steps": profiling.pilot_steps,
        "pilot_seconds": profiling.pilot_seconds,
        "pilot_record_every": profiling.pilot_record_every,
    }


def step_request(spec: JobSpec, placement: list[int], device_batch: int) -> dict:
    """The request of a data-parallel step point (`profiler.ddp_step.measure_step` on one node,
    `profiler.ray_group.measure_step_on_actors` across nodes): the compute point's request at the per-device
    batch, on `placement` (GPUs used on each node; NCCL on GPUs, else gloo ranks)."""
    return {**point_request(spec, device_batch), "kind": "step", "placement": list(placement), "backend": "auto"}


def comm_command_args(job: Job) -> list[str]:
    """Arguments of `python -m profiler.comm` for a job: message sizes up to its gradient size, and
    at least MIN_COMM_MAX_BYTES so both latency and bandwidth can be fitted (the benchmark caps
    gloo runs at 4 MiB itself)."""
    gradient_bytes = [
        parse_measurement(p.measurement).model.gradient_bytes
        for p in job.points
        if p.state == "done" and p.kind in COMPUTE_POINT_KINDS and p.measurement
    ]
    max_bytes = max([MIN_COMM_MAX_BYTES, *gradient_bytes])
    return ["--max-bytes", str(max_bytes), "--backend", "auto"]


def _predicted_max_batch(spec: JobSpec, ok: list[ComputeMeasurement]) -> int | None:
    """Largest batch the plan's memory model (fitted as `plan` fits it) says fits the profiling device's
    limit (when one is known): the point estimate, no margin, as the search is to find the limit."""
    limit = spec.profiling.memory_limit_gib * GIB if spec.profiling.memory_limit_gib else None
    nvml_totals = [m.memory.device_total_bytes for m in ok if m.memory.device_total_bytes]
    capacity = limit or (min(nvml_totals) if nvml_totals else None)
    if capacity is None or len(ok) < 2:
        return None
    models, _ = fit_models(spec, ok)
    return models.memory.max_device_batch(capacity, margin=0.0)


def advance(store: Store, job_id: str) -> bool:
    """Called when a task of the job ends. Queues the next search probe if one is due (True), or
    fits and plans once every task is finished."""
    if not store.job_points_finished(job_id):
        return False
    job = store.get_job(job_id)
    if job is None or job.state not in ACTIVE_JOB_STATES:
        return False
    spec = job.parsed_spec
    if all(p.kind == "given" for p in job.points):  # supplied measurements alone: planned as they are
        finish_job(store, job)
        lifecycle.job_finished(store.get_job(job_id))
        return False
    measurements = parsed_measurements(job)
    ok, oom = usable_measurements(measurements)
    if spec.profiling.search_max_batch:
        probes_done = sum(p.kind == "search" for p in job.points)
        predicted = _predicted_max_batch(spec, ok)
        probe = next_probe([m.batch_size for m in ok], oom, predicted, probes_done, spec.profiling.max_search_probes)
        if probe is not None:
            store.add_point(job_id, "search", probe)
            return True
    retimed = [p.batch_size for p in job.points if p.kind == "retime"]
    supplied = {p.batch_size for p in job.points if p.kind == "given"}  # the user's numbers: not ours to time again
    due = [b for b in points_to_retime(ok, retimed) if b not in supplied]
    if due:
        log.info("job %s: timing batches %s again (noisy or off the step-time model)", job_id, due)
        for batch in due:
            store.add_point(job_id, "retime", batch)
        return True
    steps = steps_due(spec, measurements, [p.placement for p in job.points if p.kind == "step" and p.placement])
    if steps:
        for placement, batch in steps:
            store.add_point(job_id, "step", batch, placement)
        return True
    finish_job(store, job)
    lifecycle.job_finished(store.get_job(job_id))
    return False


def parsed_measurements(job: Job) -> list[Measurement]:
    """A job's measurements (plan_inputs), parsed (tula_service.measurement)."""
    return [parse_measurement(m) for m in plan_inputs(job)[0]]


def plan_inputs(job: Job) -> tuple[list[dict], list[dict]]:
    """A job's measurements (points done or out of memory) and its failed points, for planning."""
    measurements = [p.measurement for p in job.points if p.state in ("done", "oom") and p.measurement]
    failed = [
        {"kind": p.kind, "batch_size": p.batch_size, "error": p.error, "attempts": p.attempts,
         "attempt_errors": p.attempt_errors or []}
        for p in job.points
        if p.state == "failed"
    ]
    return measurements, failed


def failed_points_text(failed: list[dict]) -> str:
    """The failed points grouped by error, so one cause shared by five points is said once:
    "grid points at batch 8, 16, 32: <error>"."""
    by_error: dict[str, list[str]] = {}
    for point in failed:
        where = f"{point['kind']} {point['batch_size']}" if point["batch_size"] else point["kind"]
        by_error.setdefault(point["error"] or "no error recorded", []).append(where)
    return "; ".join(f"{', '.join(points)}: {error}" for error, points in by_error.items())


def finish_job(store: Store, job: Job) -> None:
    store.set_job_state(job.id, "fitting")
    spec = job.parsed_spec
    measurements, failed = plan_inputs(job)
    try:
        recommendation = plan(spec, measurements, failed)
    except NotEnoughMeasurements as error:
        details = failed_points_text(failed)
        store.set_job_state(job.id, "failed", error=f"{error}" + (f". Failed points: {details}" if details else ""))
        return
    except Exception as error:  # a bug in fitting fails this job, not the executor
        log.exception("fitting job %s failed", job.id)
        store.set_job_state(job.id, "failed", error=f"fitting failed: {type(error).__name__}: {error}")
        return
    store.set_job_state(job.id, "done", recommendation=recommendation)
