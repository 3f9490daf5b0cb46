"""The ground-truth machinery of benchmarks/efficiency_tasks.py on tiny configurations, and the cached ground truth."""

from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import efficiency_tasks as et  # noqa: E402
from offline_data import load_data, stdlib_bytes, stdlib_corpus_info, stdlib_files, write_stdlib_token_file  # noqa: E402
from tests.handmade import spec_dict  # noqa: E402
from tula_service.spec.job_spec import JobSpec  # noqa: E402

RECORD_KEYS = {"samples", "batch", "grad_sqr", "trace_sigma", "loss", "metric", "step", "window_steps", "variability",
               "precond_grad_sqr", "precond_trace_sigma"}  # fmt: skip
TINY = et.Task("digits_x16_flat", "mlp1d", "sgd", 512, 360, 0.75, "test_acc", (16, 64), max_epochs=30,
               reference_batch=16, reference_lr=0.05, seeds=2)  # fmt: skip


def tiny_run(task: et.Task = TINY, batch: int = 32, **run) -> dict:
    return et.train_to_target({"task": asdict(task), "batch": batch, "lr": et.sqrt_scaled_lr(task, batch), "seed": 0, **run})


def test_a_split_run_reaches_an_easy_target_and_its_records_follow_the_shared_format():
    result = tiny_run(split=True)
    assert result["outcome"] == "reached" and result["final_metric"] >= TINY.target
    records = result["trajectory"]
    assert records and all(set(r) == RECORD_KEYS for r in records)
    assert sum(r["window_steps"] for r in records) == result["steps"] == records[-1]["step"]
    assert all(r["samples"] == r["step"] * 32 and r["batch"] == 32 for r in records)
    assert all(isinstance(r[k], float) for r in records for k in ("grad_sqr", "trace_sigma", "loss"))
    assert all(r["precond_grad_sqr"] is None and r["precond_trace_sigma"] is None for r in records)  # SGD
    assert records[-1]["metric"] >= TINY.target
    assert all(r["variability"] is None or r["variability"] >= 0 for r in records)
    assert any(r["trace_sigma"] > 0 for r in records)


@pytest.mark.parametrize("optimizer", ["adam", "rmsprop"])
def test_adaptive_optimizers_records_carry_the_preconditioned_pair(optimizer):
    task = replace(TINY, optimizer=optimizer, reference_lr=3e-3)
    records = tiny_run(task, split=True)["trajectory"]
    assert all(isinstance(r["precond_grad_sqr"], float) and isinstance(r["precond_trace_sigma"], float) for r in records)


@pytest.mark.parametrize("task", [TINY, et.Task("stdlib_bytes", "gpt", "adamw", 64, 16, 4.0, "val_loss", (8,), 1, 8, 1e-3,
                                                model_options={"layers": 1, "width": 16, "heads": 2}, seq_len=16)])  # fmt: skip
def test_the_accumulation_split_gives_the_full_batch_gradient_for_a_batch_norm_free_model(task):
    data = et.task_data(task)
    inputs, targets = data["train_x"][:32], data["train_y"][:32]
    model = et.task_model(task, seed=0)
    full = torch.autograd.grad(et.mean_loss(model(inputs), targets), list(model.parameters()))
    frozen = torch.optim.SGD(model.parameters(), lr=0.0)  # the step leaves the weights, p.grad holds the mean
    stats = et.accumulation_step(model, frozen, inputs, targets)
    for expected, parameter in zip(full, model.parameters()):
        assert torch.allclose(parameter.grad, expected, rtol=1e-4, atol=1e-7)
    assert math.isclose(stats["grad_norm"], float(et.flat(full).norm()), rel_tol=1e-5)


def test_splitting_does_not_change_the_epochs_of_a_batch_norm_free_model():
    assert tiny_run(split=True)["steps"] == tiny_run(split=False)["steps"]


def test_a_micro_batched_task_trains_every_seed_split_so_batch_norm_sees_the_same_micro_batches():
    task = et.Task("digits_x16", "resnet_cifar", "sgd", 256, 360, 0.5, "test_acc", (16, 32), max_epochs=4,
                   reference_batch=16, reference_lr=0.05, seeds=2, micro_batched=True)  # fmt: skip
    split, unsplit = tiny_run(task, batch=32, split=True), tiny_run(task, batch=32, split=False)
    assert split["steps"] == unsplit["steps"] and split["final_metric"] == unsplit["final_metric"]
    assert "trajectory" in split and "trajectory" not in unsplit  # statistics are kept for seed 0 only
    data, model = et.task_data(task), et.task_model(task, seed=0)  # why: batch norm's split gradient is not the whole batch's
    inputs, targets = data["train_x"][:32], data["train_y"][:32]
    whole = et.flat(torch.autograd.grad(et.mean_loss(model(inputs), targets), list(model.parameters())))
    et.accumulation_step(model, torch.optim.SGD(model.parameters(), lr=0.0), inputs, targets)
    assert not torch.allclose(et.flat([p.grad for p in model.parameters()]), whole, rtol=1e-3, atol=1e-6)


def test_a_run_with_dropout_is_the_same_run_whatever_the_global_generator_held_and_leaves_it_as_it_was():
    task = replace(TINY, model_options={"dropout": 0.3})
    torch.manual_seed(123)
    first = tiny_run(task, split=True)
    torch.manual_seed(456)
    state = torch.get_rng_state()
    second = tiny_run(task, split=True)
    assert torch.equal(torch.get_rng_state(), state)  # restored after the run
    assert first["steps"] == second["steps"] and first["trajectory"] == second["trajectory"]
    other_seed = et.train_to_target({"task": asdict(task), "batch": 32, "lr": et.sqrt_scaled_lr(task, 32), "seed": 1, "split": True})
    assert other_seed["trajectory"] != first["trajectory"]


def test_the_batch_stream_visits_every_sample_once_per_epoch():
    stream = et.BatchStream(100, torch.Generator().manual_seed(0))
    seen = torch.cat([stream.next(32) for _ in range(25)])  # 800 samples = 8 epochs, batches straddle epochs
    assert torch.equal(torch.bincount(seen, minlength=100), torch.full((100,), 8))


def test_record_windows_line_up_with_the_evaluations():
    assert et.record_window(steps=176, eval_every=8) == 4  # 3 would be ideal; 4 divides 8 and is nearer than 2
    assert et.record_window(steps=1200, eval_every=6) == 24  # 20 rounded up to a multiple of 6
    assert et.record_window(steps=1116, eval_every=31) == 31  # 19 would be ideal; 31 still gives 36 records
    assert et.record_window(steps=290, eval_every=11) == 5  # neither 1 (290 records) nor 11 (26) lines up


def test_micro_batches_keep_at_least_two_samples():
    assert [et.micro_batches(b) for b in (2, 4, 8, 1024)] == [1, 2, 4, 4]


def test_digits_x16_is_the_scikit_learn_data_in_its_train_split():
    data = load_data("digits_x16", 1437, 360)
    assert data["train_x"].shape == (1437, 1, 8, 8) and data["test_x"].shape == (360, 1, 8, 8)
    assert float(data["train_x"].min()) == 0.0 and float(data["train_x"].max()) == 1.0
    flat = load_data("digits_x16_flat", 1437, 360)
    assert torch.equal(flat["train_x"], data["train_x"].reshape(1437, 64)) and torch.equal(flat["train_y"], data["train_y"])


def test_the_noisy_label_table_is_standardized_on_its_train_split_and_a_smaller_task_trains_on_a_prefix():
    data = load_data("tabular_noisy", 16000, 4000)
    assert data["train_x"].shape == (16000, 20) and data["test_x"].shape == (4000, 20)
    assert torch.allclose(data["train_x"].mean(dim=0), torch.zeros(20), atol=1e-5)
    assert torch.allclose(data["train_x"].std(dim=0), torch.ones(20), atol=1e-4)
    assert not torch.allclose(data["test_x"].mean(dim=0), torch.zeros(20), atol=1e-5)  # the train split's statistics, not its own
    assert sorted(data["train_y"].unique().tolist()) == [0, 1, 2, 3, 4]
    smaller = load_data("tabular_noisy", 1000, 500)
    assert torch.equal(smaller["train_y"], data["train_y"][:1000]) and torch.equal(smaller["test_y"], data["test_y"][:500])
    # the labels are noisy: a linear model fitted to every train row is still wrong on about a fifth or more of them
    features = torch.cat([data["train_x"], torch.ones(16000, 1)], dim=1)
    solution = torch.linalg.lstsq(features, torch.nn.functional.one_hot(data["train_y"], 5).float()).solution
    assert (features @ solution).argmax(dim=1).ne(data["train_y"]).float().mean() > 0.2
    with pytest.raises(ValueError, match="tabular_noisy has 20000 train"):
        load_data("tabular_noisy", 20001, 100)


def test_the_imbalanced_table_has_a_majority_class_and_rare_ones_in_both_splits_standardized_on_its_train_split():
    data = load_data("tabular_imbalanced", 16000, 4000)
    assert data["train_x"].shape == (16000, 20) and data["test_x"].shape == (4000, 20)
    assert torch.allclose(data["train_x"].mean(dim=0), torch.zeros(20), atol=1e-5)
    for split, rows in (("train", 16000), ("test", 4000)):
        shares = torch.bincount(data[f"{split}_y"], minlength=5).float() / rows
        assert shares[0] > 0.65 and 0.01 < shares[4] < 0.03 and bool((shares[:-1] > shares[1:]).all())  # 70% down to 2%
    smaller = load_data("tabular_imbalanced", 1000, 500)
    assert torch.equal(smaller["train_y"], data["train_y"][:1000])
    assert not torch.equal(load_data("tabular_noisy", 1000, 500)["train_x"], smaller["train_x"])  # another table


def test_an_augmented_task_shifts_each_image_by_at_most_a_pixel_drawn_per_image_from_its_runs_seed():
    task = et.TASKS["digits_cnn_sgd_shift"]
    data = et.task_data(task)
    rows = torch.arange(256)
    images, labels = et.training_batch(task, data, rows, et.augmentation_generator(task, 3))
    assert torch.equal(labels, data["train_y"][rows])
    padded = torch.nn.functional.pad(data["train_x"][rows], (1, 1, 1, 1))
    offsets = set()
    for i in range(256):
        matches = [(dy, dx) for dy in range(3) for dx in range(3) if torch.equal(images[i], padded[i, :, dy : dy + 8, dx : dx + 8])]
        assert matches, i  # every image is its original translated by -1, 0 or +1 pixel each way, the edge zero
        offsets.update(matches)
    assert len(offsets) == 9  # every translation is drawn
    again, _ = et.training_batch(task, data, rows, et.augmentation_generator(task, 3))
    other, _ = et.training_batch(task, data, rows, et.augmentation_generator(task, 4))
    assert torch.equal(images, again) and not torch.equal(images, other)  # the run's seed sets the draws
    plain = replace(task, augment=None)
    assert et.augmentation_generator(plain, 3) is None and torch.equal(et.training_batch(plain, data, rows, None)[0], data["train_x"][rows])
    with pytest.raises(ValueError, match="Task.augment"):
        et.augmentation_generator(replace(task, augment="flip"), 0)


def test_the_stdlib_text_is_deterministic(tmp_path):
    again = b"".join(p.read_bytes() for p in sorted(stdlib_files(), key=lambda p: p.as_posix()))
    assert hashlib.sha256(again).hexdigest() == stdlib_corpus_info()["sha256"] == hashlib.sha256(stdlib_bytes()).hexdigest()
    assert not any("site-packages" in p.parts for p in stdlib_files())
    token_file = write_stdlib_token_file(tmp_path / "stdlib.txt")
    assert token_file.read_bytes() == stdlib_bytes()
    first = load_data("stdlib_bytes", 64, 16, 16)
    load_data.cache_clear()
    second = load_data("stdlib_bytes", 64, 16, 16)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert torch.equal(first["train_x"][:, 1:], first["train_y"][:, :-1])  # targets are the next bytes


def test_generate_ground_truth_writes_the_documented_layout(tmp_path, monkeypatch):
    monkeypatch.setattr(et, "TASKS", {"tiny": TINY})
    monkeypatch.setattr(et, "EPOCH_TIMING_ROUNDS", 2)
    path = tmp_path / "ground_truth.json"
    et.generate_ground_truth(["tiny"], workers=1, path=path)
    truth = et.load_ground_truth(path)
    entry = truth["tasks"]["tiny"]
    assert entry["dataset_size"] == 512 and entry["reference_batch"] == 16 and entry["optimizer"] == "sgd"
    assert entry["target"] == {"metric": "test_acc", "value": 0.75, "higher_is_better": True}
    for row in entry["batches"].values():
        assert row["reached_seeds"] == row["seeds"] == 2
        assert row["epochs_min"] <= row["epochs"] <= row["epochs_max"] and row["epoch_s"] > 0 and row["lr"] > 0
        assert row["trajectory"] and set(row["trajectory"][0]) == RECORD_KEYS
        assert row["split_check"]["steps_split"] == row["split_check"]["steps_unsplit"]


def test_the_cached_ground_truth_covers_the_required_tasks():
    truth = et.load_ground_truth()
    tasks = truth["tasks"]
    assert len(tasks) >= 5
    assert {t["optimizer"] for t in tasks.values()} >= {"sgd"} and {t["optimizer"] for t in tasks.values()} & {"adam", "adamw"}
    models = {t["task"]["model"] for t in tasks.values()}
    assert models & {"cnn1d", "small_cnn"} and "mlp1d" in models and "gpt" in models
    for name, entry in tasks.items():
        batches = sorted(int(b) for b in entry["batches"])
        assert batches[-1] / batches[0] >= 32 and batches[-1] <= entry["dataset_size"], name
        reference = entry["batches"][str(entry["reference_batch"])]
        assert reference["reached_seeds"] == reference["seeds"] >= 3 and reference["epochs"] >= 2, name
        for row in entry["batches"].values():
            assert 10 <= len(row["trajectory"]) <= 120 and set(row["trajectory"][0]) == RECORD_KEYS, name
            assert sum(r["metric"] is not None for r in row["trajectory"]) >= 2, name  # where windows meet evaluations
    assert truth["meta"]["stdlib_text"]["sha256"]


def test_the_lr_grid_goes_on_past_an_edge_that_wins_and_stops_inside_or_at_its_bound():
    step = et.LR_STEP
    assert et.next_multiplier(step, [1.0, 1 / step, step], lookahead=0) == pytest.approx(2.0)
    assert et.next_multiplier(1 / step, [1.0, 1 / step, step], lookahead=0) == pytest.approx(0.5)
    assert et.next_multiplier(1.0, [1.0, 1 / step, step], lookahead=0) is None
    assert et.next_multiplier(step, [1.0, 1 / step, step, 2.0], lookahead=0) is None  # 2 was tried and lost
    assert et.next_multiplier(et.MAX_LR_MULTIPLIER, [1.0, et.MAX_LR_MULTIPLIER]) is None
    assert et.next_multiplier(1 / et.MAX_LR_MULTIPLIER, [1.0, 1 / et.MAX_LR_MULTIPLIER]) is None


def _nearest(table: dict[float, object], run: dict) -> float:
    return min(table, key=lambda m: abs(m - run["lr_multiplier"]))


def _table_run(run: dict, steps: int) -> dict:
    """A stand-in for train_to_target whose run takes `steps` to the target, pruned at run["prune_after_steps"]."""
    limit = run.get("prune_after_steps")
    pruned = limit is not None and steps > limit
    return {"reached": not pruned, "outcome": "pruned" if pruned else "reached", "steps": min(steps, limit) if pruned else steps,
            "seed": run["seed"], "split": run.get("split", False), "lr": run["lr"], "lr_multiplier": run["lr_multiplier"]}  # fmt: skip


def test_the_lr_is_chosen_by_the_median_over_the_tuning_seeds_and_pruning_never_changes_the_winner(monkeypatch):
    # steps to the target per (multiplier, seed); seed 0 alone would pick sqrt(2) (lucky), the median picks 1
    step = et.LR_STEP
    table = {1.0: [100, 90, 95], 1 / step: [150, 140, 160], step: [60, 200, 210], 2.0: [300, 320, 330]}

    monkeypatch.setattr(et, "train_to_target", lambda run: _table_run(run, table[_nearest(table, run)][run["seed"]]))
    best, tuning = et.tune_lr(TINY, 32, list(et.LR_MULTIPLIERS), 3)
    assert best["multiplier"] == 1.0 and best["median_steps"] == 95
    assert [r["split"] for r in tuning if r["lr_multiplier"] == 1.0] == [True, False, False]  # seed 0 keeps the trajectory
    # later candidates stop at the best median: 1/sqrt 2 is pruned on its first seed, then on its second (majority)
    assert [r["outcome"] for r in tuning if r["lr_multiplier"] == 1 / step] == ["pruned", "pruned"]
    assert et.median_steps([{"reached": True, "steps": 10}, {"reached": False, "steps": 5}], 3) == math.inf
    assert et.median_steps([{"reached": True, "steps": 10}, {"reached": True, "steps": 30}, {"reached": False, "steps": 5}], 3) == 30


def test_when_no_lr_of_the_grid_reaches_the_target_the_grid_goes_on_downwards(monkeypatch):
    """Plain SGD at 16x its reference batch: the sqrt-scaled LR and its neighbours all missed, a smaller one reaches."""
    step = et.LR_STEP

    def fake_run(run):
        reached = run["lr_multiplier"] < 0.4  # only below 1 / 2 sqrt 2
        steps = 100 if reached else 400
        return {"reached": reached, "outcome": "reached" if reached else "max_epochs", "steps": steps, "seed": run["seed"],
                "split": run.get("split", False), "lr": run["lr"], "lr_multiplier": run["lr_multiplier"]}  # fmt: skip

    monkeypatch.setattr(et, "train_to_target", fake_run)
    best, tuning = et.tune_lr(TINY, 32, list(et.LR_MULTIPLIERS), 3)
    tried = sorted({round(r["lr_multiplier"], 6) for r in tuning})
    assert best["multiplier"] == pytest.approx(1 / step**3) and tried[0] == pytest.approx(1 / step**5, rel=1e-5)  # two past it (lookahead 1)
    monkeypatch.setattr(et, "train_to_target", lambda run: {**fake_run(run), "reached": False, "outcome": "max_epochs"})
    nothing, tuning = et.tune_lr(TINY, 32, list(et.LR_MULTIPLIERS), 3)
    assert nothing is None and min(r["lr_multiplier"] for r in tuning) == pytest.approx(1 / et.MAX_LR_MULTIPLIER)  # to the bound


def test_measure_batch_trains_every_seed_at_the_chosen_lr():
    task = replace(TINY, seeds=3)
    result = et.measure_batch({"task": asdict(task), "batch": 32, "tuning_seeds": 2})
    assert result["seeds"] == 3 and result["tuning_seeds"] == 2 and [r["seed"] for r in result["runs"]] == [0, 1, 2]
    assert result["runs"][0]["split"] and not any(r["split"] for r in result["runs"][1:])
    assert {r["seed"] for r in result["tuning"]} <= {0, 1} and result["trajectory"]
    lrs = {r["lr"] for r in result["tuning"] if r["lr_multiplier"] == result["lr_multiplier"]}
    assert lrs == {result["lr"]}


def test_seed_zeros_records_are_read_on_the_median_runs_clock_so_they_end_at_the_target():
    records = [{"samples": 100 * (i + 1), "batch": 10, "grad_sqr": 1.0, "trace_sigma": 5.0} for i in range(20)]  # seed 0 ends at 2000
    fast = {"epochs": 3.0, "runs": [{"epochs": 2.0, "outcome": "reached"}]}
    warped = et.as_one_run(records, fast)
    assert [r["samples"] for r in warped] == [150 * (i + 1) for i in range(20)] and warped[-1]["samples"] == 3000
    assert all(w["trace_sigma"] == r["trace_sigma"] for w, r in zip(warped, records))
    missed = {"epochs": 3.0, "runs": [{"epochs": 40.0, "outcome": "max_epochs"}]}
    assert et.as_one_run(records, missed) == records  # no clock to read them on: as they are
    assert et.as_one_run(records, {"epochs": 3.0, "runs": [{"epochs": 2.0, "reached": True}]}) == warped  # time_to_accuracy's rows


def test_adding_a_task_keeps_the_others_and_says_what_was_added(tmp_path, monkeypatch):
    plain = replace(TINY, momentum=0.0, reference_lr=0.5)
    monkeypatch.setattr(et, "TASKS", {"tiny": TINY, "tiny_plain": plain})
    monkeypatch.setattr(et, "EPOCH_TIMING_ROUNDS", 1)
    path = tmp_path / "ground_truth.json"
    et.generate_ground_truth(["tiny"], workers=1, path=path)
    before = et.load_ground_truth(path)
    et.main(["--tasks", "tiny_plain", "--add", "--workers", "1", "--out", str(path)])
    after = et.load_ground_truth(path)
    assert after["tasks"]["tiny"] == before["tasks"]["tiny"] and after["tasks"]["tiny_plain"]["task"]["momentum"] == 0.0
    assert [entry["tasks"] for entry in after["meta"]["added"]] == [["tiny_plain"]]
    assert not list(tmp_path.glob("*.adding.json"))  # the scratch file is gone
    optimizer = et.task_optimizer(plain, et.task_model(plain, 0), 0.1)
    assert optimizer.param_groups[0]["momentum"] == 0.0
    rmsprop = replace(TINY, optimizer="rmsprop", rmsprop_momentum=0.9)  # RMSprop's momentum is its own field: SGD's 0.9 default is not it
    assert et.task_optimizer(rmsprop, et.task_model(rmsprop, 0), 0.1).param_groups[0]["momentum"] == 0.9
    assert et.task_optimizer(replace(TINY, optimizer="rmsprop"), et.task_model(rmsprop, 0), 0.1).param_groups[0]["momentum"] == 0.0


def test_a_tasks_optimizer_has_its_settings_as_the_spec_names_them():
    """Built as profiling points and the pilot build the spec's optimizer (profiler.measure.make_optimizer), with the
    task's settings under the spec's names: what a user of the task would submit as training.*."""
    nesterov = replace(TINY, nesterov=True, weight_decay=5e-4)
    group = et.task_optimizer(nesterov, et.task_model(nesterov, 0), 0.1).param_groups[0]
    assert (group["momentum"], group["nesterov"], group["weight_decay"]) == (et.MOMENTUM, True, 5e-4)
    assert et.task_optimizer_settings(nesterov) == {"momentum": et.MOMENTUM, "nesterov": True, "weight_decay": 5e-4}
    adamw = replace(TINY, optimizer="adamw", betas=(0.9, 0.95), weight_decay=0.1)
    group = et.task_optimizer(adamw, et.task_model(adamw, 0), 0.1).param_groups[0]
    assert isinstance(group, dict) and group["betas"] == (0.9, 0.95) and group["weight_decay"] == 0.1 and group["decoupled_weight_decay"]
    radam = replace(TINY, optimizer="radam", weight_decay=0.01, decoupled_weight_decay=True)
    group = et.task_optimizer(radam, et.task_model(radam, 0), 0.1).param_groups[0]
    assert group["decoupled_weight_decay"] and group["weight_decay"] == 0.01 and group["betas"] == (0.9, 0.999)
    nadam = replace(TINY, optimizer="nadam")
    assert et.task_optimizer(nadam, et.task_model(nadam, 0), 0.1).param_groups[0]["momentum_decay"] == 4e-3  # PyTorch's
    adamax = replace(TINY, optimizer="adamax", betas=(0.8, 0.99), weight_decay=1e-4)
    group = et.task_optimizer(adamax, et.task_model(adamax, 0), 0.1).param_groups[0]
    assert type(et.task_optimizer(adamax, et.task_model(adamax, 0), 0.1)).__name__ == "Adamax" and group["betas"] == (0.8, 0.99)
    adafactor = replace(TINY, optimizer="adafactor", weight_decay=1e-3)
    group = et.task_optimizer(adafactor, et.task_model(adafactor, 0), 0.1).param_groups[0]
    assert type(et.task_optimizer(adafactor, et.task_model(adafactor, 0), 0.1)).__name__ == "Adafactor" and group["weight_decay"] == 1e-3
    assert group["eps"] == (None, 1e-3) and group["d"] == 1.0 and group["beta2_decay"] == -0.8  # PyTorch's
    for task in (nesterov, adamw, replace(TINY, optimizer="rmsprop", rmsprop_momentum=0.9), radam, nadam, adamax, adafactor):
        training = {"reference_batch": 16, "reference_epochs": 3, "optimizer": task.optimizer, **et.task_optimizer_settings(task)}
        assert JobSpec.model_validate(spec_dict(training=training)).training.optimizer == task.optimizer  # the spec takes them


def test_the_momentum_ablation_in_worker_processes_gives_what_it_gives_in_one(tmp_path, monkeypatch):
    import statistical_efficiency as se

    monkeypatch.setattr(et, "TASKS", {"tiny": TINY})
    monkeypatch.setattr(et, "EPOCH_TIMING_ROUNDS", 1)
    path = tmp_path / "ground_truth.json"
    et.generate_ground_truth(["tiny"], workers=1, path=path)
    serial = se.momentum_ablation(["tiny"], 0.0, path, workers=1)[0]
    parallel = se.momentum_ablation(["tiny"], 0.0, path, workers=2)[0]  # spawned processes train the same seeds
    assert serial["steps"] == parallel["steps"] and serial["lr"] == parallel["lr"] and list(serial["steps"]) == ["16", "64"]
    assert serial["momentum"] == 0.0 and serial["truth_momentum"] == et.MOMENTUM


def test_check_lr_trains_every_seed_at_each_lr_and_names_the_best_against_the_tuned_one():
    """An LR too small to train misses on every seed (infinitely slow, as in the tuning); the report's last line
    compares the best checked LR with the ground truth's tuned one."""
    checked = et.check_lr(TINY, 32, [TINY.reference_lr, 1e-7], seeds=2)
    assert checked[1e-7]["reached"] == 0 and checked[1e-7]["median_epochs"] == float("inf")
    assert checked[TINY.reference_lr]["reached"] == 2 and 0 < checked[TINY.reference_lr]["median_epochs"] <= TINY.max_epochs
    good = checked[TINY.reference_lr]["median_epochs"]
    lines = et.check_lr_report("tiny", 32, checked, {"lr": 1.00001e-7, "epochs": 2 * good})
    assert lines[-1] == (f"lr_check: task=tiny batch=32 tuned_lr=1e-07 tuned_epochs={2 * good:.3g} tuned_over_best=2.00 "
                         f"tuned_here=inf tuned_here_over_best=inf best_lr={TINY.reference_lr:.4g} best_epochs={good:.3g}")  # fmt: skip
    assert len(lines) == 3 and "reached=0/2" in lines[1]
    unchecked = et.check_lr_report("tiny", 32, checked, {"lr": 0.3, "epochs": good})[-1]  # the tuned LR not among them
    assert "tuned_over_best=1.00 best_lr" in unchecked and "tuned_here" not in unchecked


def test_with_lookahead_the_grid_goes_on_past_an_lr_that_lost_by_chance(monkeypatch):
    """Steps fall with the LR up to 4x, but 2 sqrt 2 loses on its seeds by chance: lookahead 0 stops at 2 (the
    truth's rule until 2026-12-05), lookahead 1 tries 4 as well and takes it; with 0 the rule is the one of next_multiplier's test."""
    step = et.LR_STEP
    table = {0.5: 200, 1 / step: 150, 1.0: 120, step: 100, 2.0: 80, 2 * step: 90, 4.0: 50, 4 * step: 70, 8.0: 90}

    monkeypatch.setattr(et, "train_to_target", lambda run: _table_run(run, table[_nearest(table, run)]))
    best, _ = et.tune_lr(TINY, 32, list(et.LR_MULTIPLIERS), 3, lookahead=0)
    assert best["multiplier"] == pytest.approx(2.0)
    best, tuning = et.tune_lr(TINY, 32, list(et.LR_MULTIPLIERS), 3, lookahead=1)
    tried = sorted({round(r["lr_multiplier"], 6) for r in tuning})
    assert best["multiplier"] == pytest.approx(4.0)
    assert tried[-1] == pytest.approx(8.0) and tried[0] == pytest.approx(1 / step)  # two past the best; nothing more down
    assert et.next_multiplier(2.0, [1.0, 1 / step, step, 2.0, 2 * step], lookahead=1) == pytest.approx(4.0)
    assert et.next_multiplier(1.0, [1 / step, 1.0, step, 2.0], lookahead=1) == pytest.approx(0.5)  # one inside the top, at the bottom
    assert et.next_multiplier(1.0, [0.5, 1 / step, 1.0, step, 2.0], lookahead=1) is None


def _fake_truth_runs(monkeypatch, task: et.Task, tables: dict[int, dict[float, int | list[int]]]) -> list[tuple[int, int, int]]:
    """Stand-ins for the training (steps per batch, multiplier, and seed where a list) and the epoch timing of
    `task` as the only task; returns the list of (batch, grid index, seed) trained, which grows as runs train."""
    trained: list[tuple[int, int, int]] = []

    def fake_run(run):
        trained.append((run["batch"], et.grid_index(run["lr_multiplier"]), run["seed"]))
        steps = tables[run["batch"]][_nearest(tables[run["batch"]], run)]
        steps = steps[run["seed"]] if isinstance(steps, list) else steps
        result = {**_table_run(run, steps), "batch": run["batch"], "epochs": steps * run["batch"] / task.train_samples,
                  "final_metric": 0.8, "train_s": 0.01}  # fmt: skip
        return {**result, "trajectory": [{"samples": steps * run["batch"]}]} if run.get("split") else result

    monkeypatch.setattr(et, "TASKS", {"tiny": task})
    monkeypatch.setattr(et, "train_to_target", fake_run)
    monkeypatch.setattr(et, "epoch_seconds_in_rounds", lambda job: {"epoch_s": {b: {"epoch_s": 0.5, "rounds_s": [0.5]} for b in task.batches}})
    return trained


def test_retuning_with_a_lookahead_reuses_the_stored_runs_and_gives_what_tuning_afresh_gives(tmp_path, monkeypatch):
    """Batch 64's steps fall with the LR up to 4x but 2 sqrt 2 loses by chance (lookahead 0 stops at 2); batch 16's
    best is 1, inside. Re-tuning the stored truth with lookahead 1 trains only multipliers the stored tuning had not
    tried, moves batch 64 to 4 (every seed measured again there, its epoch timing kept), keeps batch 16's row but
    for its longer tuning, and leaves the same truth as generating it with lookahead 1 from the start."""
    step = et.LR_STEP
    tables = {64: {0.5: 200, 1 / step: 150, 1.0: 120, step: 100, 2.0: 80, 2 * step: 90, 4.0: 50, 4 * step: 70, 8.0: 90},
              16: {0.25: 300, 0.5: 200, 1 / step: 150, 1.0: 100, step: 130, 2.0: 160}}  # fmt: skip
    trained = _fake_truth_runs(monkeypatch, TINY, tables)
    path, fresh = tmp_path / "ground_truth.json", tmp_path / "fresh.json"
    before = et.generate_ground_truth(["tiny"], workers=1, path=path, lookahead=0)
    assert before["tasks"]["tiny"]["batches"]["64"]["lr_multiplier"] == pytest.approx(2.0)
    stored = {(int(b), et.grid_index(r["lr_multiplier"])) for b, row in before["tasks"]["tiny"]["batches"].items() for r in row["tuning"]}
    trained.clear()
    et.main(["--retune", "--lr-lookahead", "1", "--workers", "1", "--out", str(path)])
    after = et.load_ground_truth(path)
    assert trained and not {(b, index) for b, index, _ in trained} & stored  # nothing stored trained again
    rows, old = after["tasks"]["tiny"]["batches"], before["tasks"]["tiny"]["batches"]
    assert rows["64"]["lr_multiplier"] == pytest.approx(4.0) and rows["64"]["epochs"] == 50 * 64 / 512 and rows["64"]["epoch_s"] == 0.5
    assert {k: v for k, v in rows["16"].items() if k != "tuning"} == {k: v for k, v in old["16"].items() if k != "tuning"}
    assert len(rows["16"]["tuning"]) > len(old["16"]["tuning"]) and rows["16"]["tuning"][: len(old["16"]["tuning"])] == old["16"]["tuning"]
    assert after["meta"]["lr_lookahead"] == 1 and after["meta"]["retuned"][-1]["moved"] == {"tiny": [64]}
    et.generate_ground_truth(["tiny"], workers=1, path=fresh, lookahead=1)
    afresh = et.load_ground_truth(fresh)["tasks"]["tiny"]["batches"]
    drop = ("job_wall_s", "runs")  # wall time; the seeds' train_s
    for batch in ("16", "64"):
        assert {k: v for k, v in rows[batch].items() if k not in drop} == {k: v for k, v in afresh[batch].items() if k not in drop}


def test_retuning_refuses_a_task_defined_otherwise_than_its_truth(tmp_path, monkeypatch):
    monkeypatch.setattr(et, "TASKS", {"tiny": TINY})
    monkeypatch.setattr(et, "EPOCH_TIMING_ROUNDS", 1)
    path = tmp_path / "ground_truth.json"
    et.generate_ground_truth(["tiny"], workers=1, path=path)
    monkeypatch.setattr(et, "TASKS", {"tiny": replace(TINY, target=0.7)})
    with pytest.raises(ValueError, match="tiny is not defined as when its truth was made"):
        et.retune_ground_truth(["tiny"], 1, path, lookahead=1)


def test_the_lookaheads_winner_stands_only_where_it_wins_on_every_seed(tmp_path, monkeypatch):
    """At batch 64, 4x wins on the 3 tuning seeds (50 steps against 2x's 80) but loses on 4 of the other 4: measured
    on all 7 seeds its median is 200, so 2x (80 on every seed) stands, 4x its runner-up; the same from a fresh
    generation and from re-tuning a lookahead-0 truth (which says the batch held)."""
    step = et.LR_STEP
    task = replace(TINY, seeds=7)
    tables = {64: {0.5: 200, 1 / step: 150, 1.0: 120, step: 100, 2.0: 80, 2 * step: 90, 4.0: [50, 50, 50, 200, 200, 200, 200],
                   4 * step: 70, 8.0: 90},
              16: {0.5: 200, 1 / step: 150, 1.0: 100, step: 130, 2.0: 160}}  # fmt: skip
    _fake_truth_runs(monkeypatch, task, tables)
    fresh = et.generate_ground_truth(["tiny"], workers=1, path=tmp_path / "fresh.json", lookahead=1)["tasks"]["tiny"]["batches"]
    assert fresh["64"]["lr_multiplier"] == pytest.approx(2.0) and fresh["64"]["epochs"] == 80 * 64 / 512
    assert fresh["64"]["runner_up"]["lr_multiplier"] == pytest.approx(4.0) and fresh["64"]["runner_up"]["epochs"] == 200 * 64 / 512
    assert fresh["64"]["trajectory"] == [{"samples": 80 * 64}]  # seed 0 of the LR that stands
    assert fresh["16"]["runner_up"] is None  # the lookahead did not move it
    path = tmp_path / "ground_truth.json"
    et.generate_ground_truth(["tiny"], workers=1, path=path, lookahead=0)
    retuned = et.retune_ground_truth(["tiny"], 1, path, lookahead=1)
    assert retuned["meta"]["retuned"][-1]["held"] == {"tiny": [64]} and retuned["meta"]["retuned"][-1]["moved"] == {}
    drop = ("job_wall_s", "runs")
    for batch in ("16", "64"):
        assert {k: v for k, v in retuned["tasks"]["tiny"]["batches"][batch].items() if k not in drop} == {
            k: v for k, v in fresh[batch].items() if k not in drop}, batch  # fmt: skip


@pytest.mark.parametrize("name", ["digits_mlp_adamax", "digits_mlp_rmsprop_centered", "digits_mlp_adagrad"])
def test_the_users_logger_gives_the_ground_truths_preconditioned_records(name):
    """The product's path (profiler.reference_logger in a plain accumulation loop) against the trajectory the benchmark
    validated (the cached ground truth's reference run, its P read after each step): the first 8 records of the digits
    MLP under Adamax and under centered RMSprop, where P read before the step (the logger's until 2026-12-07) gave
    records' preconditioned noise scales of 1e7-1e9 and a read of 18 483 and 20 917 against 54 and 118."""
    from profiler.reference_logger import GradientStatsLogger

    torch.set_num_threads(1)
    task, truth = et.TASKS[name], et.load_ground_truth(et.DEFAULT_PATH)["tasks"][name]
    reference = truth["batches"][str(task.reference_batch)]
    stored = reference["trajectory"][:8]
    window, batch, k = stored[0]["window_steps"], task.reference_batch, et.micro_batches(task.reference_batch)
    data, model = et.task_data(task), et.task_model(task, 0)
    optimizer = et.task_optimizer(task, model, reference["lr"])
    stream = et.BatchStream(task.train_samples, torch.Generator().manual_seed(10_000))
    records = []
    with GradientStatsLogger(None, model, optimizer, every=window, accumulation=k) as logger:
        for step in range(stored[-1]["step"]):
            rows = stream.next(batch)
            for group in optimizer.param_groups:
                group["lr"] = et.scheduled_lr(task, batch, reference["lr"], step)
            optimizer.zero_grad()
            for x, y in zip(data["train_x"][rows].chunk(k), data["train_y"][rows].chunk(k)):
                (et.mean_loss(model(x), y) / k).backward()
            record = logger.step(loss=0.0)
            optimizer.step()
            records += [record] if record is not None else []
    assert [r["step"] for r in records] == [r["step"] for r in stored]
    for mine, theirs in zip(records[1:], stored[1:]):  # the first window's first step has no second moment in either
        for prefix in ("", "precond_"):  # stored to 6 digits; |G|^2 is a difference, so within a share of tr(Sigma)
            trace = theirs[prefix + "trace_sigma"]  # float32 training on another CPU drifts: 1.6e-4 by the 8th record (centered RMSprop)
            assert mine[prefix + "trace_sigma"] == pytest.approx(trace, rel=1e-3)
            assert mine[prefix + "grad_sqr"] == pytest.approx(theirs[prefix + "grad_sqr"], rel=1e-3, abs=1e-4 * abs(trace))


def test_a_stored_rows_lr_is_trained_again_at_the_lr_it_trained_at_not_its_six_digits():
    """The truth keeps 6 digits of each row's LR, and a relative change of 1e-6 changes a run's epochs: a run trained
    again takes the grid's LR, LR_STEP ** index x sqrt_scaled_lr (digits_cnn_rmsprop's reference batch: 0.001 x 2^2.5)."""
    task = et.TASKS["digits_cnn_rmsprop"]
    row = {"lr": 0.00565685, "lr_multiplier": 5.65685}  # as ground_truth.json stores its reference batch
    assert et.trained_lr(task, 32, row) == pytest.approx(0.001 * 2**2.5, rel=1e-15)
    assert abs(et.trained_lr(task, 32, row) / row["lr"] - 1) > 1e-7  # not the stored digits
    assert et.trained_lr(task, 128, {"lr_multiplier": 0.707107}) == pytest.approx(0.001 * math.sqrt(128 / 32) / math.sqrt(2), rel=1e-15)


def test_the_readmes_table_of_measured_epochs_is_the_ground_truths():
    """The table is rewritten whenever the committed truth is (ground_truth_table): a task added or re-tuned cannot
    leave it stale, as the hand-written one for the first seven tasks was."""
    import ground_truth_table

    readme = et.README_PATH.read_text()
    assert ground_truth_table.readme_block(et.load_ground_truth()) in readme
    row = {"epochs": 17.1, "epochs_min": 13.5, "epochs_max": None, "reached_seeds": 7, "seeds": 8}
    assert ground_truth_table.epochs_cell(row, reference=False) == "17.1 [13.5, inf] (7/8)"
    assert ground_truth_table.epochs_cell({**row, "epochs": None, "reached_seeds": 0, "seeds": 1}, reference=False) == "missed (0/1)"
    assert ground_truth_table.epochs_cell({**row, "epochs_max": 20.0, "reached_seeds": 8}, reference=True) == "**17.1** [13.5, 20]"
    assert ground_truth_table.epochs_cell(None, reference=False) == "–"
