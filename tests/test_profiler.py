"""The profiler on a real torch model on CPU, in-process and as the child process the server runs."""

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from profiler.measure import profile_point  # noqa: E402

DATASET = {"name": "synthetic_images", "channels": 3, "image_size": 32, "num_classes": 10}


def _request(batch_size: int, model: str = "small_cnn", **extra) -> dict:
    return {"model": model, "dataset": DATASET, "batch_size": batch_size, "warmup_iters": 1, "timed_iters": 3, "device": "cpu", **extra}


@pytest.fixture(scope="module")
def small_cnn_points():
    return {b: profile_point(_request(b)) for b in (4, 8, 16, 32)}


def test_point_reports_timing_memory_and_gradients(small_cnn_points):
    point = small_cnn_points[8]
    assert point["status"] == "ok" and point["device"] == "cpu"
    assert point["iter_time"]["count"] == 3 and len(point["iter_time"]["samples_s"]) == 3
    assert 0 < point["iter_time"]["p10_s"] <= point["iter_time"]["median_s"] <= point["iter_time"]["p90_s"]
    assert len(point["gradient"]["grad_sq_norms_at_init"]) == 4
    assert point["gradient"]["grad_sq_norm_mean"] > 0
    json.dumps(point)  # plain data only


def test_static_memory_is_weights_grads_and_momentum(small_cnn_points):
    point = small_cnn_points[8]
    weights = point["model"]["gradient_bytes"]
    breakdown = point["memory"]["static_breakdown_bytes"]
    assert breakdown == {"weights": weights, "gradients": weights, "optimizer_state": weights}  # SGD momentum


def test_activation_memory_is_linear_in_batch(small_cnn_points):
    batches = sorted(small_cnn_points)
    act = [small_cnn_points[b]["memory"]["activation_bytes"] for b in batches]
    per_sample = (act[-1] - act[0]) / (batches[-1] - batches[0])
    for b, a in zip(batches, act):
        assert a == pytest.approx(act[0] + per_sample * (b - batches[0]), rel=1e-3)
    assert per_sample > 0


def test_same_seed_gives_same_initial_gradient_at_any_batch(small_cnn_points):
    # Same weights at init for every batch size: the noise-scale fit across batches relies on it.
    first = profile_point(_request(8))
    assert first["gradient"]["grad_sq_norms_at_init"] == small_cnn_points[8]["gradient"]["grad_sq_norms_at_init"]


def test_smaller_batches_have_noisier_gradients(small_cnn_points):
    assert small_cnn_points[4]["gradient"]["grad_sq_norm_mean"] > small_cnn_points[32]["gradient"]["grad_sq_norm_mean"]


def test_resnet18_profiles_at_32x32_without_downloading_weights():
    point = profile_point(_request(4, model="resnet18", grad_draws=2))
    assert point["status"] == "ok"
    assert point["model"]["parameter_count"] == pytest.approx(11_181_642, rel=0.01)


def test_child_process_writes_the_measurement_file(tmp_path):
    out = tmp_path / "m.json"
    result = subprocess.run(
        [sys.executable, "-m", "profiler.run_point", "--request", json.dumps(_request(4)), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["batch_size"] == 4


def test_out_of_memory_is_recorded_not_raised(monkeypatch):
    import profiler.measure as measure

    def exhausted(*_args, **_kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(measure, "_measure", exhausted)
    point = measure.profile_point(_request(4))
    assert point["status"] == "oom" and "can't allocate" in point["error"]
