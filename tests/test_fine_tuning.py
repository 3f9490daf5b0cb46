"""The fine-tuning tasks: their pretrained weights are made offline, deterministically, from data the task never
sees; every seed starts from them; and benchmarks/fine_tuning.py runs the service's pilot from them and without."""

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import efficiency_tasks as et  # noqa: E402
import fine_tuning  # noqa: E402
import pretrained  # noqa: E402
from dataclasses import replace  # noqa: E402

RECIPE = "mnist1d_mlp_classes0to4"


@pytest.fixture
def weights_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(pretrained, "PRETRAINED_DIR", tmp_path)
    return tmp_path


def test_pretraining_is_deterministic_and_trains_on_its_classes_of_another_draw():
    recipe = replace(pretrained.PRETRAININGS[RECIPE], epochs=1)
    first, second = pretrained.pretrain(recipe), pretrained.pretrain(recipe)
    assert all(torch.equal(first[key], second[key]) for key in first)
    inputs, labels = pretrained.source_data(recipe)
    assert set(labels.tolist()) == set(recipe.classes) and len(labels) > 0.4 * recipe.samples
    task = et.TASKS["mnist1d_mlp_sgd_finetune"]
    data = et.task_data(task)
    seen = {tuple(row) for row in torch.cat([data["train_x"], data["test_x"]]).round(decimals=4).tolist()}
    assert not any(tuple(row) in seen for row in inputs.round(decimals=4).tolist())  # an independent draw


def test_every_seed_of_a_fine_tuning_task_starts_from_the_pretrained_file(weights_dir):
    task = replace(et.TASKS["mnist1d_mlp_sgd_finetune"], pretrained=RECIPE)
    path = pretrained.pretrained_weights(RECIPE)
    assert path.parent == weights_dir and path.exists()
    saved = torch.load(path, weights_only=True)
    for seed in (0, 1):
        state = et.task_model(task, seed).state_dict()
        assert all(torch.equal(state[key], saved[key]) for key in saved)
    scratch = et.task_model(replace(task, pretrained=None), 0).state_dict()
    assert not all(torch.equal(scratch[key], saved[key]) for key in saved)
    # the weights already know five classes: accuracy well above chance (0.1) before any fine-tuning step
    assert et.evaluate(task, et.task_model(task, 0), et.task_data(task)) > 0.25


def test_the_jobs_of_both_arms_differ_only_in_initial_weights(weights_dir, monkeypatch):
    monkeypatch.setenv("TULA_DATA_ROOTS", str(weights_dir))
    truth = fine_tuning.se.Task(name="mnist1d_mlp_sgd_finetune", source="cpu", dataset_size=4000, optimizer="sgd", reference_batch=32,
                                target="test_acc >= 0.62", epochs={32: 5.0, 64: 6.0}, epochs_range={}, seconds_per_epoch={},
                                trajectories={}, lr={32: 0.02})  # fmt: skip
    with_weights = fine_tuning.job_spec("mnist1d_mlp_sgd_finetune", truth, "initial_weights", 50)
    without = fine_tuning.job_spec("mnist1d_mlp_sgd_finetune", truth, "random_init", 50)
    assert with_weights.initial_weights == str(weights_dir / f"{RECIPE}.pt") and without.initial_weights is None
    assert with_weights.model_dump(exclude={"initial_weights"}) == without.model_dump(exclude={"initial_weights"})
    assert with_weights.profiling.pilot and with_weights.profiling.pilot_steps == 50
    assert with_weights.training.reference_lr == 0.02 and with_weights.training.momentum == 0.9


def test_the_quick_benchmark_runs_both_pilots_and_ends_with_its_summary_line(capsys):
    if not fine_tuning.fine_tuning_tasks() or "mnist1d_mlp_sgd_finetune" not in et.load_ground_truth(et.DEFAULT_PATH)["tasks"]:
        pytest.skip("no fine-tuning task in the committed ground truth")
    before = os.environ.get("TULA_DATA_ROOTS")
    assert fine_tuning.main(["--quick"]) == 0
    assert os.environ.get("TULA_DATA_ROOTS") == before  # the benchmark's data root is gone again
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("fine_tuning: tasks=1 median_epochs_err_pct_initial_weights=")
    assert "max_regret_random_init=" in last
