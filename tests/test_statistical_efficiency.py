"""The statistical-efficiency benchmark: the Pollux traces as data, the scores, and a --quick run end to end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import pollux_traces  # noqa: E402
import statistical_efficiency as se  # noqa: E402

TRACES_PRESENT = (pollux_traces.TRACES / "cifar10").is_dir()
needs_traces = pytest.mark.skipif(not TRACES_PRESENT, reason="../shared/data/pollux-traces is not beside this checkout")


def synthetic_task(noise_scale: float = 400.0, dataset_size: int = 100_000) -> se.Task:
    """Epochs exactly E_min (1 + B / B_noise), and a reference trajectory with that noise scale throughout."""
    batches = [32, 64, 128, 256, 512, 1024]
    epochs = {b: 5.0 * (1 + b / noise_scale) for b in batches}
    trajectory = [{"samples": 32 * 50 * (i + 1), "batch": 32, "grad_sqr": 1.0, "trace_sigma": noise_scale, "window_steps": 50}
                  for i in range(int(epochs[32] * dataset_size / (32 * 50)))]  # fmt: skip
    return se.Task(
        name="synthetic", source="cpu", dataset_size=dataset_size, optimizer="sgd", reference_batch=32, target="x",
        epochs=epochs, epochs_range={b: (e, e) for b, e in epochs.items()},
        seconds_per_epoch={b: 100.0 / b**0.5 for b in batches}, trajectories={32: trajectory},
    )  # fmt: skip


def test_a_model_that_matches_the_truth_scores_zero_error_and_no_regret():
    result = se.evaluate(synthetic_task())
    assert result["median_abs_epochs_err_pct"] == pytest.approx(0.0, abs=0.01)
    assert result["regret"]["regret"] == pytest.approx(1.0) and result["cbs_ratio"] == pytest.approx(1.0, rel=1e-3)
    assert result["evidence"] == "reference_run"


def test_a_noise_scale_off_by_4x_shows_in_every_score():
    task = synthetic_task()
    task.trajectories[32] = [dict(r, trace_sigma=100.0) for r in task.trajectories[32]]  # reads 100, the truth is 400
    result = se.evaluate(task)
    assert result["cbs_ratio"] == pytest.approx(4.0, rel=1e-3)
    assert result["median_abs_epochs_err_pct"] > 50


def test_one_more_run_at_a_batch_far_off_brings_a_wrong_read_back_and_the_service_suggests_that_batch():
    """The records read 100 where the truth is 400 (the reference run alone misses by over 50%). One more exact run at
    8x the reference batch outweighs that read in the joint fit: error a few percent, at 2x less so. The
    multiple the benchmark scores is the one the service names (efficiency_evidence.NEXT_RUN_MULTIPLE)."""
    import one_more_run

    from tula_service.fit.efficiency_evidence import NEXT_RUN_MULTIPLE

    task = synthetic_task()
    task.trajectories[32] = [dict(r, trace_sigma=100.0) for r in task.trajectories[32]]
    result = se.evaluate(task)
    rows = result["one_more_run"]
    assert set(rows) == {"2", "4", "8", "16"} and rows["8"]["batch"] == 256 and rows["8"]["with_prior"]
    assert rows["8"]["median_abs_epochs_err_pct"] < 5.0 < result["median_abs_epochs_err_pct"]
    assert rows["2"]["median_abs_epochs_err_pct"] > rows["8"]["median_abs_epochs_err_pct"]
    assert rows["8"]["runs_alone"]["median_abs_epochs_err_pct"] == pytest.approx(0.0, abs=0.01)  # exact runs, no prior
    assert one_more_run.ADVISED_MULTIPLE == NEXT_RUN_MULTIPLE
    line = one_more_run.summary_line([result])
    assert line.startswith("one_more_run: at=8x tasks=1 ") and "tasks_over_15pct=0" in line


def test_a_task_is_scored_with_the_prior_calibrated_without_it():
    """One more run's prior (its factors, median ratio and run scatter) comes from the shipped calibration with the
    scored task left out, and the shipped one is back afterwards."""
    import one_more_run

    from tula_service.fit import epochs_calibration

    shipped = epochs_calibration.load_calibration()
    task = sorted(shipped["run_scatter"]["per_task"])[0]
    with one_more_run.held_out_calibration(task) as held:
        assert epochs_calibration.load_calibration() is held
        assert held["evidence"]["reference_run"]["tasks"] == shipped["evidence"]["reference_run"]["tasks"] - 1
        assert held["run_scatter"]["tasks"] == shipped["run_scatter"]["tasks"] - 1 and task not in held["run_scatter"]["per_task"]
        prior = epochs_calibration.noise_scale_prior("reference_run", 100.0)
        assert prior["run_scatter_log"] == held["run_scatter"]["rms_log"]
    assert epochs_calibration.load_calibration() is shipped


def test_the_window_in_progress_starts_where_half_the_progress_was_made():
    """r / b per sample: constant -> half the samples; twice as fast in the first half of the run -> 3/8 of them
    (the first half holds 2/3 of the progress); a noise scale 3x the batch throughout gives the same as constant."""
    target = 1_000_000.0
    samples = np.linspace(1_000, target, 1_000)
    records = lambda grad_sqr: [{"samples": float(s), "batch": 32, "grad_sqr": float(g), "trace_sigma": 32.0}  # noqa: E731
                                for s, g in zip(samples, grad_sqr)]  # fmt: skip
    constant = se.progress_fraction_start(records(np.ones_like(samples)), target, 32, "raw", 0.5)
    assert constant == pytest.approx(0.5, abs=1e-3)
    # r = g / (g + 1): 1/2 with g = 1, 3/4 with g = 3 -> steps of r 3/4 then 3/8 need g = 3 then 3/5
    stepped = np.where(samples <= target / 2, 3.0, 0.6)
    assert se.progress_fraction_start(records(stepped), target, 32, "raw", 0.5) == pytest.approx(3 / 8, abs=2e-3)
    assert se.progress_fraction_start(records(np.full_like(samples, -1.0)), target, 32, "raw", 0.5) is None  # none resolved
    assert se.progress_fraction_start(records(np.ones(1)), target, 32, "raw", 0.5) is None  # one record


def test_the_truth_floor_of_an_exact_truth_is_its_own_noise_scale_with_no_error():
    floor = se.evaluate(synthetic_task(noise_scale=400.0))["truth_floor"]
    assert floor["best_noise_scale"] == pytest.approx(400.0, rel=0.01)
    assert floor["best_median_abs_epochs_err_pct"] < 0.1 and floor["fitted_curve_median_abs_epochs_err_pct"] < 0.1
    assert floor["reference_off_fitted_curve_pct"] == pytest.approx(0.0, abs=0.01)


def test_the_truth_floor_shows_a_reference_run_off_the_curve():
    task = synthetic_task()
    task.epochs[32] *= 1.2  # the reference run's epochs 20% above the curve every other batch lies on
    floor = se.evaluate(task)["truth_floor"]
    assert floor["reference_off_fitted_curve_pct"] > 10 and floor["best_median_abs_epochs_err_pct"] > 1


def test_the_momentum_ablation_keeps_the_effective_lr_and_takes_sgd_tasks_only():
    assert se.ablation_lr_scale(0.9, 0.0) == pytest.approx(10.0) and se.ablation_lr_scale(0.9, 0.9) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="momentum must be in"):
        se.ablation_lr_scale(0.9, 1.0)
    with pytest.raises(ValueError, match="SGD tasks"):
        se.momentum_ablation(["mnist1d_cnn1d_adam"])


def test_on_a_flat_step_clock_the_pick_is_the_fewest_predicted_steps_and_rising_steps_show_as_regret():
    """Time ~ epochs / B where a step costs the same at every batch: the exact model picks the measured best; steps
    that rise past 512 (epochs 3x at 1024, as mnist1d_cnn1d_adam's 2048 on the H200) make its pick of 1024 cost
    1.5x, which the CPU clock's regret does not see."""
    exact = se.evaluate(synthetic_task())
    assert exact["flat_step_regret"] == {"pick": 1024, "best": 1024, "regret": pytest.approx(1.0)}
    task = synthetic_task()
    task.epochs[1024] = 3 * task.epochs[512]
    rising = se.evaluate(task)
    assert rising["flat_step_regret"]["pick"] == 1024 and rising["flat_step_regret"]["best"] == 512
    assert rising["flat_step_regret"]["regret"] == pytest.approx(1.5) and rising["regret"]["regret"] == pytest.approx(1.0)
    line = se.flat_step_line([exact, rising])
    assert line == "flat_step_time: tasks=2 max_regret=1.50 median_regret=1.25 tasks_over_1.10=1"


def test_the_summary_line_takes_medians_and_worsts():
    results = [{"median_abs_epochs_err_pct": e, "regret": {"regret": r}, "cbs_ratio": c}
               for e, r, c in ((5.0, 1.0, 1.2), (15.0, 1.3, 2.0), (10.0, 1.05, 1.1))]  # fmt: skip
    assert se.summary_line(results) == (
        "statistical_efficiency: tasks=3 median_epochs_err_pct=10.0 worst_task_epochs_err_pct=15.0 max_regret=1.30 cbs_ratio_max=2.00"
    )


@needs_traces
def test_pollux_runs_become_records_in_the_service_contract():
    from tula_service.spec.job_spec import GradientStatsRecord

    app = pollux_traces.APPLICATIONS["cifar10"]
    runs = pollux_traces.load_runs(app)
    assert sorted(runs) == [128, 256, 512, 1024, 2048, 4096]
    records = pollux_traces.gradient_stats(app, 128, runs[128])
    for record in records:
        GradientStatsRecord.model_validate(record)
    first = records[0]
    assert first["trace_sigma"] / first["grad_sqr"] == pytest.approx(runs[128]["grad_var"][0] * 128 / runs[128]["grad_sqr"][0])


@needs_traces
def test_pollux_step_times_take_the_fastest_packed_placement():
    app = pollux_traces.APPLICATIONS["cifar10"]
    step_times = pollux_traces.load_step_times(app)
    placements = pollux_traces.packed_placements(4, 4)
    assert placements == ["1", "2", "3", "4", "44", "444", "4444"]
    best = pollux_traces.seconds_per_sample(step_times, 1024, placements)
    for placement in placements:
        gpus = sum(map(int, placement))
        batches, seconds = step_times[placement]
        if 1024 / gpus in batches:
            assert best["s_per_sample"] <= seconds[list(batches).index(1024 / gpus)] / 1024 + 1e-12


@needs_traces
def test_the_quick_run_writes_into_a_temporary_folder_and_ends_with_the_summary_line(tmp_path):
    tracked = REPO / "docs" / "validation.md"
    before = tracked.read_text()
    shipped_before = (REPO / "configs" / "epochs_calibration.json").read_text()
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "statistical_efficiency.py"), "--quick"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"statistical_efficiency: tasks=(\d+) median_epochs_err_pct=([\d.]+) worst_task_epochs_err_pct=([\d.]+) "
                         r"max_regret=([\d.]+) cbs_ratio_max=([\d.]+)", last)  # fmt: skip
    assert match and int(match.group(1)) >= 2
    report = Path(re.search(r"report: (\S+)", run.stderr).group(1))
    assert not report.is_relative_to(REPO) and tracked.read_text() == before
    shipped = REPO / "configs" / "epochs_calibration.json"
    assert json.loads((report.parent / "epochs_calibration.json").read_text())["evidence"]  # written beside the report
    assert shipped.read_text() == shipped_before  # the service's calibration is rewritten by the full run only
    assert re.fullmatch(r"flat_step_time: tasks=\d+ max_regret=[\d.]+ median_regret=[\d.]+ tasks_over_1\.10=\d+",
                        run.stdout.strip().splitlines()[-4])  # fmt: skip
    assert re.fullmatch(r"one_more_run: at=8x tasks=\d+ median_epochs_err_pct=[\d.]+ worst_task_epochs_err_pct=[\d.]+ max_regret=[\d.]+ "
                        r"runs_alone_worst_task_epochs_err_pct=[\d.]+ runs_alone_max_regret=[\d.]+ tasks_over_15pct=\d+ inside_80pct_interval=\d+/\d+",
                        run.stdout.strip().splitlines()[-5])  # fmt: skip
    coverage = run.stdout.strip().splitlines()[-3]
    assert re.fullmatch(r"calibrated_interval: factors=[\d.]+/[\d.]+ epochs_inside_leave_one_out=\d+/\d+ every_reference=\d+/\d+ "
                        r"best_noise_scale_inside_statistical=\d+/\d+ best_noise_scale_inside_calibrated=\d+/\d+", coverage)  # fmt: skip
    sparse = run.stdout.strip().splitlines()[-2]  # records thinned to every k-th: pollux and cpu, median/worst per stride
    assert re.fullmatch(r"sparse_records:( (pollux|cpu)_k\d+=[\d.]+/[\d.]+)+", sparse) and "pollux_k32=" in sparse, sparse
    results = json.loads((report.parent / "results.json").read_text())["results"]
    pollux = {r["task"]: r for r in results if r["source"] == "pollux"}
    assert set(pollux) == {"pollux-cifar10", "pollux-imagenet"}
    assert all(np.isfinite(r["median_abs_epochs_err_pct"]) and r["evidence"] == "reference_run" for r in pollux.values())


def test_an_exact_truth_calibrates_to_no_error_and_every_batch_inside():
    """Epochs exactly E_min (1 + B / B_noise) on every task: every ratio B_exact / read is 1, so the factors are
    [1, 1], and left out in turn every measured batch lies inside (the interval is the prediction itself)."""
    results = [se.evaluate(synthetic_task(noise_scale=n)) for n in (100.0, 200.0, 400.0, 800.0, 1600.0, 3200.0)]
    results = [{**r, "task": f"synthetic-{i}"} for i, r in enumerate(results)]
    calibrated = se.calibration(results, "today")["evidence"]["reference_run"]
    assert calibrated["factors"] == pytest.approx([1.0, 1.0], rel=1e-3) and calibrated["tasks"] == 6
    rows = se.interval_coverage(results)
    assert [(row["epochs_inside"], row["epochs"]) for row in rows] == [(5, 5)] * 6


def test_a_task_the_others_do_not_cover_falls_outside_when_left_out():
    results = [{**se.evaluate(synthetic_task(noise_scale=400.0)), "task": f"exact-{i}"} for i in range(5)]
    off = se.evaluate(synthetic_task(noise_scale=400.0))
    off = {**off, "task": "read-4x-low", "noise_scale": off["noise_scale"] / 4}  # a reading 4x below its epochs' B_noise
    rows = {row["task"]: row for row in se.interval_coverage([*results, off])}
    assert rows["read-4x-low"]["epochs_inside"] == 0 and rows["exact-0"]["epochs_inside"] == rows["exact-0"]["epochs"]


def _with_run_at(task: se.Task, batch: int, read: float) -> se.Task:
    """The task with a run at `batch` whose records read `read` throughout."""
    steps = int(task.epochs[batch] * task.dataset_size / (batch * 50))
    task.trajectories[batch] = [{"samples": batch * 50 * (i + 1), "batch": batch, "grad_sqr": 1.0, "trace_sigma": read,
                                 "window_steps": 50} for i in range(steps)]  # fmt: skip
    return task


def test_every_run_of_a_task_serves_as_the_reference_run_of_the_calibration():
    """A run at 512 that reads its noise scale 4x high (as a larger reference run does on Pollux) enters the ratios the
    factors are the quantiles of, though the benchmark's reference run at 32 reads exactly; and it counts in the
    every-reference coverage."""
    exact = [{**se.evaluate(synthetic_task(noise_scale=400.0)), "task": f"exact-{i}"} for i in range(5)]
    high = {**se.evaluate(_with_run_at(synthetic_task(noise_scale=400.0), 512, 1600.0)), "task": "reads-high-at-512"}
    assert set(high["every_reference"]) == {"32", "512"} and high["every_reference"]["512"]["noise_scale"] == pytest.approx(1600.0)
    entry = se.calibration([*exact, high], "today")["evidence"]["reference_run"]
    assert entry["pairs"] == 5 * 5 + 2 * 5 and entry["references"] == "every run of each task in turn"
    assert sorted(entry["ratios"]["reads-high-at-512"])[0] == pytest.approx(0.25, rel=1e-3)  # B_exact 400 over the read 1600
    rows = {row["task"]: row for row in se.interval_coverage([*exact, high])}
    # left out, its run at 512 reads 4x high against factors [1, 1] from the exact tasks: its 5 other batches fall outside
    assert (rows["reads-high-at-512"]["every_reference_inside"], rows["reads-high-at-512"]["every_reference_epochs"]) == (5, 10)
    assert (rows["reads-high-at-512"]["epochs_inside"], rows["exact-0"]["every_reference_inside"]) == (5, 5)


def test_the_training_losss_critical_batch_is_fitted_where_each_batchs_run_reached_the_reference_runs_final_loss():
    task = synthetic_task()
    critical = 100.0
    steps = 20
    for batch in task.epochs:  # each run's training loss falls linearly to 0.1 over E_min (1 + B / 100) epochs
        total = 2.0 * (1 + batch / critical)
        task.loss_curves[batch] = [(total * i / steps, 1.0 - 0.9 * i / steps) for i in range(1, steps + 1)]
    result = se.training_loss_critical_batch(task, read=400.0, test_critical_batch=400.0)
    assert result["loss"] == pytest.approx(0.145)  # the mean of the reference run's last 3 records
    assert set(result["epochs"]) == {str(b) for b in task.epochs}
    assert result["critical_batch"] == pytest.approx(critical, rel=1e-3)
    assert result["read_over"] == pytest.approx(4.0, rel=1e-3) and result["test_over"] == pytest.approx(4.0, rel=1e-3)
    for batch in (256, 512, 1024):  # runs that stopped before that loss (at their test target) are left out
        task.loss_curves[batch] = task.loss_curves[batch][:10]
    short = se.training_loss_critical_batch(task, read=400.0, test_critical_batch=400.0)
    assert short["critical_batch"] is None and set(short["epochs"]) == {"32", "64", "128"}
    assert se.training_loss_critical_batch(synthetic_task(), read=400.0, test_critical_batch=400.0) is None  # no loss curves
