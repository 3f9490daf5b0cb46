"""The knee of the time-vs-batch curve: past it, doubling the batch stops paying in time.

Kneedle (Satopaa et al. 2011, package `kneed`) on x = log2(global batch), which spaces powers of two
evenly (Kneedle assumes even spacing), and y = log2(predicted total time). Both axes are logarithmic
because the curve is scale-free where scaling is perfect (time halves per doubling: a straight line
of slope -1) and flattens where it stops (communication, accumulation, or statistical efficiency:
with E(B) = E_min (1 + B / B_noise) the bend sits near B_noise, McCandlish et al. 2018). With a
linear y, Kneedle would find a "knee" in any 1/B curve, however far from flat it still is.
Only the decreasing envelope is used: a batch that is not faster than every smaller batch is never a knee.

Fallback when Kneedle finds none: the point farthest below the chord between the curve's ends after
normalizing both axes to [0, 1] (the maximum of Kneedle's own difference curve), if it lies at least
MIN_BEND below the chord; otherwise the curve has no bend (doubling pays the same everywhere in range)
and the fastest point is the answer. With fewer than three points the fastest point is the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from kneed import KneeLocator

from tula_service.plan.recommendation import KneeMethod

DEFAULT_SENSITIVITY = 1.0
MIN_BEND = 0.05  # normalized distance below the chord that counts as a bend


# What each way of finding the knee means, in words a user reads next to the pick.
KNEE_METHODS: dict[KneeMethod, str] = {
    "kneedle": "Kneedle found the bend of log2 total time vs log2 global batch: past it, doubling the batch "
    "saves clearly less time than before it",
    "max_distance_fallback": "Kneedle found no knee at its sensitivity, so the pick is the batch farthest below "
    "the straight line between the curve's ends (the curve's strongest bend)",
    "no_bend_fastest": "the curve has no bend in the swept range (every doubling pays about the same), so the "
    "pick is the fastest configuration",
    "fastest_of_few": "fewer than 3 batches improve on smaller ones, too few for a bend: the pick is the fastest",
}


@dataclass(frozen=True)
class Knee:
    global_batch: int
    method: KneeMethod  # "kneedle" | "max_distance_fallback" | "no_bend_fastest" | "fastest_of_few"
    sensitivity: float


def decreasing_envelope(global_batch: np.ndarray, total_time_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per distinct batch the fastest time, then only batches faster than every smaller one."""
    batches = np.unique(global_batch)
    fastest = np.array([total_time_s[global_batch == b].min() for b in batches])
    keep = fastest < np.minimum.accumulate(np.concatenate([[np.inf], fastest[:-1]]))
    return batches[keep], fastest[keep]


def find_knee(global_batch: np.ndarray, total_time_s: np.ndarray, sensitivity: float = DEFAULT_SENSITIVITY) -> Knee:
    batches, times = decreasing_envelope(np.asarray(global_batch), np.asarray(total_time_s, dtype=float))
    if batches.size < 3:
        return Knee(int(batches[np.argmin(times)]), "fastest_of_few", sensitivity)
    x = np.log2(batches.astype(float))
    times = np.log2(times)
    locator = KneeLocator(x, times, S=sensitivity, curve="convex", direction="decreasing")
    if locator.knee is not None:
        return Knee(int(batches[int(np.argmin(np.abs(x - locator.knee)))]), "kneedle", sensitivity)
    x_norm = (x - x[0]) / (x[-1] - x[0])
    y_norm = (times - times.min()) / (times.max() - times.min())
    below_chord = (1.0 - y_norm) - x_norm
    if below_chord.max() < MIN_BEND:
        return Knee(int(batches[-1]), "no_bend_fastest", sensitivity)
    return Knee(int(batches[int(np.argmax(below_chord))]), "max_distance_fallback", sensitivity)
