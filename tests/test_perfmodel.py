import numpy as np
import pytest

from tula_service.fit.perfmodel import ComputeModel, EpochModel, MemoryModel, NoiseScaleModel, RingAllReduce
from tula_service.fit.perfmodel.efficiency import max_step_gain
from tula_service.fit.perfmodel.validation import leave_one_out_relative_errors

BATCHES = np.array([8, 16, 32, 64, 128], dtype=float)


def test_memory_model_recovers_static_and_per_sample_bytes():
    model = MemoryModel().fit(BATCHES, 5e8 + 2e6 * BATCHES)
    assert model.static_bytes_ == pytest.approx(5e8)
    assert model.act_bytes_per_sample_ == pytest.approx(2e6)
    assert model.r2_ == pytest.approx(1.0)


def test_max_device_batch_respects_capacity_and_margin():
    model = MemoryModel().fit(BATCHES, 1e9 + 1e7 * BATCHES)
    # usable = 10 GB * 0.95 - 1 GB = 8.5 GB -> 850 samples
    assert model.max_device_batch(10e9, margin=0.05) == 850
    assert model.max_device_batch(0.5e9) == 0


def test_compute_model_recovers_line_and_never_goes_negative():
    model = ComputeModel().fit(BATCHES, 0.02 + 0.003 * BATCHES)
    assert (model.alpha_s_, model.beta_s_per_sample_) == pytest.approx((0.02, 0.003))
    falling = ComputeModel().fit(BATCHES, 1.0 - 0.001 * BATCHES)  # noise that "decreases" with batch
    assert falling.beta_s_per_sample_ >= 0 and falling.alpha_s_ >= 0


def test_ring_all_reduce_matches_the_formula():
    ring = RingAllReduce(gradient_bytes=1e9, bandwidth_gbps=80, latency_s=1e-5)
    expected = 2 * 7 * 1e-5 + 2 * 7 / 8 * 1e9 / 10e9
    assert ring.predict(8) == pytest.approx(expected)
    assert ring.predict(1) == 0.0


def test_noise_scale_pools_numerators_and_denominators_before_dividing():
    # per-point ratios 100 and 400; pooled (equal weights): (200 + 400) / (2 + 1) = 200, not 250
    noise = NoiseScaleModel().fit([2.0, 1.0], [200.0, 400.0])
    assert noise.informative_ and noise.noise_scale_ == pytest.approx(200.0)


def test_noise_scale_weighs_every_point_alike_so_no_batch_dominates():
    noise = NoiseScaleModel().fit([1.0, 1.0, 1.0], [100.0, 100.0, 400.0])
    assert noise.noise_scale_ == pytest.approx(200.0)


def test_noise_scale_stderr_reflects_the_spread_between_points():
    tight = NoiseScaleModel().fit([1.0, 1.01, 0.99], [100.0, 101.0, 99.5])
    loose = NoiseScaleModel().fit([1.0, 2.0, 0.5], [100.0, 50.0, 200.0])
    assert tight.noise_scale_stderr_ < 0.05 * tight.noise_scale_ < loose.noise_scale_stderr_


def test_noise_scale_is_not_informative_when_signal_vanishes():
    noise = NoiseScaleModel().fit([-0.1, 0.05], [500.0, 400.0])
    assert not noise.informative_ and noise.noise_scale_ is None


def test_epoch_model_is_calibrated_by_the_reference_run():
    epochs = EpochModel(reference_batch=256, reference_epochs=30, noise_scale=256)
    assert epochs.predict(256) == pytest.approx(30)
    assert epochs.min_epochs == pytest.approx(15)
    assert epochs.predict(1024) == pytest.approx(15 * 5)


def test_epoch_model_without_noise_scale_keeps_reference_steps_beyond_reference_batch():
    assert list(EpochModel(32, 10, None).predict(np.array([8, 32, 128]))) == [10, 10, 40]


def test_a_max_step_gain_floors_the_steps_at_reference_steps_over_the_gain():
    # E_ref = 8 at B_ref = 32, B_noise = 800: E_min = 8 / 1.04; a step is worth at most 12 reference steps
    epochs = EpochModel(32, 8.0, 800.0, max_step_gain=12.0)
    free = EpochModel(32, 8.0, 800.0)
    batches = np.array([32, 256, 4096])
    floor = 8.0 * batches / (32 * 12.0)  # S_ref / 12 steps: 8 * 20000/32 / 12 steps of B samples, in epochs
    assert list(epochs.predict(batches)) == pytest.approx(list(np.maximum(free.predict(batches), floor)))
    assert epochs.predict(32) == pytest.approx(8.0)  # the reference run is still reproduced
    assert epochs.predict(256) == pytest.approx(free.predict(256))  # the noise bound decides below the wall
    assert epochs.predict(4096) == pytest.approx(8.0 * 128 / 12.0)
    assert epochs.predict(4096) > free.predict(4096)
    steps_ref, steps_4096 = 8.0 * 20_000 / 32, epochs.predict(4096) * 20_000 / 4096
    assert steps_4096 == pytest.approx(steps_ref / 12.0)
    with pytest.raises(ValueError, match="max_step_gain must be >= 1"):
        EpochModel(32, 8.0, 800.0, max_step_gain=0.5)


def test_the_step_gain_ceiling_is_the_lr_ratio_for_sgd_and_its_square_for_adam():
    assert max_step_gain("sgd", 0.1, 0.4) == pytest.approx(4.0)
    assert max_step_gain("adam", 0.001, 0.003) == pytest.approx(9.0)  # Adam's LR grows with sqrt(gain)
    assert max_step_gain("adamw", 0.001, None) is None and max_step_gain("sgd", None, 0.4) is None


def test_the_epochs_model_gives_the_adascale_gain_and_lr_multiplier_of_its_noise_scale():
    sgd, adam = EpochModel(32, 8.0, 100.0), EpochModel(32, 8.0, 100.0, optimizer="adam")
    gain = (1 + 100 / 32) / (1 + 100 / 256)  # r(8) of B_noise = 100 at B_ref = 32
    assert sgd.step_gain(256) == pytest.approx(gain) and adam.step_gain(256) == pytest.approx(gain)
    assert sgd.lr_multiplier(256) == pytest.approx(gain) and adam.lr_multiplier(256) == pytest.approx(np.sqrt(gain))
    assert sgd.step_gain(32) == pytest.approx(1.0)
    assert EpochModel(32, 8.0, None).step_gain(256) is None and EpochModel(32, 8.0, None).lr_multiplier(256) is None
    # a gain bought by the LR at max_lr is the ceiling of the floor: max_step_gain inverts lr_multiplier
    assert max_step_gain("adam", 1.0, adam.lr_multiplier(256)) == pytest.approx(gain)


def test_without_a_noise_scale_a_max_step_gain_changes_nothing():
    assert list(EpochModel(32, 10, None, max_step_gain=4.0).predict(np.array([8, 32, 128]))) == [10, 10, 40]


def test_leave_one_out_is_zero_on_an_exact_line_and_positive_on_a_curve():
    assert max(leave_one_out_relative_errors(MemoryModel, BATCHES, 3 + 2 * BATCHES)) < 1e-9
    assert max(leave_one_out_relative_errors(MemoryModel, BATCHES, BATCHES**2)) > 0.1
