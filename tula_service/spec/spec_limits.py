"""Bounds on what one job may ask for, so that no submission can create an unbounded job.

The operator can move the configurable ones with environment variables (read at validation time, like
the user-code allowlist); the fixed ones are where a value stops meaning anything:

- batch sizes per job (`TULA_MAX_BATCH_SIZES`, default 64): each is a profiling point of several
  seconds, so 64 is minutes of profiling; a 120 001-point job is an accident, not a plan;
- devices per cluster (`TULA_MAX_DEVICES`, default 65 536 GPUs: the largest clusters built);
- a per-device or global batch of at most `MAX_BATCH` (2^24) samples, and never more than the
  dataset's `num_samples` (one step over more than an epoch is not a batch);
- `num_samples` of at most `MAX_NUM_SAMPLES` (10^12: more than any data set trained on);
- gradient statistics (|G|^2, tr(Sigma), their preconditioned pair) within +-`MAX_GRADIENT_STATISTIC` (10^100), so
  that pooling thousands of records stays finite.
"""

from __future__ import annotations

from tula_service.settings import environment

MAX_BATCH = 2**24
MAX_NUM_SAMPLES = 10**12
MAX_NODES, MAX_GPUS_PER_NODE = 4096, 64  # a placement's nodes, and GPUs on one node
# |G|^2 and tr(Sigma) a run recorded: far past any real squared norm (float32 gradients overflow at about 1e38 per
# element), and small enough that the pooled sums and ratios of thousands of records stay finite in float64
MAX_GRADIENT_STATISTIC = 1e100


def max_batch_sizes() -> int:
    return environment().max_batch_sizes


def max_devices() -> int:
    return environment().max_devices


def reject_bool(value: object) -> object:
    """JSON `true` is not a count: pydantic's lax int would read it as 1."""
    if isinstance(value, bool):
        raise ValueError("give an integer, not a boolean")
    return value


def reject_bool_number(value: object) -> object:
    """JSON `true` is not a measured number either: pydantic's lax float would read it as 1.0."""
    if isinstance(value, bool):
        raise ValueError("give a number, not a boolean")
    return value
