import numpy as np

from tula_service.plan.knee import decreasing_envelope, find_knee

BATCHES = 2 ** np.arange(3, 14)


def test_knee_sits_at_the_noise_scale_of_a_critical_batch_curve():
    # time ~ (1/B + 1/B_noise): perfect scaling below B_noise, flat above (McCandlish et al.)
    for noise_scale in (128, 256, 512):
        knee = find_knee(BATCHES, 1.0 / BATCHES + 1.0 / noise_scale)
        assert knee.method == "kneedle"
        assert noise_scale / 2 <= knee.global_batch <= noise_scale * 2


def test_knee_of_a_broken_line_is_its_corner():
    times = np.where(BATCHES <= 512, 512.0 / BATCHES, 1.0 - 1e-6 * np.log2(BATCHES))
    assert find_knee(BATCHES, times).global_batch == 512


def test_envelope_drops_batches_that_are_not_faster():
    batches, times = decreasing_envelope(np.array([8, 16, 16, 32, 64]), np.array([4.0, 3.0, 2.0, 2.5, 1.0]))
    assert list(batches) == [8, 16, 64] and list(times) == [4.0, 2.0, 1.0]


def test_two_points_fall_back_to_the_fastest():
    knee = find_knee(np.array([8, 16]), np.array([2.0, 1.0]))
    assert (knee.global_batch, knee.method) == (16, "fastest_of_few")


def test_perfect_scaling_has_no_bend_and_takes_the_fastest():
    knee = find_knee(BATCHES, 1.0 / BATCHES)  # time halves per doubling everywhere
    assert (knee.global_batch, knee.method) == (BATCHES[-1], "no_bend_fastest")


def test_sharp_bend_on_four_points_is_the_knee():
    # four points, bend at the second
    knee = find_knee(np.array([8, 16, 32, 64]), np.array([8.0, 1.2, 1.1, 1.0]))
    assert knee.global_batch == 16 and knee.method in ("kneedle", "max_distance_fallback")


def test_every_knee_method_is_explained_and_declared_in_the_contract():
    from typing import get_args

    from tula_service.plan.knee import KNEE_METHODS
    from tula_service.plan.recommendation import Knee, KneeMethod

    assert set(get_args(KneeMethod)) == set(KNEE_METHODS)
    assert Knee.model_json_schema()["properties"]["method"]["enum"] == list(get_args(KneeMethod))
