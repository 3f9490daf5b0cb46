"""The GPU catalog (configs/gpus.yaml) and `cluster.gpu_type`: what it fills in, what a spec still wins."""

import re

import httpx
import pydantic
import pytest
import yaml

from tests.handmade import spec_dict
from tula_service.catalogs import GPUS_PATH, gpu, gpu_catalog_listing, load_gpus, load_interconnects
from tula_service.spec.job_spec import JobSpec
from tula_service.units import GIB, MIB

REQUIRED_GPUS = {
    "h200", "h100_sxm", "h100_pcie", "a100_80gb_sxm", "a100_40gb_sxm", "l40s", "a10g", "v100_32gb", "t4", "rtx_4090", "mi300x",
}  # fmt: skip
LISTING_KEYS = {
    "name", "memory_gib", "default_price_usd_per_hour", "intra_node_link", "peak_bf16_tflops",
    "memory_bandwidth_gbps", "note", "source",
}  # fmt: skip


def gpu_spec(cluster: dict, pricing: dict | None = None) -> dict:
    """The hand-made spec on a catalog GPU: the cluster and pricing replaced, not merged."""
    spec = spec_dict()
    spec["cluster"] = cluster
    spec["pricing"] = pricing or {"kind": "gpu_hour"}
    return spec


def errors_of(spec: dict) -> dict[tuple, str]:
    with pytest.raises(pydantic.ValidationError) as caught:
        JobSpec.model_validate(spec)
    return {error["loc"]: error["msg"] for error in caught.value.errors()}


# --- the catalog ------------------------------------------------------------------------------


def test_catalog_has_the_common_training_gpus_each_with_a_source_note():
    gpus = load_gpus()
    assert REQUIRED_GPUS <= set(gpus)
    for entry in gpus.values():
        assert entry.source == "catalog-assumed"
        assert "datasheet" in entry.note or "whitepaper" in entry.note, entry.name
        assert "price:" in entry.note and re.search(r"20\d\d", entry.note), f"{entry.name}: price source and year"


def test_memory_is_what_the_driver_reports_as_quoted_in_the_note():
    for entry in load_gpus().values():
        mib = re.search(r"(?:nvidia-smi reports (\d+) MiB)|(?:rocm-smi reports (\d+) B)", entry.note)
        assert mib, f"{entry.name}: the note quotes the driver's total"
        reported_gib = int(mib[1]) * MIB / GIB if mib[1] else int(mib[2]) / GIB
        assert entry.memory_gib == reported_gib, entry.name


def test_marketed_gigabytes_are_not_taken_for_gibibytes():
    assert gpu("h100_sxm").memory_gib < 80 < gpu("a100_80gb_sxm").memory_gib + 1e-9
    assert 140 < gpu("h200").memory_gib < 141


def test_every_default_link_is_an_intra_node_link_of_the_interconnect_catalog():
    links = load_interconnects()
    for entry in load_gpus().values():
        if entry.intra_node_link is not None:
            assert links[entry.intra_node_link].kind in ("intra_node", "both"), entry.name
    assert gpu("h100_sxm").intra_node_link == "nvlink4" and gpu("a10g").intra_node_link == "pcie4_x16"


def test_listing_is_sorted_and_has_exactly_the_api_fields():
    listing = gpu_catalog_listing()
    assert [row["name"] for row in listing] == sorted(load_gpus())
    assert all(set(row) == LISTING_KEYS for row in listing)
    h100 = next(row for row in listing if row["name"] == "h100_sxm")
    assert h100["source"] == "catalog-assumed" and h100["peak_bf16_tflops"] == 989.5


def test_listing_is_a_copy_callers_cannot_corrupt():
    gpu_catalog_listing()[0]["memory_gib"] = -1
    load_gpus().clear()
    assert gpu_catalog_listing()[0]["memory_gib"] > 0 and load_gpus()


def test_unknown_gpu_suggests_the_nearest_names():
    with pytest.raises(KeyError, match="did you mean.*h100_sxm.*known: .*a100_40gb_sxm"):
        gpu("h100")


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        ({"memory_gib": -80}, "memory_gib must be a positive number"),
        ({"default_price_usd_per_hour": "cheap"}, "default_price_usd_per_hour must be a positive number"),
        ({"peak_bf16_tflops": 0}, "peak_bf16_tflops must be a positive number or null"),
        ({"intra_node_link": "nvlink9"}, "interconnect 'nvlink9' is not in the catalog"),
        ({"intra_node_link": "infiniband_ndr"}, "is an inter-node link"),
        ({"note": " "}, "note must say where the numbers come from"),
        ({"tdp_w": 700}, "unexpected \\['tdp_w'\\]"),
    ],
)
def test_a_bad_catalog_entry_is_named_with_what_is_wrong(tmp_path, change, complaint):
    entries = yaml.safe_load(GPUS_PATH.read_text())
    path = tmp_path / "gpus.yaml"
    path.write_text(yaml.safe_dump({"h100_sxm": {**entries["h100_sxm"], **change}}))
    with pytest.raises(ValueError, match=f"GPU 'h100_sxm': .*{complaint}"):
        load_gpus(path)


def test_a_catalog_entry_without_a_field_says_which(tmp_path):
    entry = yaml.safe_load(GPUS_PATH.read_text())["a10g"]
    del entry["peak_bf16_tflops"]
    path = tmp_path / "gpus.yaml"
    path.write_text(yaml.safe_dump({"a10g": entry}))
    with pytest.raises(ValueError, match="missing \\['peak_bf16_tflops'\\]"):
        load_gpus(path)


# --- cluster.gpu_type in a spec ---------------------------------------------------------------


def test_gpu_type_fills_memory_link_and_price_and_says_they_are_assumed():
    spec = JobSpec.model_validate(gpu_spec({"nodes": 2, "gpus_per_node": 8, "gpu_type": "h100_sxm"}))
    h100 = gpu("h100_sxm")
    assert (spec.cluster.device_memory_gib, spec.cluster.device_memory_source) == (h100.memory_gib, "catalog-assumed")
    assert spec.cluster.intra_node_link == "nvlink4" and spec.cluster.intra_node_link_source == "catalog-assumed"
    assert spec.pricing.price == h100.default_price_usd_per_hour and spec.pricing.price_source == "catalog-assumed"


def test_values_given_in_the_spec_win_over_the_catalog():
    cluster = {"gpu_type": "h100_sxm", "device_memory_gib": 40, "intra_node_link": "pcie5_x16"}
    spec = JobSpec.model_validate(gpu_spec(cluster, {"kind": "gpu_hour", "price": 4.5}))
    assert (spec.cluster.device_memory_gib, spec.cluster.device_memory_source) == (40, "spec")
    assert (spec.cluster.intra_node_link, spec.cluster.intra_node_link_source) == ("pcie5_x16", "spec")
    assert (spec.pricing.price, spec.pricing.price_source) == (4.5, "spec")


def test_interconnect_gbps_keeps_the_catalog_link_out():
    spec = JobSpec.model_validate(gpu_spec({"gpu_type": "a100_80gb_sxm", "interconnect_gbps": 200}))
    assert spec.cluster.intra_node_link is None and spec.cluster.intra_node_link_source is None
    assert spec.cluster.interconnect_gbps == 200


def test_every_catalog_gpu_names_a_link_of_the_interconnect_catalog():
    spec = JobSpec.model_validate(gpu_spec({"gpu_type": "v100_32gb"}))
    assert spec.cluster.intra_node_link == "nvlink2" and spec.cluster.device_memory_gib == 32.0
    assert JobSpec.model_validate(gpu_spec({"gpu_type": "mi300x"})).cluster.intra_node_link == "infinity_fabric_mi300x"


def test_without_gpu_type_device_memory_is_required_and_named():
    message = errors_of(gpu_spec({"nodes": 1}, {"kind": "gpu_hour", "price": 2}))[("cluster", "device_memory_gib")]
    assert "gpu_type" in message and "h100_sxm" in message


def test_unknown_gpu_type_is_named_with_the_known_ones():
    errors = errors_of(gpu_spec({"gpu_type": "b200"}, {"kind": "gpu_hour", "price": 2}))
    assert set(errors) == {("cluster", "gpu_type")}
    message = errors[("cluster", "gpu_type")]
    assert "'b200' is not in the catalog" in message and "h200" in message


@pytest.mark.parametrize("kind", ["node_hour", "memory_gb_hour"])
def test_only_gpu_hour_pricing_takes_the_catalog_price(kind):
    message = errors_of(gpu_spec({"gpu_type": "l40s"}, {"kind": kind}))[("pricing", "price")]
    assert "gpu_hour" in message and "gpu_type" in message


def test_without_gpu_type_the_price_is_required_and_named():
    assert ("pricing", "price") in errors_of(spec_dict(pricing={"price": None}))


def test_a_stored_spec_validates_back_to_itself():
    spec = JobSpec.model_validate(gpu_spec({"nodes": 2, "gpus_per_node": 4, "gpu_type": "mi300x"}))
    stored = spec.model_dump(mode="json")
    assert JobSpec.model_validate(stored).model_dump(mode="json") == stored


def test_a_catalog_source_without_its_gpu_type_is_rejected():
    spec = spec_dict()
    spec["pricing"]["price_source"] = "catalog-assumed"
    assert "cluster.gpu_type" in errors_of(spec)[()]
    spec = spec_dict()
    spec["cluster"]["device_memory_source"] = "catalog-assumed"
    assert "gpu_type" in errors_of(spec)[("cluster",)]


# --- over HTTP ----------------------------------------------------------------------------------


def test_api_stores_catalog_defaults_and_names_a_bad_gpu_type(make_server):
    server = make_server("--executor", "none")
    spec = gpu_spec({"nodes": 1, "gpus_per_node": 2, "gpu_type": "a10g"})
    created = httpx.post(f"{server.url}/v1/jobs", json=spec, timeout=30)
    assert created.status_code == 202, created.text
    stored = httpx.get(f"{server.url}/v1/jobs/{created.json()['id']}", timeout=30).json()["spec"]
    assert stored["cluster"]["device_memory_gib"] == gpu("a10g").memory_gib
    assert stored["pricing"] == {**stored["pricing"], "price": 1.006, "price_source": "catalog-assumed"}
    bad = httpx.post(f"{server.url}/v1/jobs", json=gpu_spec({"gpu_type": "a10"}), timeout=30)
    assert bad.status_code == 422
    fields = {error["field"]: error["message"] for error in bad.json()["errors"]}
    assert "a10g" in fields["body.cluster.gpu_type"]
