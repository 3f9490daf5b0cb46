"""Compute shapes and their selection, the memory interval, hierarchical all-reduce, links, overlap."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tula_service.catalogs import interconnect, load_interconnects
from tula_service.fit.perfmodel.compute import (
    ComputeModel,
    PowerLawComputeModel,
    SaturatingComputeModel,
    select_compute_model,
)
from tula_service.fit.perfmodel.memory import MemoryModel
from tula_service.fit.perfmodel.network import HierarchicalAllReduce, Link, RingAllReduce
from tula_service.fit.perfmodel.overlap import OverlapModel

BATCHES = 2.0 ** np.arange(0, 10)  # 1 .. 512
NVLINK = Link(latency_s=2e-6, bandwidth_gbps=3600, source="test", name="nvlink")
INFINIBAND = Link(latency_s=1.5e-6, bandwidth_gbps=400, source="test", name="ib")
EXPECTED_LINKS = {
    "nvlink4", "nvlink3", "pcie4_x16", "pcie5_x16", "infiniband_hdr", "infiniband_ndr",
    "ethernet_100g", "ethernet_25g", "ethernet_10g",
}  # fmt: skip


def saturating_times(batch, alpha_s=0.05, beta_s_per_sample=0.001, saturation_batch=24.0):
    return alpha_s + beta_s_per_sample * np.maximum(batch, saturation_batch)


# --- compute shapes -------------------------------------------------------------------------------


def test_linear_model_reports_its_parameters():
    model = ComputeModel().fit(BATCHES, 0.02 + 0.003 * BATCHES)
    assert model.params_() == pytest.approx({"alpha_s": 0.02, "beta_s_per_sample": 0.003})
    assert model.describe()["name"] == "linear"


def test_saturating_model_recovers_a_breakpoint_between_measured_batches():
    model = SaturatingComputeModel().fit(BATCHES, saturating_times(BATCHES))
    assert model.params_() == pytest.approx(
        {"alpha_s": 0.05, "beta_s_per_sample": 0.001, "saturation_batch": 24.0}, rel=1e-4
    )


def test_saturating_model_is_the_line_when_the_device_is_busy_from_the_start():
    model = SaturatingComputeModel().fit(BATCHES, 0.02 + 0.003 * BATCHES)
    assert model.predict(BATCHES) == pytest.approx(0.02 + 0.003 * BATCHES, rel=1e-6)


def test_power_law_model_recovers_its_exponent():
    model = PowerLawComputeModel().fit(BATCHES, 0.01 + 0.002 * BATCHES**0.73)
    assert model.params_() == pytest.approx({"alpha_s": 0.01, "beta_s": 0.002, "exponent": 0.73}, rel=1e-3)


def test_compute_models_reject_non_positive_times():
    with pytest.raises(ValueError, match="iter_time_s must be positive"):
        SaturatingComputeModel().fit([1, 2, 4], [0.1, 0.0, 0.2])


# --- selection ------------------------------------------------------------------------------------


def test_selection_picks_the_saturating_model_on_saturating_data():
    model, report = select_compute_model(BATCHES, saturating_times(BATCHES))
    assert report["chosen"] == "saturating" and isinstance(model, SaturatingComputeModel)
    assert report["candidates"]["saturating"]["leave_one_out"]["median_rel_err"] < 1e-6
    assert report["candidates"]["linear"]["leave_one_out"]["median_rel_err"] > 0.05


def test_selection_keeps_the_linear_model_on_linear_data():
    model, report = select_compute_model(BATCHES, 0.02 + 0.003 * BATCHES)
    assert report["chosen"] == "linear" and isinstance(model, ComputeModel)
    assert "linear" in report["why"]


def test_selection_reports_leave_one_out_for_every_candidate():
    _, report = select_compute_model(BATCHES, saturating_times(BATCHES))
    assert set(report["candidates"]) == {"linear", "saturating", "power"}
    for candidate in report["candidates"].values():
        assert candidate["eligible"] and candidate["leave_one_out"]["points"] == BATCHES.size
        assert candidate["params"]


def test_selection_falls_back_to_linear_with_too_few_points():
    batches = np.array([8.0, 32.0, 128.0])
    model, report = select_compute_model(batches, saturating_times(batches, saturation_batch=50.0))
    assert report["chosen"] == "linear" and "only 3 distinct batch sizes" in report["why"]
    assert not report["candidates"]["saturating"]["eligible"]
    assert report["candidates"]["saturating"]["leave_one_out"]["points"] == 0


# --- memory interval ------------------------------------------------------------------------------


def test_memory_interval_has_zero_width_on_exact_data():
    model = MemoryModel().fit(BATCHES, 5e8 + 2e6 * BATCHES)
    low, high = model.predict_interval(np.array([1.0, 1000.0]))
    assert np.array_equal(low, high) and high == pytest.approx(5e8 + 2e6 * np.array([1.0, 1000.0]))


def test_memory_interval_covers_new_measurements_at_the_stated_rate():
    rng = np.random.default_rng(7)
    batches, noise_bytes, new_batch = np.array([8.0, 16, 32, 64, 128, 256]), 2e7, 512.0
    covered = []
    for _ in range(200):
        model = MemoryModel().fit(batches, 5e8 + 2e6 * batches + rng.normal(0, noise_bytes, batches.size))
        low, high = model.predict_interval(new_batch, level=0.95)
        covered.append(low <= 5e8 + 2e6 * new_batch + rng.normal(0, noise_bytes) <= high)
    assert 0.90 <= np.mean(covered) <= 0.99


def test_upper_max_device_batch_is_more_conservative_on_noisy_data():
    rng = np.random.default_rng(3)
    model = MemoryModel().fit(BATCHES, 1e9 + 1e7 * BATCHES + rng.normal(0, 5e7, BATCHES.size))
    point, upper = model.max_device_batch(10e9), model.max_device_batch(10e9, upper=True)
    assert 0 < upper < point
    assert model.predict_interval(upper)[1] <= 10e9 * 0.95 < model.predict_interval(upper + 1)[1]


def test_upper_max_device_batch_equals_the_point_answer_on_exact_data():
    model = MemoryModel().fit(BATCHES, 1e9 + 1e7 * BATCHES)
    assert model.max_device_batch(10e9, upper=True) == model.max_device_batch(10e9) > 0


# --- hierarchical all-reduce ----------------------------------------------------------------------


def test_hierarchical_all_reduce_is_the_flat_ring_on_one_node():
    devices = np.arange(1, 9)
    hierarchical = HierarchicalAllReduce(gradient_bytes=1e9, gpus_per_node=8, intra=NVLINK, inter=INFINIBAND)
    assert hierarchical.predict(devices) == pytest.approx(NVLINK.ring(1e9).predict(devices))


def test_hierarchical_all_reduce_matches_the_two_level_formula():
    hierarchical = HierarchicalAllReduce(gradient_bytes=1e9, gpus_per_node=8, intra=NVLINK, inter=INFINIBAND)
    g, m, size = 8, 3, 1e9
    expected = (
        2 * (g - 1) / g * size / 450e9 + 2 * (g - 1) * 2e-6 + 2 * (m - 1) * 1.5e-6 + 2 * (m - 1) / m * (size / g) / 50e9
    )
    assert hierarchical.predict(24) == pytest.approx(expected)
    assert hierarchical.predict(17) == pytest.approx(expected)  # 17 devices still use 3 nodes


def test_hierarchical_all_reduce_sits_between_intra_only_and_inter_only_rings_across_nodes():
    devices = np.array([16, 32, 64])
    hierarchical = HierarchicalAllReduce(gradient_bytes=1e9, gpus_per_node=8, intra=NVLINK, inter=INFINIBAND)
    seconds = hierarchical.predict(devices)
    assert np.all(NVLINK.ring(1e9).predict(devices) < seconds)
    assert np.all(seconds < INFINIBAND.ring(1e9).predict(devices))


@settings(max_examples=50, deadline=None)
@given(
    smaller=st.floats(1e3, 1e10),
    factor=st.floats(1.0, 100.0),
    devices=st.integers(1, 256),
    gpus_per_node=st.integers(1, 16),
)
def test_hierarchical_time_never_falls_as_gradients_grow(smaller, factor, devices, gpus_per_node):
    def seconds(size):
        return HierarchicalAllReduce(size, gpus_per_node, intra=NVLINK, inter=INFINIBAND).predict(devices)

    assert seconds(smaller * factor) >= seconds(smaller)


@settings(max_examples=50, deadline=None)
@given(gpus_per_node=st.integers(1, 16), data=st.data())
def test_hierarchical_equals_the_intra_ring_whenever_one_node_suffices(gpus_per_node, data):
    devices = data.draw(st.integers(1, gpus_per_node))
    hierarchical = HierarchicalAllReduce(4e8, gpus_per_node, intra=NVLINK, inter=INFINIBAND)
    assert hierarchical.predict(devices) == pytest.approx(float(NVLINK.ring(4e8).predict(devices)))


def test_ring_all_reduce_keeps_its_signature_and_numbers():
    ring = RingAllReduce(gradient_bytes=1e9, bandwidth_gbps=80, latency_s=1e-5)
    assert ring.predict(np.array([1, 8])) == pytest.approx([0.0, 2 * 7 * 1e-5 + 2 * 7 / 8 * 1e9 / 10e9])


# --- interconnect catalog -------------------------------------------------------------------------


def test_catalog_loads_every_link_with_positive_numbers_marked_as_assumed():
    links = load_interconnects()
    assert EXPECTED_LINKS <= set(links)
    for name, link in links.items():
        assert link.name == name and link.source == "catalog-assumed"
        assert link.bandwidth_gbps > 0 and link.latency_s > 0
        assert link.kind in {"intra_node", "inter_node", "both"} and "nominal" in link.note


def test_catalog_numbers_are_the_nominal_spec_figures():
    assert interconnect("nvlink4").bandwidth_gbps == 3600  # 900 GB/s both directions -> 450 GB/s each
    assert interconnect("infiniband_ndr").bandwidth_gbps == 400
    assert interconnect("ethernet_10g").latency_s > interconnect("infiniband_hdr").latency_s


def test_unknown_interconnect_error_lists_the_known_names():
    with pytest.raises(KeyError) as error:
        interconnect("nvlink5")
    assert "interconnect 'nvlink5' is not in the catalog" in str(error.value)
    assert all(name in str(error.value) for name in EXPECTED_LINKS)


def test_catalog_rejects_an_entry_without_a_positive_bandwidth(tmp_path):
    path = tmp_path / "links.yaml"
    path.write_text("slow:\n  bandwidth_gbps: 0\n  latency_s: 1.0e-6\n  kind: both\n  note: nominal\n")
    with pytest.raises(ValueError, match="'slow': bandwidth_gbps must be a positive number"):
        load_interconnects(path)


def test_catalog_callers_get_their_own_dict():
    load_interconnects().pop("nvlink4")
    assert "nvlink4" in load_interconnects()


# --- overlap --------------------------------------------------------------------------------------


def test_overlap_with_g_one_is_the_sum_and_with_large_g_nearly_the_max():
    comp, net = np.array([0.3, 1.0, 2.0]), np.array([0.1, 1.0, 0.5])
    assert np.array_equal(OverlapModel(1.0).combine(comp, net), comp + net)
    assert OverlapModel(10.0).combine(comp, net) == pytest.approx(np.maximum(comp, net), rel=0.08)


def test_overlap_recovers_g_from_multi_device_iterations():
    rng = np.random.default_rng(0)
    comp, net = rng.uniform(0.05, 1.0, 40), rng.uniform(0.05, 1.0, 40)
    model = OverlapModel().fit(comp, net, OverlapModel(3.0).combine(comp, net))
    assert model.source_ == "fitted" and model.g_ == pytest.approx(3.0, rel=1e-3)


def test_overlap_stays_assumed_without_multi_device_data():
    model = OverlapModel().fit([0.2, 0.4], [0.0, 0.0], [0.2, 0.4])  # single-device points: no network time
    assert model.source_ == "assumed" and model.g_ == 1.0


def test_overlap_rejects_g_outside_its_range():
    with pytest.raises(ValueError, match="g must be in"):
        OverlapModel(0.5)
