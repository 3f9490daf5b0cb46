"""The profiler on real torch models on CPU, in-process and as the child process the server runs."""

import json
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from profiler.measure import profile_point  # noqa: E402

IMAGES = {"name": "synthetic_images", "channels": 3, "image_size": 32, "num_classes": 10}
FAST = {"warmup_iters": 1, "timed_iters": 3, "time_cap_s": 0.2, "grad_iters": 3, "device": "cpu"}


def _request(batch_size: int, model: str = "small_cnn", **extra) -> dict:
    return {"model": model, "dataset": IMAGES, "batch_size": batch_size, **FAST, **extra}


def _r_squared(x, y) -> float:
    slope, intercept = np.polyfit(x, y, 1)
    residual = np.asarray(y) - (slope * np.asarray(x) + intercept)
    return 1 - np.sum(residual**2) / np.sum((np.asarray(y) - np.mean(y)) ** 2)


@pytest.fixture(scope="module")
def small_cnn_points():
    return {b: profile_point(_request(b)) for b in (4, 8, 16, 32)}


def test_point_reports_timing_with_spread_and_phases(small_cnn_points):
    timing = small_cnn_points[8]["iter_time"]
    assert small_cnn_points[8]["status"] == "ok" and small_cnn_points[8]["schema_version"] == 2
    assert timing["count"] >= 3 and len(timing["samples_s"]) == timing["count"]
    assert 0 < timing["p10_s"] <= timing["median_s"] <= timing["p90_s"]
    assert timing["stopped_by"] in ("cv_target", "median_rse_target", "time_cap", "max_iters")
    assert timing["warmup_iters"] >= 1
    phase_medians = sum(timing["phases"][p]["median_s"] for p in ("data_s", "forward_s", "backward_s", "optimizer_s"))
    assert phase_medians == pytest.approx(timing["median_s"], rel=0.5)
    json.dumps(small_cnn_points[8])  # plain data only


def test_sampling_stops_at_the_time_cap_when_its_targets_are_unreachable():
    timing = profile_point(_request(8, target_cv=1e-9, target_median_rse=1e-9, time_cap_s=3.0, timed_iters=2, grad_iters=0))["iter_time"]
    assert timing["stopped_by"] == "time_cap" and timing["count"] > 2


def test_the_time_cap_covers_the_whole_point_not_only_sampling():
    """With a thousand gradient iterations allowed and an unreachable CV target, the gradient
    statistics and the sampling both stop at their share of the point's one second."""
    point = profile_point(_request(8, target_cv=1e-9, target_median_rse=1e-9, time_cap_s=1.0, timed_iters=2, grad_iters=1000,
                                   grad_target_rse=0.0))
    budget = point["budget"]
    assert budget["time_cap_s"] == 1.0 and set(budget["spent_s"]) == {"setup", "gradient", "timing", "memory"}
    assert point["gradient"]["stopped_by"] == "time_cap" and 3 <= point["gradient"]["iterations"] < 1000
    assert point["iter_time"]["stopped_by"] == "time_cap"


def test_every_pass_says_how_many_iterations_it_ran_and_why_it_stopped(small_cnn_points):
    point = small_cnn_points[16]
    passes = point["budget"]["passes"]
    assert passes["gradient"] == {"iterations": point["gradient"]["iterations"], "stopped_by": point["gradient"]["stopped_by"]}
    assert passes["warmup"]["iterations"] == point["iter_time"]["warmup_iters"]
    assert passes["timing"]["iterations"] == point["iter_time"]["count"]
    assert passes["memory"]["iterations"] == point["memory"]["passes"]
    assert passes["gradient"]["stopped_by"] in ("settled", "time_cap", "max_iters")
    assert passes["warmup"]["stopped_by"] in ("settled", "time_cap", "max_iters")
    assert passes["memory"]["stopped_by"] in ("unchanged", "time_cap", "max_passes")


def test_gradient_statistics_stop_once_the_noise_scale_terms_have_settled():
    gradient = profile_point(_request(16, grad_iters=50, grad_target_rse=1e6))["gradient"]
    assert gradient["stopped_by"] == "settled" and gradient["iterations"] == 3
    assert gradient["relative_stderr"]["trace_sigma"] <= 1e6 and gradient["target_rse"] == 1e6


def test_with_time_to_spare_the_passes_run_to_their_own_ends():
    """An unreachable gradient target with a long cap runs grad_iters; the memory passes stop when
    two counts agree; sampling stops at the CV target."""
    point = profile_point(_request(16, time_cap_s=60.0, grad_iters=5, grad_target_rse=0.0, target_cv=100.0, timed_iters=3))
    assert (point["gradient"]["stopped_by"], point["gradient"]["iterations"]) == ("max_iters", 5)
    assert (point["memory"]["stopped_by"], point["memory"]["passes"]) == ("unchanged", 2)
    assert (point["iter_time"]["stopped_by"], point["iter_time"]["count"]) == ("cv_target", 3)


def test_static_memory_is_weights_grads_and_momentum(small_cnn_points):
    point = small_cnn_points[8]
    weights = point["model"]["gradient_bytes"]
    assert point["memory"]["static_breakdown_bytes"] == {"weights": weights, "gradients": weights, "optimizer_state": weights}


def test_plain_sgd_keeps_no_optimizer_state():
    point = profile_point(_request(4, optimizer_settings={"momentum": 0.0}))  # training.momentum 0: torch's SGD allocates no momentum buffer
    assert point["memory"]["static_breakdown_bytes"]["optimizer_state"] == 0 and point["options"]["optimizer_settings"] == {"momentum": 0.0}


def test_adam_keeps_two_state_tensors_per_weight():
    point = profile_point(_request(4, optimizer="adam"))
    breakdown = point["memory"]["static_breakdown_bytes"]
    assert breakdown["optimizer_state"] >= 2 * breakdown["weights"]


def test_rmsprop_keeps_one_state_tensor_per_weight():
    point = profile_point(_request(4, optimizer="rmsprop"))
    breakdown = point["memory"]["static_breakdown_bytes"]
    assert breakdown["weights"] <= breakdown["optimizer_state"] < 2 * breakdown["weights"]  # square_avg (and a step count)
    assert point["options"]["optimizer"] == "rmsprop"


def test_small_cnn_activation_memory_is_linear_in_batch(small_cnn_points):
    batches = sorted(small_cnn_points)
    act = [small_cnn_points[b]["memory"]["activation_bytes"] for b in batches]
    assert _r_squared(batches, act) > 0.999 and act[-1] > act[0]


def test_resnet18_activation_memory_is_linear_in_batch():
    points = [profile_point(_request(b, model="resnet18", grad_iters=0, time_cap_s=0.05)) for b in (2, 4, 8, 16)]
    act = [p["memory"]["activation_bytes"] for p in points]
    assert _r_squared([2, 4, 8, 16], act) > 0.999
    assert points[0]["model"]["parameter_count"] == pytest.approx(11_181_642, rel=0.01)


def test_gradient_statistics_give_a_noise_scale_and_a_variability_series(small_cnn_points):
    gradient = small_cnn_points[16]["gradient"]
    assert gradient["micro_batch"] == 4 and gradient["batch"] == 16 and gradient["iterations"] == 3
    assert len(gradient["grad_norm_series"]) == 3 and len(gradient["variability_series"]) == 2
    assert gradient["trace_sigma"] > 0


def test_micro_batches_keep_two_samples_for_batch_norm():
    gradient = profile_point(_request(4, model="resnet18", time_cap_s=0.05))["gradient"]
    assert gradient["micro_batch"] == 2 and gradient["batch"] == 4


def test_same_seed_gives_the_same_gradients():
    first, second = (profile_point(_request(8))["gradient"]["grad_norm_series"] for _ in range(2))
    assert first == second


def test_bf16_autocast_is_recorded_and_saves_activation_memory(small_cnn_points):
    point = profile_point(_request(16, dtype="bf16"))
    assert point["options"]["dtype"] == "bf16"
    assert point["memory"]["activation_bytes"] < small_cnn_points[16]["memory"]["activation_bytes"]


def test_channels_last_is_recorded():
    assert profile_point(_request(8, channels_last=True))["options"]["channels_last"] is True


def test_gpt_batches_count_sequences_and_tokens():
    tokens = {"name": "synthetic_tokens", "seq_len": 16, "vocab_size": 64}
    point = profile_point({**FAST, "model": "gpt", "dataset": tokens, "batch_size": 4, "model_options": {"layers": 1, "width": 32, "heads": 2}})
    assert point["status"] == "ok" and point["model"]["tokens_per_sample"] == 16 and point["model"]["input_kind"] == "tokens"


def _run_child(request: dict, out) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "profiler.run_point", "--request", json.dumps(request), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_child_process_writes_the_measurement_file(tmp_path):
    result = _run_child(_request(4), tmp_path / "m.json")
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "m.json").read_text())["batch_size"] == 4


def test_out_of_memory_under_a_real_address_space_limit_is_data(tmp_path):
    # 4096 x 32x32 images need ~1.4 GB of activations; the child may use 256 MiB beyond its start.
    result = _run_child(_request(4096, memory_limit_bytes=256 * 2**20), tmp_path / "m.json")
    assert result.returncode == 0, result.stderr
    record = json.loads((tmp_path / "m.json").read_text())
    assert record["status"] == "oom" and "allocate" in record["error"]
    fits = _run_child(_request(16, memory_limit_bytes=256 * 2**20), tmp_path / "ok.json")
    assert fits.returncode == 0 and json.loads((tmp_path / "ok.json").read_text())["status"] == "ok"
