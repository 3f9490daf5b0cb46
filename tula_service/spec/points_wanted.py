"""Which profiling points a job queues, given the measurements it has.

A job from POST /v1/jobs queues a compute point per batch of `batch_sizes`, the all-reduce benchmark
when the cluster has more than one device (`JobSpec.measures_communication`) and a pilot when asked.
A job from POST /v1/jobs/from-measurements starts from the measurements the user supplied and, with
`profile = "missing"` (the request's), queues only what they do not cover:

- a compute point at a batch that has no supplied compute record (ok or out of memory) at that batch;
- the all-reduce benchmark when no comm record and no multi-device step was supplied (measured steps
  fit the placement model, which needs no benchmark);
- the pilot when asked and no pilot record was supplied;
- the data-parallel steps of `profiling.step_placements` not supplied (`steps_due`).

With `profile = "none"` nothing is queued: the job plans from the supplied measurements alone. A job whose
points are all supplied ones is planned as it is, with no probe, retime or step point added later
(tula_service.dispatch.jobs.advance).

Step points run at a batch that ran, so a job that profiles compute points queues them once those are in
(`steps_due`, from `advance`); one whose compute points were all supplied queues them at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

from tula_service.spec.job_spec import JobSpec

Profile = Literal["missing", "none"]
Wanted = tuple[str, int | None, list[int] | None]  # (kind, batch, a step point's placement)


def points_wanted(spec: JobSpec, supplied: Sequence[Any] = (), profile: Profile = "missing") -> list[Wanted]:
    """The points to queue at submission; `supplied` are parsed Measurements."""
    if profile == "none":
        return []
    measured_batches = {m.batch_size for m in supplied if m.kind in ("compute", "retime")}
    has_comm = any(m.kind == "comm" for m in supplied)
    has_multi_device_step = any(m.kind == "step" and m.ok and m.devices > 1 for m in supplied)
    has_pilot = any(m.kind == "pilot" for m in supplied)
    points: list[Wanted] = [("grid", b, None) for b in spec.batch_sizes if b not in measured_batches]
    if spec.measures_communication() and not (has_comm or has_multi_device_step):
        points.append(("comm", None, None))
    if spec.profiling.pilot and not has_pilot:
        points.append(("pilot", spec.training.reference_batch, None))
    if not any(kind == "grid" for kind, _, _ in points):
        points += [("step", batch, placement) for placement, batch in steps_due(spec, supplied, [])]
    return points


def step_batch(batches: Sequence[int]) -> int:
    """The per-device batch of the step points: of the batches that ran, the one nearest the middle of
    their range on a log scale (large enough that compute is not all latency, and known to fit)."""
    ordered = sorted(batches)
    middle = math.sqrt(ordered[0] * ordered[-1])
    return min(ordered, key=lambda b: (abs(math.log(b / middle)), -b))


def steps_due(spec: JobSpec, measurements: Sequence[Any], queued: Sequence[list[int]]) -> list[tuple[list[int], int]]:
    """(placement, per-device batch) of the step points to queue: each of `profiling.step_placements` not yet
    queued nor measured (at any batch); none before a compute point has run."""
    if not spec.profiling.step_placements:
        return []
    ran = [m.batch_size for m in measurements if m.kind in ("compute", "retime") and m.ok]
    if not ran:
        return []
    known = {tuple(m.placement) for m in measurements if m.kind == "step"} | {tuple(p) for p in queued}
    batch = step_batch(ran)
    return [(placement, batch) for placement in spec.profiling.step_placements if tuple(placement) not in known]
