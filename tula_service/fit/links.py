"""Which links a cluster's all-reduce runs over: the one owner of the link rules of the spec, the fit and
the what-if.

The network model (tula_service.fit.perfmodel.network) needs two links. Each is the first of:

    intra-node: measured (the NCCL all-reduce benchmark)
                > cluster.intra_node_link                 (named in the spec; its numbers the interconnect catalog's)
                > cluster.interconnect_gbps               (bandwidth given, latency ASSUMED_LATENCY_S)
                > the GPU catalog's link of cluster.gpu_type (filled in by the spec, source "catalog-assumed")
                > DEFAULT_INTRA_NODE_LINK                 (PCIe 4: conservative)
    inter-node: cluster.inter_node_link > cluster.interconnect_gbps > DEFAULT_INTER_NODE_LINK

The GPU catalog's link is written into the validated spec as intra_node_link with
intra_node_link_source "catalog-assumed" (catalog_link_defaults), so that a stored spec says which link
was planned for; a what-if that changes what it came from drops it (stale_link_fields).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tula_service.catalogs import CATALOG_SOURCE, interconnect, load_gpus

if TYPE_CHECKING:
    from tula_service.fit.perfmodel.network import Link
    from tula_service.spec.job_spec import ClusterSpec

DEFAULT_INTRA_NODE_LINK = "pcie4_x16"  # conservative when the spec names no link
DEFAULT_INTER_NODE_LINK = "ethernet_100g"

# The spec fields that say the intra-node link: with either given, the GPU catalog's link is not assumed,
# and a what-if giving either replaces a stored catalog-assumed one.
INTRA_NODE_LINK_FIELDS = ("intra_node_link", "interconnect_gbps")
# The stored fields of the GPU catalog's link: stale once the GPU type changes.
GPU_LINK_FIELDS = ("intra_node_link", "intra_node_link_source")


def catalog_link_defaults(cluster: Mapping[str, Any]) -> dict[str, Any]:
    """The intra-node link fields the GPU catalog fills in a submitted cluster: its gpu_type's link,
    source "catalog-assumed", when that GPU has a link and the cluster gives none of
    INTRA_NODE_LINK_FIELDS; else nothing (an unknown gpu_type is the spec's validator's to report)."""
    gpu_type = cluster.get("gpu_type")
    entry = load_gpus().get(gpu_type) if isinstance(gpu_type, str) else None
    if entry is None or not entry.intra_node_link:
        return {}
    if any(cluster.get(field) is not None for field in INTRA_NODE_LINK_FIELDS):
        return {}
    return {"intra_node_link": entry.intra_node_link, "intra_node_link_source": CATALOG_SOURCE}


def stale_link_fields(stored: Mapping[str, Any], overrides: Mapping[str, Any], gpu_changed: bool) -> set[str]:
    """The stored cluster's link fields a what-if makes stale: the GPU catalog's link when the GPU type
    changes, a catalog-assumed link when the what-if gives one of INTRA_NODE_LINK_FIELDS, and the source
    of an intra_node_link it gives (the spec re-derives it)."""
    stale: set[str] = set(GPU_LINK_FIELDS) if gpu_changed else set()
    link_given = overrides.keys() & set(INTRA_NODE_LINK_FIELDS)
    if link_given and stored.get("intra_node_link_source") == CATALOG_SOURCE:
        stale.update(GPU_LINK_FIELDS)
    if "intra_node_link" in overrides:
        stale.add("intra_node_link_source")
    return stale


def spec_link(cluster: ClusterSpec, catalog_name: str | None, default_name: str) -> Link:
    """A link named in the spec (the interconnect catalog's), else the spec's interconnect_gbps with an
    assumed latency, else the catalog's `default_name`."""
    # Imported here: the perfmodel package loads scipy, and the spec (which reads this module for
    # catalog_link_defaults) is read by the CLI for its choices; only building a link needs it.
    from tula_service.fit.perfmodel.network import ASSUMED_LATENCY_S, Link

    if catalog_name:
        return interconnect(catalog_name)
    if cluster.interconnect_gbps:
        return Link(latency_s=ASSUMED_LATENCY_S, bandwidth_gbps=cluster.interconnect_gbps, source="spec", name="interconnect_gbps")
    return interconnect(default_name)


def cluster_links(cluster: ClusterSpec, measured_intra: Link | None) -> tuple[Link, Link]:
    """(intra-node, inter-node) links in the order of the module docstring: a measured intra-node link
    beats the spec's."""
    intra = measured_intra or spec_link(cluster, cluster.intra_node_link, DEFAULT_INTRA_NODE_LINK)
    return intra, spec_link(cluster, cluster.inter_node_link, DEFAULT_INTER_NODE_LINK)


def link_report(link: Link) -> dict[str, Any]:
    """A link as the fit's report gives it: each number with its source; a link the spec gives by its
    bandwidth (interconnect_gbps) has an assumed latency."""
    return {
        "name": link.name or None,
        "bandwidth_gbps": {"value": link.bandwidth_gbps, "source": link.source},
        "latency_s": {"value": link.latency_s, "source": link.source if link.source != "spec" else "assumed"},
    }
