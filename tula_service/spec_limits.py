"""Bounds on what one job may ask for, so that no submission can create an unbounded job.

The operator can move the configurable ones with environment variables (read at validation time, like
the user-code allowlist); the fixed ones are where a value stops meaning anything:

- batch sizes per job (`TULA_MAX_BATCH_SIZES`, default 64): each is a profiling point of several
  seconds, so 64 is minutes of profiling; a 120 001-point job is an accident, not a plan;
- devices per cluster (`TULA_MAX_DEVICES`, default 65 536 GPUs: the largest clusters built);
- a per-device or global batch of at most `MAX_BATCH` (2^24) samples, and never more than the
  dataset's `num_samples` (one step over more than an epoch is not a batch);
- `num_samples` of at most `MAX_NUM_SAMPLES` (10^12: more than any data set trained on).
"""

from __future__ import annotations

import os

MAX_BATCH_SIZES_ENV = "TULA_MAX_BATCH_SIZES"
MAX_DEVICES_ENV = "TULA_MAX_DEVICES"
DEFAULT_MAX_BATCH_SIZES = 64
DEFAULT_MAX_DEVICES = 65_536
MAX_BATCH = 2**24
MAX_NUM_SAMPLES = 10**12


def _env_limit(name: str, default: int) -> int:
    """A positive integer from the environment; a bad value is the operator's error, said at once."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise RuntimeError(f"{name}={raw!r}: give a positive integer (default {default})")
    return int(raw)


def max_batch_sizes() -> int:
    return _env_limit(MAX_BATCH_SIZES_ENV, DEFAULT_MAX_BATCH_SIZES)


def max_devices() -> int:
    return _env_limit(MAX_DEVICES_ENV, DEFAULT_MAX_DEVICES)


def reject_bool(value: object) -> object:
    """JSON `true` is not a count: pydantic's lax int would read it as 1."""
    if isinstance(value, bool):
        raise ValueError("give an integer, not a boolean")
    return value
