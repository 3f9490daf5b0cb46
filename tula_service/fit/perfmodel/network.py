"""Gradient all-reduce time over n devices: a flat ring, or a two-level (hierarchical) ring.

    ring(n, S, link) = 2 (n - 1) * latency_s + 2 (n - 1) / n * S / bandwidth_bytes_per_s,   n > 1
    ring(1, S, link) = 0

(Each of the 2(n-1) ring steps sends 1/n of the gradient.) Bandwidth comes from the spec's
interconnect or the catalog (`tula_service.catalogs`); the per-hop latency is an assumed constant
until the profiler measures it.

Hierarchical all-reduce (Jia et al. 2018, "Highly Scalable Deep Learning Training System with
Mixed-Precision", sec. 3.3, hierarchical all-reduce; Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE):
n devices fill m = ceil(n / gpus_per_node) nodes in order, g = min(n, gpus_per_node) per node.
Reduce-scatter inside each node, all-reduce each node's S/g shard across the m nodes, all-gather
inside each node:

    T(n) = [2 (g-1)/g * S / bw_intra + 2 (g-1) * lat_intra] + [2 (m-1) * lat_inter + 2 (m-1)/m * (S/g) / bw_inter]
         = ring(g, S, intra) + ring(m, S / g, inter)

On one node (m = 1) this is the flat ring over the intra-node link. A partly filled last node is
counted as full (its devices carry larger shards in reality): a slight under-estimate there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ASSUMED_LATENCY_S = 5e-6


def ring_seconds(
    devices: np.ndarray | int, message_bytes: float | np.ndarray, latency_s: float, bandwidth_gbps: float
) -> np.ndarray:
    """ring(n, S, link) above, vectorized over n (and S); 0 where n <= 1."""
    n = np.asarray(devices, dtype=float)
    hops = 2.0 * (n - 1.0)
    seconds = hops * latency_s + hops / np.maximum(n, 1.0) * message_bytes / (bandwidth_gbps * 1e9 / 8.0)
    return np.where(n > 1, seconds, 0.0)


@dataclass(frozen=True)
class RingAllReduce:
    gradient_bytes: float
    bandwidth_gbps: float
    latency_s: float = ASSUMED_LATENCY_S

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8.0

    def predict(self, devices: np.ndarray | int) -> np.ndarray:
        return ring_seconds(devices, self.gradient_bytes, self.latency_s, self.bandwidth_gbps)


@dataclass(frozen=True)
class Link:
    """One interconnect: per-hop latency, per-direction data rate, and where the numbers come from."""

    latency_s: float
    bandwidth_gbps: float
    source: str = "assumed"
    name: str = ""
    kind: str = ""  # intra_node | inter_node | both, when known (the catalog says)
    note: str = ""

    def ring(self, gradient_bytes: float) -> RingAllReduce:
        """The flat ring all-reduce of `gradient_bytes` over this link alone."""
        return RingAllReduce(gradient_bytes, bandwidth_gbps=self.bandwidth_gbps, latency_s=self.latency_s)


@dataclass(frozen=True)
class HierarchicalAllReduce:
    gradient_bytes: float
    gpus_per_node: int
    intra: Link
    inter: Link

    def predict(self, devices: np.ndarray | int) -> np.ndarray:
        """Seconds per all-reduce over n devices placed on ceil(n / gpus_per_node) nodes (formula above)."""
        n = np.asarray(devices, dtype=float)
        return self.predict_placement(np.minimum(n, self.gpus_per_node), np.ceil(n / self.gpus_per_node))

    def predict_placement(self, per_node: np.ndarray | int, nodes: np.ndarray | int) -> np.ndarray:
        """Seconds per all-reduce with `per_node` GPUs on the busiest of `nodes` nodes (formula above)."""
        per_node, nodes = (np.asarray(v, dtype=float) for v in (per_node, nodes))
        intra_s = ring_seconds(per_node, self.gradient_bytes, self.intra.latency_s, self.intra.bandwidth_gbps)
        shard_bytes = self.gradient_bytes / np.maximum(per_node, 1.0)
        inter_s = ring_seconds(nodes, shard_bytes, self.inter.latency_s, self.inter.bandwidth_gbps)
        return intra_s + inter_s
