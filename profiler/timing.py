"""Iteration timing that a performance model can trust, within the seconds the point can give it.

- `PointBudget`: a point's `profiling.time_cap_s` covers the whole point (building the model,
  gradient statistics, warm-up, timing, memory); each pass asks for a share of what is left.
- Warm-up runs until iteration time settles: the medians of the last two windows of
  `SETTLE_WINDOW` iterations differ by less than `SETTLE_REL_CHANGE`, bounded in count and by
  `warmup_share` of the seconds timing was given.
- Sampling continues until the median, which is what the model fits, is known well enough or the
  seconds given are spent (never before `min_iters`). "Well enough" is either rule:
  - the coefficient of variation (std / mean) is under `target_cv`: every iteration took about as long;
  - the median's relative standard error is under `target_median_rse` (`median_rel_se`). That rule
    lets a point with a few outliers stop: on a shared host a few iterations in a hundred wait 10x
    longer on another process, which moves the std but not the median.
  p10/p90/CV/robust CV/count say how far to trust it. Both passes say how many iterations they ran and
  why they stopped.
- Phases (data to device, forward, backward, optimizer step) are timed separately: with CUDA events
  on a GPU (one synchronize per iteration, so the phases do not serialize the stream), with
  perf_counter on a CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

PHASES = ("data_s", "forward_s", "backward_s", "optimizer_s")
SETTLE_WINDOW = 3
SETTLE_REL_CHANGE = 0.10


class PhaseClock:
    """Marks phase boundaries inside one iteration; `finish()` returns seconds per phase and in all."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def finish(self) -> dict[str, float]:
        if self.cuda:
            self._marks[-1].synchronize()
            deltas = [a.elapsed_time(b) / 1000.0 for a, b in zip(self._marks, self._marks[1:])]
        else:
            deltas = [b - a for a, b in zip(self._marks, self._marks[1:])]
        self._marks = []
        phases = dict(zip(PHASES, deltas))
        phases["iter_s"] = float(sum(deltas))
        return phases


class PointBudget:
    """The seconds one point may spend, counted from its start: `share_s(f)` is the fraction f of
    what is left now. A pass's floor (least iterations) may overrun it; `report()` says so."""

    def __init__(self, time_cap_s: float):
        self.time_cap_s = float(time_cap_s)
        self.started_s = time.perf_counter()
        self.spent_s: dict[str, float] = {}

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started_s

    def left_s(self) -> float:
        return max(0.0, self.time_cap_s - self.elapsed_s())

    def share_s(self, fraction: float) -> float:
        return fraction * self.left_s()

    def spent(self, phase: str, since_s: float) -> None:
        """Book the seconds since `since_s` (a perf_counter reading) to `phase`."""
        self.spent_s[phase] = self.spent_s.get(phase, 0.0) + time.perf_counter() - since_s

    def report(self) -> dict:
        elapsed_s = self.elapsed_s()
        return {
            "time_cap_s": self.time_cap_s,
            "elapsed_s": elapsed_s,
            "spent_s": dict(self.spent_s),
            "within_cap": elapsed_s <= self.time_cap_s,
            "rule": "profiling.time_cap_s covers the whole point; each pass takes a share of what is left "
            "and stops early once its estimate has settled; least-iteration floors may overrun it",
        }


@dataclass
class TimingPolicy:
    min_warmup_iters: int = 3
    max_warmup_iters: int = 50
    warmup_share: float = 0.25  # of time_cap_s, at most
    min_iters: int = 10
    max_iters: int = 1000
    target_cv: float = 0.03
    target_median_rse: float = 0.01
    time_cap_s: float = 5.0  # warm-up and sampling together


@dataclass
class TimingResult:
    samples: list[dict[str, float]] = field(default_factory=list)
    warmup_iters: int = 0
    warmup_s: float = 0.0
    warmup_stopped_by: str = ""  # "settled" | "time_cap" | "max_iters"
    stopped_by: str = ""  # "cv_target" | "median_rse_target" | "time_cap" | "max_iters"
    sampling_s: float = 0.0

    def summary(self) -> dict:
        iter_s = np.array([s["iter_s"] for s in self.samples])
        return {
            **summarize(iter_s),
            "phases": {phase: summarize(np.array([s[phase] for s in self.samples])) for phase in PHASES},
            "warmup_iters": self.warmup_iters,
            "warmup_s": self.warmup_s,
            "warmup_stopped_by": self.warmup_stopped_by,
            "stopped_by": self.stopped_by,
            "sampling_s": self.sampling_s,
            "samples_s": iter_s.tolist(),
        }


def summarize(values_s: np.ndarray) -> dict[str, float]:
    mean = float(values_s.mean())
    median = float(np.median(values_s))
    return {
        "median_s": median,
        "p10_s": float(np.percentile(values_s, 10)),
        "p90_s": float(np.percentile(values_s, 90)),
        "mean_s": mean,
        "cv": coefficient_of_variation(values_s),
        "robust_cv": robust_cv(values_s),
        "median_rel_se": median_rel_se(values_s),
        "count": int(values_s.size),
    }


def robust_cv(values: np.ndarray) -> float:
    """1.4826 * MAD / median: the CV of a normal sample (1.4826 = 1 / Phi^-1(3/4) makes the MAD a
    consistent estimate of sigma), which a few outliers do not move."""
    median = float(np.median(values))
    if values.size < 2 or median <= 0:
        return 0.0
    return 1.4826 * float(np.median(np.abs(values - median))) / median


def median_rel_se(values: np.ndarray) -> float:
    """The relative standard error of the sample median: sqrt(pi / 2) * sigma / (sqrt(n) * median),
    the median's asymptotic variance pi sigma^2 / (2n) for normal data, with sigma the robust
    1.4826 * MAD. Iterations that drift together (autocorrelation) make it optimistic, which is why a
    point still times at least `min_iters` iterations."""
    if values.size < 2:
        return float("inf")
    return float(np.sqrt(np.pi / 2.0) * robust_cv(values) / np.sqrt(values.size))


def coefficient_of_variation(values: np.ndarray) -> float:
    if values.size < 2 or values.mean() <= 0:
        return 0.0
    return float(values.std(ddof=1) / values.mean())


def _settled(times_s: list[float]) -> bool:
    if len(times_s) < 2 * SETTLE_WINDOW:
        return False
    previous = np.median(times_s[-2 * SETTLE_WINDOW : -SETTLE_WINDOW])
    last = np.median(times_s[-SETTLE_WINDOW:])
    return abs(last - previous) / previous < SETTLE_REL_CHANGE


def time_iterations(step: Callable[[PhaseClock], None], device: torch.device, policy: TimingPolicy) -> TimingResult:
    """Warm up until settled (within `warmup_share` of the time cap), then sample until CV < target_cv,
    the median's relative standard error < target_median_rse, or the time cap (warm-up included) is
    spent; `step` marks its phases."""
    clock = PhaseClock(device)
    result = TimingResult()
    warmup_times_s: list[float] = []
    started = time.perf_counter()
    warmup_cap_s = policy.warmup_share * policy.time_cap_s
    result.warmup_stopped_by = "max_iters"
    while result.warmup_iters < policy.max_warmup_iters:
        step(clock)
        warmup_times_s.append(clock.finish()["iter_s"])
        result.warmup_iters += 1
        if result.warmup_iters < policy.min_warmup_iters:
            continue
        if _settled(warmup_times_s):
            result.warmup_stopped_by = "settled"
            break
        if time.perf_counter() - started >= warmup_cap_s:
            result.warmup_stopped_by = "time_cap"
            break
    result.warmup_s = time.perf_counter() - started

    sampling_started = time.perf_counter()
    while True:
        step(clock)
        result.samples.append(clock.finish())
        count = len(result.samples)
        if count < policy.min_iters:
            continue
        iter_s = np.array([s["iter_s"] for s in result.samples])
        if coefficient_of_variation(iter_s) <= policy.target_cv:
            result.stopped_by = "cv_target"
        elif median_rel_se(iter_s) <= policy.target_median_rse:
            result.stopped_by = "median_rse_target"
        elif time.perf_counter() - started >= policy.time_cap_s:
            result.stopped_by = "time_cap"
        elif count >= policy.max_iters:
            result.stopped_by = "max_iters"
        else:
            continue
        result.sampling_s = time.perf_counter() - sampling_started
        return result
