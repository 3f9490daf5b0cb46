"""Which links a cluster plans for (tula_service.fit.links): filled in by the spec, used by the fit, dropped by a what-if."""

import pytest

from tests.handmade import measurement, spec_dict
from tula_service.catalogs import gpu, interconnect
from tula_service.fit.links import (
    DEFAULT_INTER_NODE_LINK,
    DEFAULT_INTRA_NODE_LINK,
    catalog_link_defaults,
    cluster_links,
    link_report,
    stale_link_fields,
)
from tula_service.fit.perfmodel.network import ASSUMED_LATENCY_S, Link
from tula_service.plan.recommend import plan
from tula_service.plan.whatif import WhatIf, merged_spec
from tula_service.spec.job_spec import ClusterSpec, JobSpec

MEASURED = Link(latency_s=3e-6, bandwidth_gbps=900.0, source="fitted", name="measured (nccl)")


def _cluster(**fields) -> ClusterSpec:
    return ClusterSpec.model_validate({"device_memory_gib": 16, **fields})


def _stored(cluster: dict) -> dict:
    spec = spec_dict(batch_sizes=[8, 16, 32])
    spec["cluster"], spec["pricing"] = cluster, {"kind": "gpu_hour", "price": 2.0}
    return JobSpec.model_validate(spec).model_dump(mode="json")


def test_the_gpu_types_catalog_link_is_filled_in_and_said_to_be_assumed():
    assert catalog_link_defaults({"gpu_type": "l40s"}) == {
        "intra_node_link": gpu("l40s").intra_node_link, "intra_node_link_source": "catalog-assumed",
    }
    cluster = ClusterSpec.model_validate({"gpu_type": "h100_pcie"})
    assert (cluster.intra_node_link, cluster.intra_node_link_source) == ("pcie5_x16", "catalog-assumed")


@pytest.mark.parametrize("given", [{"intra_node_link": "nvlink3"}, {"interconnect_gbps": 50.0}])
def test_a_link_given_in_the_spec_keeps_the_catalogs_out(given):
    assert catalog_link_defaults({"gpu_type": "h100_sxm", **given}) == {}


def test_without_a_known_gpu_type_no_link_is_assumed():
    assert catalog_link_defaults({"device_memory_gib": 16}) == {}
    assert catalog_link_defaults({"gpu_type": "b200"}) == {}  # the spec's gpu_type validator names it


def test_a_link_named_in_the_spec_wins_over_the_gpu_types():
    intra, _ = cluster_links(_cluster(gpu_type="h100_sxm", intra_node_link="pcie4_x16"), None)
    assert intra == interconnect("pcie4_x16")


def test_a_named_link_wins_over_interconnect_gbps_which_gives_the_other_link():
    intra, inter = cluster_links(_cluster(intra_node_link="nvlink3", interconnect_gbps=50.0), None)
    assert intra == interconnect("nvlink3") and (inter.name, inter.bandwidth_gbps) == ("interconnect_gbps", 50.0)


def test_a_measured_link_wins_over_the_spec():
    intra, inter = cluster_links(_cluster(intra_node_link="pcie4_x16", inter_node_link="infiniband_ndr"), MEASURED)
    assert intra is MEASURED and inter == interconnect("infiniband_ndr")


def test_interconnect_gbps_gives_the_links_the_spec_does_not_name_with_an_assumed_latency():
    intra, inter = cluster_links(_cluster(interconnect_gbps=50.0, inter_node_link="infiniband_ndr"), None)
    assert (intra.bandwidth_gbps, intra.latency_s, intra.source) == (50.0, ASSUMED_LATENCY_S, "spec")
    assert inter == interconnect("infiniband_ndr")
    report = link_report(intra)
    assert report["bandwidth_gbps"] == {"value": 50.0, "source": "spec"}
    assert report["latency_s"] == {"value": ASSUMED_LATENCY_S, "source": "assumed"}


def test_with_no_link_given_the_stated_defaults_are_used():
    intra, inter = cluster_links(_cluster(), None)
    assert (intra, inter) == (interconnect(DEFAULT_INTRA_NODE_LINK), interconnect(DEFAULT_INTER_NODE_LINK))
    assert link_report(intra)["latency_s"]["source"] == "catalog-assumed"


def test_the_plan_reports_the_gpu_types_catalog_link():
    spec = JobSpec.model_validate(_stored({"gpus_per_node": 4, "gpu_type": "a100_80gb_sxm"}))
    network = plan(spec, [measurement(b) for b in (8, 16, 32)])["models"]["network"]
    assert network["intra_node"]["name"] == gpu("a100_80gb_sxm").intra_node_link
    assert network["intra_node"]["bandwidth_gbps"]["source"] == "catalog-assumed"


def test_a_gpu_change_makes_the_catalog_link_stale():
    stored = {"gpu_type": "h100_sxm", "intra_node_link": "nvlink4", "intra_node_link_source": "catalog-assumed"}
    assert stale_link_fields(stored, {"gpu_type": "l40s"}, gpu_changed=True) == {"intra_node_link", "intra_node_link_source"}
    assert stale_link_fields(stored, {"nodes": 2}, gpu_changed=False) == set()


def test_a_what_if_gpu_change_drops_the_old_gpus_catalog_link():
    stored = _stored({"gpu_type": "h100_sxm"})
    assert stored["cluster"]["intra_node_link"] == "nvlink4"
    switched = merged_spec(stored, WhatIf(cluster={"gpu_type": "l40s"}))
    assert (switched.cluster.intra_node_link, switched.cluster.intra_node_link_source) == ("pcie4_x16", "catalog-assumed")


def test_interconnect_gbps_in_a_what_if_replaces_only_a_catalog_assumed_link():
    assumed = {"intra_node_link": "nvlink4", "intra_node_link_source": "catalog-assumed"}
    given = {"intra_node_link": "nvlink4", "intra_node_link_source": "spec"}
    overrides = {"interconnect_gbps": 50.0}
    assert stale_link_fields(assumed, overrides, gpu_changed=False) == {"intra_node_link", "intra_node_link_source"}
    assert stale_link_fields(given, overrides, gpu_changed=False) == set()


def test_a_link_given_by_a_what_if_is_the_specs():
    stored = _stored({"gpu_type": "h100_sxm"})
    assert "intra_node_link_source" in stale_link_fields(stored["cluster"], {"intra_node_link": "pcie5_x16"}, False)
    changed = merged_spec(stored, WhatIf(cluster={"intra_node_link": "pcie5_x16"}))
    assert (changed.cluster.intra_node_link, changed.cluster.intra_node_link_source) == ("pcie5_x16", "spec")
