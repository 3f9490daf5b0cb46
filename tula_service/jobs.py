"""What happens to a job once its points are measured: fit, plan, store the recommendation."""

from __future__ import annotations

import logging

from tula_service.recommend import NotEnoughMeasurements, plan
from tula_service.spec import JobSpec
from tula_service.store import Store

log = logging.getLogger(__name__)


def point_request(spec: JobSpec, batch_size: int) -> dict:
    """The plain-JSON request a profiling child process receives for one point."""
    return {
        "model": spec.model,
        "dataset": spec.dataset.model_dump(mode="json"),
        "batch_size": batch_size,
        "warmup_iters": spec.profiling.warmup_iters,
        "timed_iters": spec.profiling.timed_iters,
        "grad_draws": spec.profiling.grad_draws,
        "device": spec.profiling.device,
        "seed": spec.profiling.seed,
    }


def finish_job(store: Store, job_id: str) -> None:
    job = store.get_job(job_id)
    if job is None or job.state in ("done", "failed"):
        return
    store.set_job_state(job_id, "fitting")
    spec = JobSpec.model_validate(job.spec)
    measurements = [p.measurement for p in job.points if p.state in ("done", "oom") and p.measurement]
    failed = [{"batch_size": p.batch_size, "error": p.error, "attempts": p.attempts} for p in job.points if p.state == "failed"]
    try:
        recommendation = plan(spec, measurements, failed)
    except NotEnoughMeasurements as error:
        details = "; ".join(f"batch {f['batch_size']}: {f['error']}" for f in failed)
        store.set_job_state(job_id, "failed", error=f"{error}" + (f". Failed points: {details}" if details else ""))
        return
    except Exception as error:  # a bug in fitting fails this job, not the executor
        log.exception("fitting job %s failed", job_id)
        store.set_job_state(job_id, "failed", error=f"fitting failed: {type(error).__name__}: {error}")
        return
    store.set_job_state(job_id, "done", recommendation=recommendation)
