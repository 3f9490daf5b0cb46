"""Latency and bandwidth of gradient all-reduce, fitted to measured points.

    T(n, S) = 2 (n - 1) * latency_s + 2 (n - 1) / n * S * seconds_per_byte,   latency_s, seconds_per_byte >= 0
    bandwidth_gbps = 8e-9 / seconds_per_byte

A ring all-reduce is a reduce-scatter followed by an all-gather, each n - 1 steps in which every
device sends S / n bytes to its neighbour: 2 (n - 1) step latencies and 2 (n - 1) / n * S bytes per
device (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
workstations"; Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication
operations in MPICH", the latency-bandwidth cost model). The time is linear in the two unknowns, so
they are fitted with non-negative least squares (scipy.optimize.nnls) on relative residuals (each
row divided by its measured time), as in `ComputeModel`: a 10% miss on a 1 KiB message counts as
much as a 10% miss on a 1 GiB one.

The points come from `profiler.comm` (`"kind": "comm"` records). The fit does not know which link
produced them: gloo over loopback measures one host's memory copies and TCP stack, not a GPU
interconnect, so quote the record's `backend`/`device` next to the fitted numbers. The quality is
reported as in-sample (`rel_errors_`) and leave-one-out (`loo_rel_errors_`) relative errors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.optimize import nnls

from tula_service.fit.perfmodel.network import RingAllReduce
from tula_service.fit.perfmodel.validation import error_summary
from tula_service.measurement import CommMeasurement

MIN_POINTS = 3


def ring_terms(world_size: np.ndarray, message_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ring's coefficients of (latency_s, seconds_per_byte): 2 (n - 1) and 2 (n - 1) / n * S."""
    hops = 2.0 * (np.asarray(world_size, dtype=float) - 1.0)
    return hops, hops / np.asarray(world_size, dtype=float) * np.asarray(message_bytes, dtype=float)


def _nnls_relative(world_size: np.ndarray, message_bytes: np.ndarray, time_s: np.ndarray) -> np.ndarray:
    design = np.column_stack(ring_terms(world_size, message_bytes)) / time_s[:, None]
    coefficients, _ = nnls(design, np.ones_like(time_s))
    return coefficients


class RingAllReduceFit:
    """`fit(world_size, message_bytes, time_s)` -> latency_s_, bandwidth_gbps_ of the ring model above."""

    def fit(self, world_size: np.ndarray, message_bytes: np.ndarray, time_s: np.ndarray) -> RingAllReduceFit:
        n, size, seconds = _validated(world_size, message_bytes, time_s)
        self.latency_s_, self.seconds_per_byte_ = (float(c) for c in _nnls_relative(n, size, seconds))
        self.bandwidth_gbps_ = 8e-9 / self.seconds_per_byte_ if self.seconds_per_byte_ > 0 else float("inf")
        self.n_points_ = int(seconds.size)
        self.rel_errors_ = self.predict(n, size) / seconds - 1.0
        self.loo_rel_errors_ = np.array([self._held_out_error(n, size, seconds, i) for i in range(seconds.size)])
        return self

    @staticmethod
    def _held_out_error(n: np.ndarray, size: np.ndarray, seconds: np.ndarray, held_out: int) -> float:
        keep = np.arange(seconds.size) != held_out
        latency_s, seconds_per_byte = _nnls_relative(n[keep], size[keep], seconds[keep])
        hops, ring_bytes = ring_terms(n[held_out], size[held_out])
        return float((hops * latency_s + ring_bytes * seconds_per_byte) / seconds[held_out] - 1.0)

    def predict(self, world_size: np.ndarray | int, message_bytes: np.ndarray | float) -> np.ndarray:
        """Seconds per all-reduce, broadcast over both arguments; 0 on one device."""
        hops, ring_bytes = ring_terms(world_size, message_bytes)
        seconds = hops * self.latency_s_ + ring_bytes * self.seconds_per_byte_
        return np.where(np.asarray(world_size) > 1, seconds, 0.0)

    def quality(self) -> dict[str, Any]:
        """The fitted numbers with their errors, for a recommendation's provenance."""
        return {
            "latency_s": self.latency_s_,
            "bandwidth_gbps": self.bandwidth_gbps_,
            "source": "fitted",
            "in_sample": error_summary(np.abs(self.rel_errors_).tolist()),
            "leave_one_out": error_summary(np.abs(self.loo_rel_errors_).tolist()),
        }

    def to_ring_all_reduce(self, gradient_bytes: float) -> RingAllReduce:
        """The planner's network term for a model with `gradient_bytes` of gradients."""
        if not np.isfinite(self.bandwidth_gbps_):
            raise ValueError(
                "the fitted bandwidth is infinite (times did not grow with message size); measure larger messages"
            )
        return RingAllReduce(
            gradient_bytes=gradient_bytes, bandwidth_gbps=self.bandwidth_gbps_, latency_s=self.latency_s_
        )


def fit_comm_record(record: CommMeasurement) -> RingAllReduceFit:
    """Fit the median times of one `profiler.comm` record (tula_service.measurement.parse_measurement of it);
    a failed record is an error, not a fit."""
    if not isinstance(record, CommMeasurement):
        raise ValueError(f"expected a 'comm' measurement, got {type(record).__name__}")
    if record.status != "ok":
        raise ValueError(f"the comm record has status {record.status!r}: {record.error}")
    points = record.points
    return RingAllReduceFit().fit([p.world_size for p in points], [p.message_bytes for p in points], [p.median_s for p in points])


def _validated(world_size, message_bytes, time_s) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n, size, seconds = (np.asarray(values, dtype=float).ravel() for values in (world_size, message_bytes, time_s))
    if not n.size == size.size == seconds.size:
        lengths = f"{n.size}, {size.size}, {seconds.size}"
        raise ValueError(f"world_size, message_bytes and time_s differ in length: {lengths}")
    if seconds.size < MIN_POINTS:
        raise ValueError(f"need at least {MIN_POINTS} measured points to fit latency and bandwidth, got {seconds.size}")
    if not (np.all(np.isfinite(n)) and np.all(n >= 2)):
        raise ValueError(f"every world_size must be >= 2 (one device does not all-reduce), got {n.tolist()}")
    if not (np.all(np.isfinite(size)) and np.all(size > 0)):
        raise ValueError(f"every message_bytes must be positive, got {size.tolist()}")
    if not (np.all(np.isfinite(seconds)) and np.all(seconds > 0)):
        raise ValueError(f"every time_s must be positive and finite, got {seconds.tolist()}")
    if np.linalg.matrix_rank(np.column_stack(ring_terms(n, size))) < 2:
        raise ValueError("the points cannot separate latency from bandwidth: measure at least two message sizes")
    return n, size, seconds
