"""benchmarks/momentum_signal.py's report: a reading with no resolved signal is shown as '-', not a crash."""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import momentum_signal as ms  # noqa: E402


def _row(name: str, simple: float | None, smoothed: float | None, hessian: float | None, needed: float) -> dict:
    return {"task": name, "optimizer": "sgd", "steps": 100, "service_noise_scale": 50.0, "best_noise_scale": 50.0 * needed,
            "needed_factor": needed, "simple": simple, "smoothed": smoothed,
            "smoothed_over_simple": smoothed / simple if simple and smoothed else None, "hessian": hessian,
            "hessian_over_simple": hessian / simple if simple and hessian else None}  # fmt: skip


def test_a_task_whose_signal_is_not_resolved_is_shown_as_a_dash_and_left_out_of_the_summary(monkeypatch):
    names = ("digits_mlp_sgd", "digits_cnn_sgd", "digits_cnn_adam")  # the last: B_simple not resolved, as on its reference run
    rows = {names[0]: _row(names[0], 40.0, 160.0, 30.0, 2.0), names[1]: _row(names[1], 60.0, 120.0, 80.0, 1.0),
            names[2]: _row(names[2], None, 300.0, None, 1.5)}
    monkeypatch.setattr(ms.et, "load_ground_truth", lambda: {"tasks": {name: {} for name in rows}})
    monkeypatch.setattr(ms.se, "cpu_tasks", lambda path: [SimpleNamespace(name=name) for name in rows])
    monkeypatch.setattr(ms, "evaluate", lambda name, truth, task: rows[name])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert ms.main(["--tasks", *rows]) == 0
    lines = out.getvalue().splitlines()
    assert "| digits_cnn_adam | sgd | 100 | 50 | 75 (1.50) | - | 300 | - | - | - | - | - | - | - |" in lines
    assert lines[-1].startswith("momentum_signal: tasks=2 rank_correlation=1.00 ")


def test_the_stationary_signal_is_the_gradient_less_the_fluctuation_its_own_noise_keeps_up():
    # |G|^2 = 2, tr(Sigma) = 100 at B = 32: B_simple 50; eta_eff tr(H Sigma) / (2 B) = 1.0 * 64 / 64 = 1 of the 2 is
    # the fluctuation, so the signal's noise scale is 100 / (2 - 1) = 100
    steps = [{"grad_sqr": 2.0, "trace_sigma": 100.0, "hessian_grad_sqr": 0.5, "hessian_trace_sigma": 64.0, "effective_lr": 1.0}] * 10
    assert ms.second_half_noise_scale(steps, 32, "raw") == pytest.approx(50.0)
    assert ms.second_half_noise_scale(steps, 32, "stationary") == pytest.approx(100.0)
    halved = [{**step, "effective_lr": 0.5} for step in steps]  # half the LR, half the fluctuation
    assert ms.second_half_noise_scale(halved, 32, "stationary") == pytest.approx(100.0 / 1.5)
    # steps without the Hessian-weighted estimates (Adam's first) are left out, as for B_hessian
    assert ms.second_half_noise_scale([{"grad_sqr": 2.0, "trace_sigma": 100.0}] * 4 + steps, 32, "stationary") == pytest.approx(100.0)


def test_the_lr_implied_noise_scale_is_the_best_step_without_noise_over_the_step_taken():
    # |G|^2 = 2, G^T H G = 0.5: eps_max = 4; eta 0.1 with momentum 0.9 steps eps_ref = 1: eps_max / eps_ref = 4, so the LR
    # is the best at B_ref = 32 when 1 + B_noise / 32 = 4, B_noise = 96
    steps = [{"grad_sqr": 2.0, "trace_sigma": 100.0, "hessian_grad_sqr": 0.5, "hessian_trace_sigma": 64.0, "effective_lr": 1.0}] * 10
    assert ms.lr_implied_noise_scale(steps, 32) == (pytest.approx(96.0), pytest.approx(4.0))
    # a step past the best noise-free one: no noise scale makes that LR the best, but the ratio is reported
    past = [{**step, "effective_lr": 8.0} for step in steps]
    assert ms.lr_implied_noise_scale(past, 32) == (None, pytest.approx(0.5))
    # only the second half of the steps with Hessian-weighted estimates counts; curvature that is not positive: nothing
    early = [{**step, "grad_sqr": 50.0} for step in steps]
    assert ms.lr_implied_noise_scale(early + steps, 32) == (pytest.approx(96.0), pytest.approx(4.0))
    assert ms.lr_implied_noise_scale([{**step, "hessian_grad_sqr": -0.1} for step in steps], 32) == (None, None)
    assert ms.lr_implied_noise_scale([{"grad_sqr": 2.0, "trace_sigma": 100.0}] * 4, 32) == (None, None)
