"""The placement-aware step-time model: recovers what generated the rows, picks the shape that did, falls back honestly."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tula_service.fit.perfmodel.network import Link
from tula_service.fit.perfmodel.placement import (
    BANDWIDTH_BOUNDS_GBPS,
    GAMMA_BOUNDS,
    PlacementStepModel,
    Shape,
    StepRow,
    packed_features,
    placement_features,
    validate_rows,
)

GRADIENT_BYTES = 45e6
# The cluster's links as a spec would give them: the latencies a shape without fitted latencies assumes.
INTRA = Link(latency_s=5e-6, bandwidth_gbps=64.0, source="assumed", name="intra-node (test)")
INTER = Link(latency_s=5e-5, bandwidth_gbps=50.0, source="assumed", name="inter-node (test)")
BATCHES = (16, 32, 64, 128, 256)
PLACEMENTS = ("2", "3", "4", "11", "22", "111", "1111", "44", "222", "13", "4444", "2222", "12")
TRUTH = Shape("hierarchical", overlap=True, contention=True, fit_latency=False)
# (lat_intra_s, xfer_intra_s, lat_inter_s, xfer_inter_s, gamma, kappa): 20 Gbit/s intra, 8 Gbit/s inter
TRUE_THETA = np.array([5e-6, GRADIENT_BYTES * 8 / 20e9, 5e-5, GRADIENT_BYTES * 8 / 8e9, 2.5, 0.06])


def synthetic_rows(shape: Shape = TRUTH, theta: np.ndarray = TRUE_THETA, noise: float = 0.02, seed: int = 0) -> list[StepRow]:
    rng = np.random.default_rng(seed)
    generator = PlacementStepModel(intra=INTRA, inter=INTER, gradient_bytes=GRADIENT_BYTES)
    rows = []
    for placement in ("1",) + PLACEMENTS:
        g, m, n = placement_features([placement])
        for batch in BATCHES:
            compute_s = 0.02 + 4e-4 * batch
            step_s = float(generator._predict_vector(theta, shape, g, m, n, np.array([compute_s]))[0]) if n[0] > 1 else compute_s
            step_s *= np.exp(noise * rng.standard_normal())
            # the compute part is T_c(b) itself: the straggler's wait is in the sync (placement docstring)
            sync_s = max(step_s - compute_s * np.exp(noise * rng.standard_normal()), 0.0)
            rows.append(StepRow(tuple(int(c) for c in placement), batch, step_s, min(sync_s, 0.99 * step_s)))
    return rows


def test_recovers_bandwidths_gamma_and_contention_from_noisy_synthetic_rows():
    model = PlacementStepModel(intra=INTRA, inter=INTER, gradient_bytes=GRADIENT_BYTES, shapes=(TRUTH,)).fit(synthetic_rows())
    params = model.params_()
    assert params["intra"]["bandwidth_gbps"] == pytest.approx(20.0, rel=0.15)
    assert params["inter"]["bandwidth_gbps"] == pytest.approx(8.0, rel=0.1)
    assert params["gamma"]["value"] == pytest.approx(2.5, rel=0.2)
    assert params["kappa"]["value"] == pytest.approx(0.06, abs=0.02)
    assert params["inter"]["source"] == "fitted" and params["inter"]["latency_source"] == "assumed"
    assert model.fit_log_rmse_ < 0.04


def test_flat_ring_costs_what_its_device_count_says_on_any_number_of_nodes():
    model = PlacementStepModel(intra=INTRA, inter=INTER, gradient_bytes=GRADIENT_BYTES, shapes=(Shape("flat", True, True, False),))
    model.fit(synthetic_rows())
    sync_11, sync_22, sync_1111 = model.allreduce_s(["11", "22", "1111"])
    assert sync_22 == pytest.approx(sync_1111) and sync_22 == pytest.approx(1.5 * sync_11, rel=0.05)  # 2 (n - 1) / n S, latency aside


def test_hierarchical_shape_predicts_the_opposite():
    model = PlacementStepModel(intra=INTRA, inter=INTER, gradient_bytes=GRADIENT_BYTES, shapes=(Shape("hierarchical", True, True, False),))
    model.fit(synthetic_rows())
    sync_11, sync_22 = model.allreduce_s(["11", "22"])
    inter_11 = 2 * 1 / 2 * model.theta_[3]
    assert sync_22 - model.allreduce_s(["2"])[0] < inter_11 <= sync_11 + 1e-12


def test_leave_placements_out_picks_the_generating_topology_and_overlap():
    shapes = tuple(Shape(t, o, True, False) for t in ("hierarchical", "flat") for o in (True, False))
    model = PlacementStepModel(intra=INTRA, inter=INTER, gradient_bytes=GRADIENT_BYTES, shapes=shapes).fit(synthetic_rows())
    assert model.shape_ == TRUTH
    chosen = model.candidates_[TRUTH.name]["held_out"]["median_rel_err"]
    assert all(c["held_out"]["median_rel_err"] >= chosen for c in model.candidates_.values())


def test_no_overlap_is_fitted_as_gamma_one_and_beats_the_assumed_gamma():
    theta = TRUE_THETA.copy()
    theta[4] = 1.0
    shapes = (Shape("hierarchical", False, True, False), TRUTH)  # gamma assumed 2, gamma fitted
    model = PlacementStepModel(intra=INTRA, inter=INTER, gradient_bytes=GRADIENT_BYTES, shapes=shapes).fit(synthetic_rows(TRUTH, theta))
    assert model.shape_ == TRUTH and model.params_()["gamma"]["value"] == pytest.approx(1.0, abs=0.15)


def test_contention_is_a_wait_in_the_sync_not_a_slower_compute_part():
    model = PlacementStepModel(intra=INTRA, inter=INTER, gradient_bytes=GRADIENT_BYTES, shapes=(TRUTH,)).fit(synthetic_rows(noise=0.0))
    compute_s = float(model.compute_.predict(np.array([64.0]))[0])
    overlapped_s = float(model.predict_placements(["4"], [64])[0]) - model.theta_[5] * 3 * compute_s
    assert model.params_()["kappa"]["value"] == pytest.approx(0.06, rel=0.05)
    assert overlapped_s == pytest.approx(float(model._predict_vector(model.theta_ * [1, 1, 1, 1, 1, 0], TRUTH, 4, 1, 4, compute_s)))


def one_batch_rows(batch: float = 64) -> list[StepRow]:
    """What a profiler measures: single-GPU rows at every batch, multi-GPU placements at one shared batch."""
    return [row for row in synthetic_rows() if sum(row.placement) == 1 or row.device_batch == batch]


def test_from_one_batch_gamma_is_assumed_two_and_says_why():
    model = PlacementStepModel(intra=INTRA, inter=INTER, gradient_bytes=GRADIENT_BYTES).fit(one_batch_rows())
    eligible = {name for name, c in model.candidates_.items() if c["eligible"]}
    assert eligible and all("gamma_assumed" in name for name in eligible) and not model.shape_.overlap
    gamma = model.params_()["gamma"]
    assert gamma["value"] == 2.0 and gamma["source"].startswith("assumed (2, halfway")
    assert "every multi-device row is at one per-GPU batch" in gamma["source"]


def test_from_two_batches_gamma_is_fitted_again():
    rows = [row for row in synthetic_rows() if sum(row.placement) == 1 or row.device_batch in (32, 128)]
    model = PlacementStepModel(intra=INTRA, inter=INTER, gradient_bytes=GRADIENT_BYTES).fit(rows)
    assert all(c["eligible"] for name, c in model.candidates_.items() if "gamma_fitted" in name)
    assert model.shape_ == TRUTH and model.params_()["gamma"]["value"] == pytest.approx(2.5, rel=0.2)


def test_without_multi_device_rows_the_given_links_are_assumed():
    single = [row for row in synthetic_rows() if sum(row.placement) == 1]
    model = PlacementStepModel(intra=INTRA, inter=INTER, gradient_bytes=GRADIENT_BYTES).fit(single)
    params = model.params_()
    assert {params[k]["source"].split(" ")[0] for k in ("intra", "inter", "gamma", "kappa")} == {"assumed"}
    assert params["inter"]["bandwidth_gbps"] == pytest.approx(model.inter.bandwidth_gbps)
    assert "assumed" in model.why_
    assert model.predict_placements(["22"], [64])[0] > model.predict_placements(["1"], [64])[0]


def test_fitted_parameters_stay_inside_their_bounds():
    rows = [StepRow(r.placement, r.device_batch, r.step_time_s * (30.0 if sum(r.placement) > 1 else 1.0)) for r in synthetic_rows()]
    model = PlacementStepModel(intra=INTRA, inter=INTER, gradient_bytes=GRADIENT_BYTES, shapes=(Shape("hierarchical", True, True, True),)).fit(rows)
    params = model.params_()
    for link in ("intra", "inter"):
        assert BANDWIDTH_BOUNDS_GBPS[0] * 0.999 <= params[link]["bandwidth_gbps"] <= BANDWIDTH_BOUNDS_GBPS[1] * 1.001
    assert GAMMA_BOUNDS[0] <= params["gamma"]["value"] <= GAMMA_BOUNDS[1]
    assert 0.0 <= params["kappa"]["value"] <= 1.0


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"placement": "20", "device_batch": 8, "step_time_s": 0.1}, "row 1: field 'placement'"),
        ({"placement": "2", "device_batch": -8, "step_time_s": 0.1}, "row 1: field 'device_batch'"),
        ({"placement": "2", "device_batch": 8, "step_time_s": "fast"}, "row 1: field 'step_time_s' must be a number"),
        ({"placement": "2", "device_batch": 8, "step_time_s": 0.1, "sync_time_s": 0.2}, "row 1: field 'sync_time_s'"),
    ],
)
def test_bad_rows_are_named_by_index_and_field(row, message):
    good = {"placement": "1", "device_batch": 8, "step_time_s": 0.05}
    with pytest.raises(ValueError, match=message):
        validate_rows([good, row])


def test_planner_sized_prediction_is_fast():
    model = PlacementStepModel(intra=INTRA, inter=INTER, gradient_bytes=GRADIENT_BYTES, shapes=(TRUTH,)).fit(synthetic_rows())
    g, m, n = packed_features(np.arange(1, 65)[:, None], gpus_per_node=4)
    batch = np.geomspace(1, 1024, 64)[None, :]
    started = time.perf_counter()
    for _ in range(3):  # packed, one per node, two per node
        step_s = model.predict(g, m, n, batch)
    assert time.perf_counter() - started < 0.05
    assert step_s.shape == (64, 64) and np.all(np.isfinite(step_s))
