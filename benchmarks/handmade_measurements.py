"""Hand-made measurements with known parameters, shaped like the profiler's JSON, and the job spec
they belong to: for a benchmark that times the planner on exact lines (`planner_speed.py`) and for
the tests (`tests/handmade.py` re-exports them).

It lives here rather than in tests/ because a benchmark never imports the test suite, while the tests
can import this folder (as `benchmarks.live_server`).
"""

from __future__ import annotations

import copy
from typing import Any

BASE_SPEC: dict[str, Any] = {
    "name": "handmade",
    "model": "small_cnn",
    "dataset": {"name": "synthetic_images", "num_samples": 50_000},
    "batch_sizes": [8, 16, 32, 64, 128],
    "cluster": {"nodes": 1, "gpus_per_node": 1, "device_memory_gib": 16, "interconnect_gbps": 100},
    "pricing": {"kind": "gpu_hour", "price": 2.0},
    "objective": "knee",
    "training": {"reference_batch": 32, "reference_epochs": 10},
}


def spec_dict(**overrides: Any) -> dict[str, Any]:
    spec = copy.deepcopy(BASE_SPEC)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key].update(value)
        else:
            spec[key] = value
    return spec


def measurement(
    batch_size: int,
    *,
    static_bytes: float = 1e8,
    act_bytes_per_sample: float = 1e6,
    alpha_s: float = 0.01,
    beta_s_per_sample: float = 0.001,
    true_grad_sq_norm: float = 1.0,
    trace_sigma: float = 100.0,
    gradient_bytes: int = 4_000_000,
) -> dict[str, Any]:
    """An exact point of M(b) = static + act b, T(b) = alpha + beta b, and known |G|^2, tr(Sigma)."""
    iter_time_s = alpha_s + beta_s_per_sample * batch_size
    return {
        "schema_version": 2,
        "kind": "compute",
        "status": "ok",
        "batch_size": batch_size,
        "device": "cpu",
        "iter_time": {"median_s": iter_time_s, "p10_s": iter_time_s, "p90_s": iter_time_s, "cv": 0.0, "count": 10},
        "memory": {
            "peak_bytes": static_bytes + act_bytes_per_sample * batch_size,
            "static_bytes": static_bytes,
            "activation_bytes": act_bytes_per_sample * batch_size,
        },
        "gradient": {"true_grad_sq_norm": true_grad_sq_norm, "trace_sigma": trace_sigma, "iterations": 8, "batch": batch_size},
        "model": {"parameter_count": gradient_bytes // 4, "gradient_bytes": gradient_bytes},
    }
