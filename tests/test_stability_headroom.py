"""The stability-headroom benchmark: headrooms land on the nearest record, a binding cap raises the predicted
epochs and a loose one changes nothing, a few measured steps, and a --quick run end to end on the cache."""

from __future__ import annotations

import contextlib
import io
import re
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.test_statistical_efficiency import synthetic_task

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import stability_headroom as sh  # noqa: E402

LAST_LINE = re.compile(
    r"^stability_headroom: tasks=(\d+) capped_tasks=(\d+) median_epochs_err_pct_without=([\d.]+) median_epochs_err_pct_with=([\d.]+) "
    r"worst_task_err_pct_without=([\d.]+) worst_task_err_pct_with=([\d.]+) advised_inside_cap_interval=(\d+)/(\d+)$"
)


def test_each_headroom_goes_to_the_record_nearest_in_samples_and_the_smaller_one_stays():
    records = [{"samples": 100, "loss": 1.0}, {"samples": 200}, {"samples": 300}]
    points = [
        {"samples": 140, sh.KEY: 5.0},  # nearest: 100
        {"samples": 150, sh.KEY: 7.0},  # a tie between 100 and 200: the later record, as a logger attaches it to the next one
        {"samples": 290, sh.KEY: 3.0},
        {"samples": 310, sh.KEY: 2.0},  # the same record again: the smaller headroom stays
        {"samples": 1000, sh.KEY: None},  # nothing measurable there
    ]
    out = sh.se.attach_headroom(records, points)
    assert [r.get(sh.KEY) for r in out] == [5.0, 7.0, 2.0]
    assert out[0]["loss"] == 1.0 and all(sh.KEY not in r for r in records)  # copies; the records are untouched
    assert sh.se.attach_headroom([], points) == []
    with_lr = sh.se.attach_headroom(records, [{"samples": 290, sh.KEY: 3.0, "lr": 0.1}, {"samples": 310, sh.KEY: 4.0, "lr": 0.05}])
    assert (with_lr[2][sh.KEY], with_lr[2]["stability_lr"]) == (4.0, 0.05)  # 4 x 0.05 < 3 x 0.1: the more restrictive LR


def measured(headroom: float, task) -> dict:
    end = task.trajectories[task.reference_batch][-1]["samples"]
    return {"points": [{"fraction": f, "step": 0, "samples": round(f * end), sh.KEY: headroom * (1 + f), "sharpness": 1.0, "lr": 0.1}
                       for f in (0.5, 1.0)]}  # fmt: skip


def test_a_binding_headroom_raises_the_predicted_epochs_and_a_loose_one_changes_nothing():
    task = synthetic_task(noise_scale=400.0)
    task.lr = {b: 0.1 for b in task.epochs}
    loose = sh.evaluate(task, measured(1e3, task))
    assert loose["headroom"] == pytest.approx(1.5e3) and not loose["binds"]
    assert loose["predicted_with"] == pytest.approx(loose["predicted_without"])
    assert loose["scores"]["tuned_without"]["median_abs_err_pct"] == pytest.approx(0.0, abs=0.05)  # the truth is the model's curve
    assert loose["max_lr_multiplier_uncapped"] == pytest.approx((1 + 400 / 32) / (1 + 400 / 1024))

    tight = sh.evaluate(task, measured(1.0, task))  # min h = 1.5, below the AdaScale multipliers past 2 B_ref
    assert tight["headroom"] == pytest.approx(1.5) and tight["binds"] and 1024 in tight["binds_at"] and 32 not in tight["binds_at"]
    assert tight["predicted_with"]["32"] == pytest.approx(tight["predicted_without"]["32"])
    assert tight["predicted_with"]["1024"] > 1.5 * tight["predicted_without"]["1024"]
    assert all(tight["predicted_with"][b] >= tight["predicted_without"][b] * (1 - 1e-9) for b in tight["predicted_with"])
    assert tight["lr_multiplier_capped"]["1024"] == pytest.approx(1.5)
    assert tight["scores"]["tuned_with"]["median_abs_err_pct"] > 10.0
    line = sh.summary_line([loose, tight])
    assert LAST_LINE.match(line) and "capped_tasks=1 " in line


def test_measuring_a_few_steps_gives_the_headroom_of_the_formula():
    from efficiency_tasks import TASKS

    task = TASKS["digits_mlp_sgd_plain"]
    result = sh.measure_task({"name": "digits_mlp_sgd_plain", "task": asdict(task), "lr": 0.5, "steps": 4, "measurements": 2})
    assert [p["step"] for p in result["points"]] == [2, 4] and result["outcome"] == "done"
    for point in result["points"]:
        assert point["lr"] == 0.5 and point["samples"] == point["step"] * task.reference_batch
        assert point[sh.KEY] == pytest.approx(2.0 / (0.5 * point["sharpness"]))  # plain SGD: 2 / (eta lambda_max)
    assert sh.measurement_steps(171) == [21, 43, 64, 86, 107, 128, 150, 171] and sh.measurement_steps(3) == [1, 2, 3]


def test_measuring_leaves_batch_norms_running_statistics_so_the_run_trains_and_evaluates_as_without_it():
    from efficiency_tasks import TASKS

    task = TASKS["digits_resnet_sgd"]
    job = {"name": "digits_resnet_sgd", "task": asdict(task), "lr": 0.05, "steps": 6}
    measured_twice = sh.measure_task({**job, "measurements": 2})["points"]  # at steps 3 and 6
    measured_once = sh.measure_task({**job, "measurements": 1})["points"]  # at step 6 only
    assert [p["step"] for p in measured_twice] == [3, 6] and [p["step"] for p in measured_once] == [6]
    assert measured_twice[-1]["test_acc"] == measured_once[-1]["test_acc"]
    assert measured_twice[-1]["sharpness"] == pytest.approx(measured_once[-1]["sharpness"], rel=1e-3)


def test_quick_evaluates_the_cache_into_a_temporary_folder_and_prints_the_last_line(tmp_path):
    assert sh.DEFAULT_CACHE.exists(), "no cache: run .venv/bin/python benchmarks/stability_headroom.py"
    tracked = {p: p.read_bytes() for p in (sh.DEFAULT_CACHE, sh.DEFAULT_CACHE.with_suffix(".md")) if p.exists()}
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        assert sh.main(["--quick", "--out", str(tmp_path)]) == 0
    last = stdout.getvalue().strip().splitlines()[-1]
    match = LAST_LINE.match(last)
    assert match, last
    assert int(match.group(1)) == len(sh.json.loads(sh.DEFAULT_CACHE.read_text())["tasks"])
    assert (tmp_path / "stability_headroom.md").read_text().count(last) == 1
    assert {p: p.read_bytes() for p in tracked} == tracked  # nothing tracked was written
