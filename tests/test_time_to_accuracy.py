"""The time-to-accuracy benchmark's parts: a training run to a target, the noise probe, the analysis and report."""

from __future__ import annotations

import math
import re
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import time_to_accuracy as tta  # noqa: E402
from offline_data import load_data  # noqa: E402

from tests.handmade import measurement, spec_dict  # noqa: E402

DIGITS = replace(tta.TASKS["digits"], batches=(16, 32, 64), partial_batches=(16, 64), max_epochs=3)


def run(batch: int = 64, **overrides) -> dict:
    return tta.train_to_target({"task": asdict(replace(DIGITS, **overrides)), "batch": batch, "lr": 0.05, "seed": 0})


def test_a_run_stops_at_the_target_and_counts_epochs_in_samples_seen():
    result = run(target_acc=0.5)
    assert result["outcome"] == "reached" and result["reached"]
    assert result["final_test_acc"] >= 0.5 and result["curve"][-1][1] == pytest.approx(result["final_test_acc"], abs=1e-4)
    steps_per_epoch = math.ceil(DIGITS.train_samples / 64)
    full_epochs, rest = divmod(result["steps"], steps_per_epoch)
    samples = full_epochs * DIGITS.train_samples + rest * 64  # the last batch of an epoch is partial
    assert result["epochs"] == pytest.approx(samples / DIGITS.train_samples)
    assert result["train_s"] > 0 and result["step_s"] == pytest.approx(result["train_s"] / result["steps"])


def test_a_run_that_cannot_reach_the_target_ends_after_max_epochs_with_whole_epochs():
    result = run(target_acc=1.01, max_epochs=2)
    assert result["outcome"] == "max_epochs" and not result["reached"]
    assert result["steps"] == 2 * math.ceil(DIGITS.train_samples / 64)
    assert result["epochs"] == pytest.approx(2.0)
    assert len(result["curve"]) >= 2 * tta.EVALS_PER_EPOCH - 2  # evaluated about EVALS_PER_EPOCH times an epoch


def test_a_tuning_run_that_took_as_many_steps_as_the_best_so_far_is_pruned_at_its_next_evaluation():
    task = asdict(replace(DIGITS, target_acc=1.01))
    result = tta.train_to_target({"task": task, "batch": 64, "lr": 0.05, "seed": 0, "prune_after_steps": 1})
    eval_every = max(1, round(math.ceil(DIGITS.train_samples / 64) / tta.EVALS_PER_EPOCH))
    assert result["outcome"] == "pruned" and result["steps"] == eval_every
    result = tta.train_to_target({"task": task, "batch": 64, "lr": 0.05, "seed": 0, "prune_after_steps": 2 * eval_every + 1})
    assert result["outcome"] == "pruned" and result["steps"] == 3 * eval_every


def test_a_diverging_run_is_reported_as_such():
    result = tta.train_to_target({"task": asdict(replace(DIGITS, target_acc=1.01)), "batch": 64, "lr": 1e6, "seed": 0})
    assert result["outcome"] == "diverged" and not result["reached"]


def test_noise_probes_leave_the_weights_buffers_and_global_rng_untouched_and_are_positive():
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))  # BN buffers
    data = load_data("digits", 1437, 360)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng_before = torch.get_rng_state()
    probe = tta.noise_probe(model, data, torch.Generator().manual_seed(1))
    assert torch.equal(torch.get_rng_state(), rng_before)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert probe["true_grad_sq_norm"] > 0 and probe["trace_sigma"] > 0
    assert probe["noise_scale"] == pytest.approx(probe["trace_sigma"] / probe["true_grad_sq_norm"])


def test_seed_zero_at_the_reference_batch_records_the_noise_scale_along_the_way():
    result = tta.train_to_target({"task": asdict(replace(DIGITS, target_acc=0.9, max_epochs=5)), "batch": 32, "lr": 0.02, "seed": 0, "probe_noise": True})
    epochs = [p["epoch"] for p in result["noise"]]
    assert epochs[0] == 0.0 and epochs == sorted(epochs) and len(epochs) >= 4
    assert result["noise"][-1]["at_target"] is result["reached"]


def test_measure_batch_tunes_the_lr_on_the_median_of_the_tuning_seeds_and_trains_every_seed_at_it():
    task = replace(DIGITS, target_acc=0.85)
    result = tta.measure_batch({"task": asdict(task), "batch": 64, "seeds": 4, "lr_multipliers": (1.0, 4.0, 0.25)})
    assert result["tuning_seeds"] == tta.TUNING_SEEDS == 3 and [r["seed"] for r in result["runs"]] == [0, 1, 2, 3]
    assert all(r["lr"] == result["lr"] for r in result["runs"])
    by_lr: dict[float, list[float]] = {}
    for r in result["tuning"]:
        by_lr.setdefault(r["lr"], []).append(r["steps"] if r["reached"] else math.inf)
    median = {lr: float(np.median(steps + [math.inf] * (3 - len(steps)))) for lr, steps in by_lr.items()}
    winner = min(median, key=median.get)  # the first of equals
    finalists = {winner} | ({result["runner_up"]["lr"]} if result["runner_up"] else set())
    assert result["lr"] in finalists and median[winner] < math.inf
    assert any(r["outcome"] == "pruned" for r in result["tuning"])  # 0.25 x falls behind
    assert len(by_lr) > 3  # the grid went on past its edges (sqrt 2 apart)
    assert result["runs"][0]["noise"] and not result["runs"][1]["noise"]  # seed 0 carries the trajectory
    assert "curve" not in result["tuning"][0]  # tuning runs are kept as records
    assert result["wall_s"] == pytest.approx(float(np.median([r["train_s"] if r["reached"] else math.inf for r in result["runs"]])))


def test_measure_batch_with_one_multiplier_trains_every_seed_at_it_without_tuning():
    result = tta.measure_batch({"task": asdict(replace(DIGITS, target_acc=0.85)), "batch": 32, "seeds": 2, "lr_multipliers": (1.0,)})
    assert [r["seed"] for r in result["runs"]] == [0, 1] and len(result["tuning"]) == 1
    assert result["lr"] == pytest.approx(DIGITS.reference_lr)


def test_summarize_runs_counts_a_seed_that_missed_the_target_as_infinitely_slow():
    runs = [
        {"reached": True, "train_s": 2.0, "epochs": 4.0, "steps": 10, "step_s": 0.2, "lr": 0.1, "lr_multiplier": 1.0},
        {"reached": False, "train_s": 9.0, "epochs": 50.0, "steps": 99, "step_s": 0.1, "lr": 0.1, "lr_multiplier": 1.0},
        {"reached": True, "train_s": 3.0, "epochs": 5.0, "steps": 12, "step_s": 0.25, "lr": 0.1, "lr_multiplier": 1.0},
    ]
    summary = tta.summarize_runs(runs)
    assert summary["wall_s"] == 3.0 and summary["wall_s_max"] == math.inf and summary["reached_seeds"] == 2
    assert summary["epochs"] == 5.0 and summary["epochs_max"] == math.inf and summary["steps"] == 11.0


def test_epochs_at_every_batch_are_timed_in_the_same_rounds():
    timing = tta.epoch_seconds_in_rounds(DIGITS, [64, 256], rounds=3)
    assert sorted(timing) == [64, 256]
    for batch, measured in timing.items():
        assert len(measured["rounds_s"]) == 3 and all(t > 0 for t in measured["rounds_s"])
        assert measured["epoch_s"] == float(np.median(measured["rounds_s"]))


def test_time_to_target_is_the_measured_epochs_times_the_epoch_time():
    summary = {"batch": 64, "epochs": 4.0, "epochs_min": 3.0, "epochs_max": math.inf, "wall_s": 9.0}
    result = tta.timed(summary, epoch_s=0.5, num_samples=1437)
    assert (result["time_s"], result["time_s_min"], result["time_s_max"]) == (2.0, 1.5, math.inf)
    assert result["step_s"] == pytest.approx(0.5 / 23) and result["wall_s"] == 9.0  # ceil(1437 / 64) = 23 steps an epoch


def test_implied_noise_scale_recovers_the_epoch_model_it_was_made_from():
    batches = [16, 64, 256, 1024, 4096]
    epochs = [5.0 * (1 + b / 300.0) for b in batches]
    implied = tta.implied_noise_scale(batches, epochs)
    assert implied["noise_scale"] == pytest.approx(300.0, rel=0.01)
    assert implied["min_epochs"] == pytest.approx(5.0, rel=0.01) and implied["rms_log_err"] < 0.01
    assert tta.implied_noise_scale([16, 64, 256], [1.0, math.inf, 3.0]) is None  # two finite points only


def recommendation_for(batches: list[int]) -> dict:
    from tula_service.plan.recommend import plan
    from tula_service.spec.job_spec import JobSpec

    spec = JobSpec.model_validate(spec_dict(batch_sizes=batches, objective="min_time", training={"reference_lr": 0.02}))
    return plan(spec, [measurement(b, trace_sigma=100.0 * 64) for b in batches])


def test_single_device_rows_and_the_choice_come_from_a_real_plan():
    recommendation = recommendation_for([16, 64, 256])
    rows = tta.single_device_rows(recommendation, 50_000)
    assert sorted(rows) == [16, 32, 64, 128, 256]
    for batch, row in rows.items():
        model = recommendation["models"]["efficiency"]
        assert row["epochs"] == pytest.approx(model["min_epochs"]["value"] * (1 + batch / model["noise_scale"]["value"]))
        assert row["time_s"] == pytest.approx(row["epochs"] * math.ceil(50_000 / batch) * row["step_s"])  # step_s: the mean step
    pick = tta.choice(recommendation)
    assert pick["global_batch"] == recommendation["chosen"]["global_batch"] and pick["devices"] == 1


def test_the_advice_read_from_a_plan_is_its_lr_and_warm_up():
    recommendation = recommendation_for([16, 64, 256])
    advised = tta.advice(recommendation)
    assert advised["lr"] == pytest.approx(0.02 * advised["lr_multiplier"])
    assert advised["warmup_epochs"] == recommendation["training_advice"]["warmup"]["epochs"]


def test_advice_check_compares_the_advised_run_with_the_tuned_one_and_the_best():
    truth = {64: {"time_s": 2.0, "lr": 0.05, "epochs": 5.0}, 128: {"time_s": 1.6, "lr": 0.07, "epochs": 6.0}}
    advised = {"batch": 64, "lr": 0.1, "lr_rule": "adascale", "warmup_epochs": 0.5, "time_s": 3.0, "epochs": 4.0, "reached_seeds": 3, "seeds": 3}
    check = tta.advice_check(advised, truth, best_time_s=1.6)
    assert check["ratio_to_tuned"] == 1.5 and check["regret"] == pytest.approx(3.0 / 1.6) and check["tuned_lr"] == 0.05
    assert check["epochs_ratio_to_tuned"] == 0.8 and check["tuned_epochs"] == 5.0
    assert tta.advice_check(None, truth, 1.6) is None


def handmade_results() -> tuple[tta.Task, dict, dict]:
    task = replace(DIGITS, batches=(16, 32, 64, 128), partial_batches=(16, 128))
    measured_time = {16: 4.0, 32: 3.0, 64: 2.0, 128: 2.5}
    truth = {
        b: {"time_s": t, "time_s_min": 0.9 * t, "time_s_max": 1.2 * t, "wall_s": 1.1 * t, "epochs": 2.0 + b / 64, "epochs_min": 0.8 * (2.0 + b / 64), "epochs_max": 1.25 * (2.0 + b / 64) if b < 128 else 1.1 * 4.0,
            "step_s": 0.001 * b, "lr": 0.02, "reached_seeds": 3, "seeds": 3,
            "runs": [{"noise": [{"epoch": 0.0, "noise_scale": 90.0}, {"epoch": 3.0, "noise_scale": 150.0}]}]}
        for b, t in measured_time.items()
    }  # fmt: skip
    predicted = {b: {"time_s": 1.1 * t, "epochs": 1.2 * (2.0 + b / 64), "step_s": 0.001 * b} for b, t in measured_time.items()}

    def pick(batch: int) -> dict:
        return {"global_batch": batch, "device_batch": batch, "devices": 1, "accumulation": 1, "predicted_time_s": 1.0, "predicted_epochs": 1.0}

    service = {
        "partial": {"predicted": predicted, "min_time": pick(128), "knee": pick(128), "profiling_s": 10.0, "batches": [16, 128],
                    "noise_scale": 80.0, "max_device_batch": 10**6},
        "full": {"predicted": predicted, "min_time": pick(64), "knee": pick(32), "profiling_s": 20.0, "batches": [16, 32, 64, 128],
                 "noise_scale": 85.0, "max_device_batch": 10**6},
    }  # fmt: skip
    return task, truth, service


def test_analyze_scores_regret_speedups_errors_and_partial_against_full():
    task, truth, service = handmade_results()
    analysis = tta.analyze(task, truth, service)
    assert analysis["best"] == {"batch": 64, "time_s": 2.0}
    assert analysis["regret"] == 1.0 and analysis["picks"]["full_knee"]["regret"] == 1.5
    assert analysis["picks"]["partial_min_time"]["regret"] == 1.25
    assert analysis["habits"]["largest"] == {"batch": 128, "time_s": 2.5, "speedup": 1.25}
    assert analysis["habits"]["default"]["speedup"] == 1.5
    assert analysis["partial_vs_full"]["same_min_time_batch"] is False
    assert analysis["on_wall_time"] == {"best_batch": 64, "regret": 1.0, "speedup_vs_largest": 1.25, "speedup_vs_default": 1.5}
    assert analysis["partial_vs_full"]["true_time_ratio_partial_over_full"] == 1.25
    assert analysis["epochs_err_pct_median"] == pytest.approx(20.0) and analysis["time_err_pct_median"] == pytest.approx(10.0)
    assert analysis["epochs_inside_seed_range"] == {"full": 3, "max_lr": 0, "batches": 4}  # 128: 1.2 x 4 epochs > the seeds' 4.4
    assert analysis["noise_scale"]["training_at_target"] == 150.0 and analysis["noise_scale"]["profiler"]["full"] == 85.0


def test_largest_habit_is_capped_by_the_predicted_memory_limit():
    task, truth, service = handmade_results()
    service["full"]["max_device_batch"] = 100
    assert tta.analyze(task, truth, service)["habits"]["largest"]["batch"] == 64


def test_summary_line_reports_the_worst_regret_and_median_speedups():
    task, truth, service = handmade_results()
    first = tta.analyze(task, truth, service)
    service["full"]["min_time"] = service["full"]["min_time"] | {"global_batch": 128}
    second = tta.analyze(task, truth, service)
    results = {"tasks": {"a": {"analysis": first}, "b": {"analysis": second}}}
    line = tta.summary_line(results)
    assert re.fullmatch(r"time_to_accuracy: tasks=2 regret=\S+ speedup_vs_largest=\S+ speedup_vs_default=\S+ epochs_err_pct=\S+", line)
    assert "regret=1.25" in line and "speedup_vs_default=1.35" in line and "speedup_vs_largest=1.12" in line


def test_write_docs_replaces_only_the_generated_block(tmp_path):
    path = tmp_path / "validation.md"
    path.write_text(f"# Title\n\nhand-written before\n\n{tta.GENERATED_START}\nold\n{tta.GENERATED_END}\n\nhand-written after\n")
    tta.write_docs("new figures", path)
    text = path.read_text()
    assert "hand-written before" in text and "hand-written after" in text and "new figures" in text and "old" not in text
    path.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        tta.write_docs("x", path)


def test_restored_reads_results_json_back_with_int_batches_and_missed_targets_as_infinity():
    task, truth, service = handmade_results()
    truth[128] |= {"time_s": math.inf, "epochs": math.inf, "epochs_min": 9.0, "epochs_max": math.inf}
    service["full"]["with_max_lr"] = {"predicted": dict(service["full"]["predicted"]), "min_time": service["full"]["min_time"]}
    stored = __import__("json").loads(__import__("json").dumps(tta.plain({"truth": truth, "service": service, "advised": None})))
    assert stored["truth"]["128"]["time_s"] is None
    back = tta.restored(stored)
    assert back["truth"][128]["time_s"] == math.inf and back["truth"][128]["epochs_min"] == 9.0 and back["truth"][64]["time_s"] == 2.0
    assert set(back["service"]["full"]["predicted"]) == set(back["service"]["full"]["with_max_lr"]["predicted"]) == {16, 32, 64, 128}
    assert tta.analyze(task, back["truth"], back["service"])["best"] == {"batch": 64, "time_s": 2.0}


def test_plain_makes_results_json_safe():
    assert tta.plain({1: [math.inf, 2.0, (3, -math.inf)]}) == {"1": [None, 2.0, [3, None]]}


def test_quick_run_end_to_end_through_a_real_server(tmp_path, capsys):
    """Ground truth, two real jobs on `tula serve` (partial and full search), the advised run, the report."""
    docs_before = (REPO / "docs" / "validation.md").read_text()
    assert tta.main(["--quick", "--tasks", "digits", "--out", str(tmp_path), "--profile-time-cap-s", "0.3"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"time_to_accuracy: tasks=1 regret=[\d.]+ speedup_vs_largest=[\d.]+ speedup_vs_default=[\d.]+ epochs_err_pct=[\d.]+", last)
    results = __import__("json").loads((tmp_path / "results.json").read_text())
    digits = results["tasks"]["digits"]
    assert digits["seeds"] == 1 and results["tasks"]["digits"]["truth"]["32"]["seeds"] == 1
    assert sorted(int(b) for b in digits["truth"]) == sorted(set(tta.quick_task(tta.TASKS["digits"]).batches) | {digits["advised"]["batch"]})
    assert digits["service"]["partial"]["batches"] == list(tta.TASKS["digits"].partial_batches)
    assert digits["service"]["full"]["profiler_threads"] == [1]  # OMP_NUM_THREADS=1 reached the profiling children
    assert digits["analysis"]["regret"] >= 1.0 and digits["analysis"]["advice"]["batch"] == digits["service"]["full"]["min_time"]["global_batch"]
    assert digits["reference"]["epochs"] == digits["truth"]["32"]["epochs"]
    capped = digits["service"]["full"]["with_max_lr"]
    assert capped["max_lr"] >= digits["reference"]["lr"] and capped["max_step_gain"] == capped["max_lr"] / digits["reference"]["lr"]
    assert (tmp_path / "time_to_accuracy.png").stat().st_size > 10_000
    assert (REPO / "docs" / "validation.md").read_text() == docs_before  # only the full run writes the docs

    # --render re-analyzes results.json (string keys, null for a missed target) to the same report
    assert tta.main(["--render", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == last
    rendered = __import__("json").loads((tmp_path / "results.json").read_text())["tasks"]["digits"]
    assert rendered["analysis"] == digits["analysis"] and rendered["truth"] == digits["truth"]
    assert (REPO / "docs" / "validation.md").read_text() == docs_before
