"""benchmarks/online.py's parts that decide what a run trains with and what it reports: the job a task submits,
the static and scheduled arms, the replay of an online run's changes, and the summary line."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import online  # noqa: E402
from efficiency_tasks import TASKS  # noqa: E402

from tula_service.spec.job_spec import JobSpec  # noqa: E402

TRUTH = json.loads(online.GROUND_TRUTH.read_text())["tasks"]


PLANNED_TASKS = [name for name, task in TASKS.items() if task.dataset in online.JOB_DATASETS]


@pytest.mark.parametrize("name", PLANNED_TASKS)
def test_each_task_submits_a_valid_job_with_a_pilot_over_a_tenth_of_the_reference_run(name, monkeypatch):
    monkeypatch.setenv("TULA_DATA_ROOTS", str(online.STDLIB_TOKEN_FILE.parent))  # the GPT's text, as main() serves it
    task, truth = TASKS[name], TRUTH[name]
    reference = truth["batches"][str(task.reference_batch)]
    pilot = JobSpec.model_validate(online.job_spec(task, truth))
    assert pilot.profiling.pilot and pilot.training.reference_run is None
    steps = reference["epochs"] * task.train_samples / task.reference_batch
    assert pilot.profiling.pilot_steps == max(10, round(online.PILOT_SHARE * steps))
    whole = JobSpec.model_validate(online.job_spec(task, truth, "reference_run"))
    assert not whole.profiling.pilot and len(whole.training.reference_run.gradient_stats) == len(reference["trajectory"])
    assert whole.training.reference_lr == reference["lr"] and whole.training.reference_epochs == reference["epochs"]
    if task.pretrained:  # a fine-tuning task: the job's points and pilot start from the weights its runs start from
        assert pilot.initial_weights == whole.initial_weights and pilot.initial_weights.endswith(f"pretrained/{task.pretrained}.pt")
    else:
        assert pilot.initial_weights is None


def test_every_suite_task_but_the_flat_digits_ones_is_planned_with_its_own_model_and_data():
    assert set(online.DEFAULT_TASKS) <= set(PLANNED_TASKS) and {"stdlib_gpt_adamw", "mnist1d_gru_sgd", "digits_resnet_sgd"} <= set(PLANNED_TASKS)
    gpt = online.job_spec(TASKS["stdlib_gpt_adamw"], TRUTH["stdlib_gpt_adamw"])
    assert gpt["model_options"] == {"layers": 2, "width": 32, "heads": 4}
    assert gpt["dataset"] == {"name": "token_file", "path": str(online.STDLIB_TOKEN_FILE), "num_samples": 2048, "seq_len": 32}
    with pytest.raises(ValueError, match="digits_x16_flat"):
        online.job_spec(TASKS["digits_mlp_sgd"], TRUTH["digits_mlp_sgd"])
    regression = JobSpec.model_validate(online.job_spec(TASKS["diabetes_mlp_adam"], TRUTH["diabetes_mlp_adam"]))
    assert regression.dataset.name == "diabetes" and regression.dataset.num_samples == 353 and regression.loss is None  # mse


def test_a_batch_norm_task_trains_every_step_in_its_ground_truths_micro_batches_in_every_arm():
    """Batch norm normalizes each micro-batch by its own statistics: a split only on the client's sampled steps would
    change what the online arm trains with. The ResNet trains split on every step, as its ground truth does."""
    resnet, cnn = TASKS["digits_resnet_adamw"], TASKS["digits_cnn_sgd"]
    assert online.every_step_pieces(resnet, 64) == 4 and online.client_accumulation(resnet, 64) == 4
    assert online.every_step_pieces(cnn, 64) == 1 and online.client_accumulation(cnn, 64) == online.MICRO_BATCHES
    model = online.on_device(resnet, 0, online.task_data(resnet))
    passes = []
    model.register_forward_pre_hook(lambda module, args: passes.append(args[0].shape[0]))
    optimizer = online.task_optimizer(resnet, model, 1e-3)
    x, y = online.task_data(resnet)["train_x"][:64], online.task_data(resnet)["train_y"][:64]
    online.plain_step(model, optimizer, x, y, online.every_step_pieces(resnet, 64))
    assert passes == [16] * 4
    passes.clear()

    class NotSampling:
        sampling = False

        def step(self, loss=None, metric=None):
            pass

    online.split_step(model, optimizer, x, y, NotSampling(), online.every_step_pieces(resnet, 64))
    assert passes == [16] * 4  # the client's plain step is split as well
    passes.clear()
    online.split_step(model, optimizer, x, y, NotSampling())
    assert passes == [64]  # a task without batch norm: whole


def test_a_schedule_switches_by_epochs_done_with_its_lr_after_the_warmup():
    stages = [{"from_epoch": 0.0, "global_batch": 32, "lr_multiplier": 1.0}, {"from_epoch": 2.0, "global_batch": 128, "lr_multiplier": 3.0}]
    arm = online.Arm(stages, reference_lr=0.1, warmup_steps=10)
    assert arm.at(0.0, 0) == (32, pytest.approx(0.1)) and arm.at(0.5, 10) == (32, pytest.approx(0.1))
    assert arm.at(2.0, 100) == (128, pytest.approx(0.3)) and arm.at(5.0, 400) == (128, pytest.approx(0.3))
    warm = online.Arm([{"from_epoch": 0.0, "global_batch": 64, "lr_multiplier": 2.0}], 0.1, 10)
    assert warm.at(0.0, 5) == (64, pytest.approx(0.15))  # halfway from the reference LR to the stage's


def test_a_replay_makes_the_same_changes_at_the_same_steps():
    changes = [(0, 64, 0.2), (40, 128, 0.35), (90, 32, 0.1)]
    replay = online.Replay(changes, reference_lr=0.1, warmup_steps=0)
    assert [replay.at(0.0, step) for step in (0, 39, 40, 89, 90, 500)] == [
        (64, 0.2), (64, 0.2), (128, 0.35), (128, 0.35), (32, 0.1), (32, 0.1)]


def _result(online_ratio, overhead_pct):
    return {"ratio_vs_static": {"online": online_ratio}, "overhead": {"overhead_pct": overhead_pct}}


def test_the_summary_line_gives_the_medians_and_an_unreached_target_as_infinite():
    line = online.summary_line([_result(0.8, 1.0), _result(0.9, 3.0), _result(1.5, 2.0)])
    assert re.fullmatch(r"online: tasks=3 time_ratio_vs_static=0\.900 overhead_pct=2\.00", line)
    assert "time_ratio_vs_static=inf" in online.summary_line([_result(None, 1.0), _result(0.9, 1.0)])
    assert not math.isfinite(float(online.summary_line([_result(None, 1.0)]).split("time_ratio_vs_static=")[1].split()[0]))


def _run(seed, steps, changes, outcome="reached"):
    return {"seed": seed, "outcome": outcome, "steps": steps, "batches": [list(c) for c in changes]}


def test_a_run_on_the_common_clock_is_its_stages_steps_at_their_batches_seconds():
    clock = {64: 0.010, 128: 0.016}
    run = _run(0, 100, [(0, 64, 0.1), (30, 128, 0.2), (80, 64, 0.1)])
    assert online.clock_seconds(run, clock) == pytest.approx(30 * 0.010 + 50 * 0.016 + 20 * 0.010)
    assert online.clock_seconds(run, clock, extra_s_per_step=0.001) == pytest.approx(30 * 0.011 + 50 * 0.017 + 20 * 0.011)
    assert online.clock_seconds(_run(0, 100, [(0, 64, 0.1)], outcome="max_epochs"), clock) == math.inf


def test_arms_are_compared_seed_by_seed_and_a_seed_whose_static_run_missed_is_left_out():
    clock = {64: 0.01, 128: 0.015}
    static = [_run(0, 100, [(0, 64, 0.1)]), _run(1, 200, [(0, 64, 0.1)]), _run(2, 50, [(0, 64, 0.1)], outcome="diverged")]
    # seed 0 takes the same steps (ratio 1), seed 1 switches to 128 for half its steps and needs 140 (ratio 0.875)
    arm = [_run(0, 100, [(0, 64, 0.1)]), _run(1, 140, [(0, 64, 0.1), (70, 128, 0.2)]), _run(2, 10, [(0, 64, 0.1)])]
    assert online.paired_ratio(arm, static, clock) == pytest.approx((1.0 + (70 * 0.01 + 70 * 0.015) / 2.0) / 2)
    assert online.paired_ratio(arm, static, clock, extra_s_per_step=0.001) == pytest.approx((1.1 + (70 * 0.011 + 70 * 0.016) / 2.0) / 2)
    missed = [_run(0, 100, [(0, 64, 0.1)], outcome="max_epochs"), _run(1, 100, [(0, 64, 0.1)], outcome="max_epochs")]
    assert online.paired_ratio(missed, static, clock) is None  # every compared seed infinite: no finite median
    assert online.paired_ratio(arm, static[2:], clock) is None  # no static run reached the target
    assert online.batches_trained({"static": static, "online": arm}) == {64, 128}


def test_the_common_clock_times_every_batch_a_run_trained_at(monkeypatch):
    monkeypatch.setattr(online, "CLOCK_ROUNDS", 2)
    monkeypatch.setattr(online, "CLOCK_STEPS", 2)
    task = TASKS["digits_cnn_sgd"]
    clock = online.step_clock(task, online.task_data(task), {16, 64}, lr=0.01)
    assert set(clock) == {16, 64} and all(0 < seconds < 5 for seconds in clock.values())


def test_the_report_shows_the_changes_a_run_made_not_advice_that_came_after_it_ended():
    run = {**_run(1, 128, [(0, 512, 0.04), (122, 256, 0.03)]), "decisions": [{"step": 100, "from": 512, "to": 256}, {"step": 163, "from": 512, "to": 256}]}
    assert online.applied_changes(run) == ["512->256@122"]
    assert online.applied_changes(_run(0, 100, [(0, 64, 0.1), (50, 64, 0.2)])) == []  # an LR change only


def _truth(rows):
    """A ground-truth task: {batch: (median epochs, seeds reached, seeds)} on 1 000 training samples."""
    return {"dataset_size": 1000, "batches": {str(b): {"epochs": e, "reached_seeds": r, "seeds": n} for b, (e, r, n) in rows.items()}}


def test_what_a_constant_batch_can_buy_is_the_truths_fastest_batch_against_the_static_one_on_one_clock():
    # seconds to the target: 16: 2 x 1000/16 x 1 ms = 0.125; 64: 3 x 1000/64 x 2 ms = 0.094; 256: 8 x 1000/256 x 5 ms = 0.156;
    # 1024 is faster still (0.010 s) but most seeds missed the target there: left out
    truth = _truth({16: (2.0, 4, 4), 64: (3.0, 4, 4), 256: (8.0, 3, 4), 1024: (10.0, 2, 4)})
    clock = {16: 0.001, 64: 0.002, 256: 0.005, 1024: 0.001}
    assert online.truth_batches(truth) == [16, 64, 256]
    found = online.attainable(truth, clock, static_batch=16)
    assert found["best_batch"] == 64
    assert found["ratio_vs_static_batch"] == pytest.approx((3.0 / 64 * 0.002) / (2.0 / 16 * 0.001))
    assert online.attainable(truth, clock, static_batch=64)["ratio_vs_static_batch"] == pytest.approx(1.0)
    assert online.attainable(truth, clock, static_batch=32) is None  # no truth run at the static batch
    lines = "\n".join(online.attainable_lines([{"task": "t", "chosen_batch": 16, "attainable": found, "ratio_vs_static": {"online": 0.95}}]))
    assert "| t | 16 | 64 | 0.750 | 0.95 |" in lines and "median over 1 tasks: 0.750" in lines


def test_the_report_says_what_the_online_runs_last_advice_rested_on_and_why_it_kept_the_batch():
    answer = {"step": 240, "change": None, "why": "the best configuration on [1] is predicted 2.0% faster ...: kept",
              "predicted": {"gain": 0.02, "saving": 0.01, "best": {"global_batch": 32}},
              "evidence": {"telemetry_records": 12, "gradient_records": 3, "noise_scale": {"value": 40.0},
                           "noise_scale_from": "the job's pilot", "noise_scale_why": "the live trajectory covers 5% ..."}}  # fmt: skip
    summary = online.advice_summary(answer)
    assert summary["moved"] is False and summary["gradient_records"] == 3 and summary["best_global_batch"] == 32
    assert summary["noise_scale"] == 40.0 and summary["noise_scale_from"] == "the job's pilot"
    assert online.advice_summary(None) is None  # no answer came during the run
    runs = [{"last_advice": summary}, {"last_advice": {**summary, "gradient_records": 5, "noise_scale": 60.0}}, {"last_advice": None}]
    lines = "\n".join(online.last_advice_lines([{"task": "t", "runs": {"online": runs}}]))
    assert "| t | 4 / 12 | the job's pilot (2) | 50 | the best configuration on [1]" in lines
    assert online.last_advice_lines([{"task": "t", "runs": {"online": [{"last_advice": None}]}}]) == []
