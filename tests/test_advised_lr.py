"""The advised-LR benchmark: the LR it trains at is the service's advice, its scores, and a --quick run end to end."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_statistical_efficiency import synthetic_task
from tula_service.fit.perfmodel.efficiency import adascale_gain

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import advised_lr  # noqa: E402


def task_with_lr(optimizer: str = "sgd", noise_scale: float = 400.0):
    task = synthetic_task(noise_scale=noise_scale)
    task.optimizer = optimizer
    task.lr = {b: 0.1 for b in task.epochs}
    return task


def advised_runs(task, epochs_of) -> dict:
    lrs, advice = advised_lr.advised_lrs(task)
    return {"advice": advice, "batches": {str(b): {"epochs": epochs_of(b), "lr": lr} for b, lr in lrs.items()}}


@pytest.mark.parametrize("optimizer, power", [("sgd", 1.0), ("adam", 0.5)])
def test_the_advised_lr_is_the_reference_lr_times_the_adascale_gain_of_the_noise_scale_read(optimizer, power):
    task = task_with_lr(optimizer)
    lrs, advice = advised_lr.advised_lrs(task)
    assert advice["noise_scale"] == pytest.approx(400.0, rel=1e-3)
    for batch, lr in lrs.items():
        assert lr == pytest.approx(0.1 * adascale_gain(batch / 32, advice["noise_scale"], 32) ** power)
    assert lrs[32] == pytest.approx(0.1)


def test_epochs_under_the_advice_that_match_the_prediction_score_no_error_and_the_tuned_truth_sets_the_regret():
    task = task_with_lr()
    runs = advised_runs(task, lambda b: task.epochs[b])  # the synthetic truth is the model's own curve
    result = advised_lr.evaluate(task, runs)
    assert result["median_abs_epochs_err_pct"] == pytest.approx(0.0, abs=0.05)
    assert result["regret"] == pytest.approx(1.0) and result["regret_vs_tuned"] == pytest.approx(1.0)
    assert result["cbs_ratio"] == pytest.approx(1.0, rel=0.01) and result["stale_advice_at"] == []
    slower = advised_runs(task, lambda b: 2 * task.epochs[b] if b > 32 else task.epochs[b])  # the advice costs 2x above B_ref
    scored = advised_lr.evaluate(task, slower)
    assert scored["median_abs_epochs_err_pct"] == pytest.approx(50.0, abs=0.1)
    assert scored["regret_vs_tuned"] >= scored["regret"] >= 1.0
    assert scored["advice_over_tuned_epochs"]["64"] == pytest.approx(2.0)


def test_a_batch_that_never_reached_the_target_is_reported_not_scored():
    task = task_with_lr()
    runs = advised_runs(task, lambda b: float("inf") if b == 1024 else task.epochs[b])
    result = advised_lr.evaluate(task, runs)
    assert result["did_not_reach"] == [1024] and "1024" not in result["measured_epochs"]


def test_runs_trained_at_another_advice_are_flagged_stale():
    task = task_with_lr()
    runs = advised_runs(task, lambda b: task.epochs[b])
    runs["advice"]["multipliers"]["256"] *= 1.5  # trained when the estimator read another noise scale
    assert advised_lr.evaluate(task, runs)["stale_advice_at"] == [256]
    runs = advised_runs(task, lambda b: task.epochs[b])
    task.lr[32] = 0.15  # the ground truth's reference LR tuned again: every batch trained at another LR
    assert advised_lr.evaluate(task, runs)["stale_advice_at"] == sorted(int(b) for b in runs["batches"])


@pytest.mark.skipif(not advised_lr.DEFAULT_RUNS.exists(), reason="no cached advised-LR runs")
def test_the_quick_run_reads_the_cached_runs_into_a_temporary_folder_and_ends_with_the_summary_line():
    tracked = advised_lr.DEFAULT_RUNS.read_text()
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "advised_lr.py"), "--quick"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"advised_lr: tasks=\d+ median_epochs_err_pct=[\d.]+ worst_task_epochs_err_pct=[\d.]+ "
                        r"max_regret=[\d.]+ max_regret_vs_tuned=[\d.]+", last), last  # fmt: skip
    report = Path(re.search(r"report: (\S+)", run.stderr).group(1))
    assert not report.is_relative_to(REPO) and advised_lr.DEFAULT_RUNS.read_text() == tracked
    assert "the service now advises another LR" not in run.stderr  # the cached runs match today's estimator
