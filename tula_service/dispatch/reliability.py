"""Whether a profile can be trusted: re-time noisy points once, then say plainly when it still cannot.

On a busy host the iteration times of a point scatter (std/mean of 24-158% has been seen) and the
compute model fitted to them mispredicts held-out points by 75%; a recommendation built on that is a
guess. Two measured signals decide, both already in the record:

- a point's spread: the robust coefficient of variation of its timed iterations, 1.4826 MAD / median
  (`iter_time.robust_cv`; the plain std / mean for an older record without one). The models fit the
  median, and on a shared host a few iterations in a hundred wait 10x longer on another process: that
  moves the std / mean to 60-120% while the median and the MAD stay put, and judging by it re-timed
  nearly every point of a clean profile;
- the compute model's leave-one-out error: |T_fit-without-i(b_i) - T(b_i)| / T(b_i), per point.

Policy:
1. `points_to_retime`: before fitting, a grid or search point whose spread passes `POINT_CV_LIMIT`, or
   whose leave-one-out error passes `LOO_LIMIT` (with at least `MIN_POINTS_FOR_LOO` points: left out
   of three, a point is judged by a line through two, which says little), is timed again, once per
   batch size (a "retime" point). Of two measurements of a batch the planner uses the quieter one.
2. `assess`: after fitting, the recommendation is "unreliable: re-profile on a quiet host" when the
   compute model's median leave-one-out error still passes `LOO_LIMIT` (again with at least
   `MIN_POINTS_FOR_LOO` points), or when more than half of the points it used still pass
   `POINT_CV_LIMIT`. Host contention (load average above the core count, `host_load.contended`) is
   named as the likely cause when the points report it.

The limits are where a step-time error starts to move the pick: the knee moves by a power of two
when two neighbouring candidates' times are misjudged by about their ratio's distance, ~25%.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tula_service.fit.perfmodel.compute import select_compute_model
from tula_service.fit.perfmodel.validation import leave_one_out_relative_errors
from tula_service.measurement import ComputeMeasurement, parse_measurement

POINT_CV_LIMIT = 0.25
LOO_LIMIT = 0.25
RETIMES_PER_BATCH = 1
MIN_POINTS_FOR_LOO = 5
UNRELIABLE = "unreliable: re-profile on a quiet host"


Point = ComputeMeasurement | dict[str, Any]  # parsed, or a stored record (parsed on the way in)


def iter_time_spread(point: ComputeMeasurement) -> float | None:
    """The point's robust CV (the CV for an older record), or None without a timing."""
    return point.iter_time.spread if point.iter_time else None


def quieter(first: ComputeMeasurement, second: ComputeMeasurement) -> ComputeMeasurement:
    """Of two measurements of one batch, the one with the lower spread (the later one on a tie or without one)."""
    cv_first, cv_second = iter_time_spread(first), iter_time_spread(second)
    if cv_first is not None and cv_second is not None and cv_first < cv_second:
        return first
    return second


def _loo_errors(ok: list[ComputeMeasurement]) -> list[float]:
    batch = np.array([m.batch_size for m in ok], dtype=float)
    iter_time_s = np.array([m.iter_time.median_s for m in ok], dtype=float)
    if batch.size < MIN_POINTS_FOR_LOO:
        return []
    model, _ = select_compute_model(batch, iter_time_s)
    return leave_one_out_relative_errors(type(model), batch, iter_time_s)


def points_to_retime(ok: list[Point], retimed_batches: list[int]) -> list[int]:
    """Batch sizes to time once more: noisy (CV) or off the model (leave-one-out), not yet re-timed."""
    points = [parse_measurement(m) for m in ok]
    loo = _loo_errors(points)
    due = []
    for index, point in enumerate(points):
        if retimed_batches.count(point.batch_size) >= RETIMES_PER_BATCH:
            continue
        cv = iter_time_spread(point)
        if (cv is not None and cv > POINT_CV_LIMIT) or (loo and loo[index] > LOO_LIMIT):
            due.append(point.batch_size)
    return due


def assess(ok: list[Point], compute_loo: dict[str, Any], retimed_batches: list[int]) -> dict[str, Any]:
    """The recommendation's `reliability`: verdict, reasons with their numbers, thresholds, what was re-timed."""
    points = [parse_measurement(m) for m in ok]
    reasons = []
    median_loo = compute_loo.get("median_rel_err") if compute_loo.get("points", 0) >= MIN_POINTS_FOR_LOO else None
    if median_loo is not None and median_loo > LOO_LIMIT:
        reasons.append(
            f"the step-time model mispredicts held-out points by {median_loo:.0%} (median; max "
            f"{compute_loo.get('max_rel_err', median_loo):.0%}), above {LOO_LIMIT:.0%}"
        )
    noisy = [m for m in points if (iter_time_spread(m) or 0.0) > POINT_CV_LIMIT]
    if len(noisy) * 2 > len(points):
        spread = ", ".join(f"batch {m.batch_size}: {iter_time_spread(m):.0%}" for m in noisy)
        reasons.append(f"{len(noisy)} of {len(points)} points have iteration-time CVs above {POINT_CV_LIMIT:.0%} "
                       f"(robust, 1.4826 MAD / median: {spread})")
    contended = sum(bool(m.host_contended) for m in points)
    if reasons and contended:
        reasons.append(f"{contended} of {len(points)} points ran on a contended host (load average above its cores)")
    return {
        "verdict": "unreliable" if reasons else "reliable",
        "message": UNRELIABLE if reasons else "the profile's timings are consistent",
        "reasons": reasons,
        "retimed_batches": sorted(set(retimed_batches)),
        "thresholds": {"point_cv": POINT_CV_LIMIT, "leave_one_out_rel_err": LOO_LIMIT, "source": "assumed"},
    }
