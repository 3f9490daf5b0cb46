"""The bounded search for the largest per-device batch that fits, after an out-of-memory.

Predict, confirm, bisect: the first probe is the memory model's prediction of the largest batch
that fits the profiling device (when it lies strictly between the largest batch that ran and the
smallest that went out of memory), every later probe bisects that bracket: geometrically while it
spans more than a factor of 2 (so [8, 2^30] takes ~5 probes to come within 2x, not 27 halvings from
2^29 down, each a probe at an absurd batch), arithmetically once it is narrower. The search stops when
the bracket is tight (within `REL_TOLERANCE` of the batch, or adjacent), or after `max_probes`.
Each probe is an ordinary profiling point in its own child process, so its measurement also
sharpens the time and memory fits.
"""

from __future__ import annotations

import math

REL_TOLERANCE = 0.05


def bracket(ok_batches: list[int], oom_batches: list[int]) -> tuple[int, int] | None:
    """(largest batch that ran below the smallest OOM, smallest OOM); None without an OOM."""
    if not oom_batches:
        return None
    smallest_oom = min(oom_batches)
    below = [b for b in ok_batches if b < smallest_oom]
    return (max(below) if below else 0), smallest_oom


def next_probe(ok_batches: list[int], oom_batches: list[int], predicted_max: int | None, probes_done: int, max_probes: int) -> int | None:
    """The batch to try next, or None when the limit is known well enough (or the budget is spent)."""
    limits = bracket(ok_batches, oom_batches)
    if limits is None or probes_done >= max_probes:
        return None
    largest_ok, smallest_oom = limits
    if smallest_oom - largest_ok <= max(1, int(REL_TOLERANCE * largest_ok)):
        return None
    if probes_done == 0 and predicted_max is not None and largest_ok < predicted_max < smallest_oom:
        return int(predicted_max)
    if not largest_ok:
        return max(1, smallest_oom // 2)
    if smallest_oom > 2 * largest_ok:
        return int(math.sqrt(largest_ok * smallest_oom))
    return (largest_ok + smallest_oom) // 2
