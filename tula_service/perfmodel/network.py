"""Gradient all-reduce time over n devices with a ring.

    T_net(n) = 2 (n - 1) * latency_s + 2 (n - 1) / n * gradient_bytes / bandwidth_bytes_per_s,  n > 1
    T_net(1) = 0

(Each of the 2(n-1) ring steps sends 1/n of the gradient.) Bandwidth comes from the spec's
interconnect; the per-hop latency is an assumed constant until the profiler measures it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ASSUMED_LATENCY_S = 5e-6


@dataclass(frozen=True)
class RingAllReduce:
    gradient_bytes: float
    bandwidth_gbps: float
    latency_s: float = ASSUMED_LATENCY_S

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8.0

    def predict(self, devices: np.ndarray | int) -> np.ndarray:
        n = np.asarray(devices, dtype=float)
        hops = 2.0 * (n - 1.0)
        seconds = hops * self.latency_s + hops / n * self.gradient_bytes / self.bandwidth_bytes_per_s
        return np.where(n > 1, seconds, 0.0)
